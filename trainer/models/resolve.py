"""Resolve a model name to a directory, building and caching it on first use.

The cache is one directory per (name, parameters, format version). A build runs in a temporary sibling
directory that is renamed into place when complete: ``rename`` is atomic, so a directory under its final
name is always whole. A file lock makes concurrent resolvers (two policy ranks on one host) wait for the
first build instead of repeating it; the rename alone would still keep them correct without the lock.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from urllib.parse import parse_qsl

from trainer.models.errors import ModelNotFoundError

# Bump when a build's output changes (tokenizer settings, dtype, ...) so stale caches are not reused.
_FORMAT_VERSION = 1
# builtin:tiny's own: 2 since it has 2 heads (head_dim 32, which vLLM's CPU attention needs), not 4.
TINY_VERSION = 2

EMBEDDED = {"smollm2-135m-instruct", "gemma3-270m"}
BUILTIN = {"tiny"}
_TINY_PARAMS = {
    "hidden_size",
    "num_layers",
    "num_heads",
    "intermediate_size",
    "seed",
    "embed_scale",
    "experts",
}


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The directory that holds the built models: ``cache_dir``, else ``$KUBERL_CACHE/models``,
    else ``~/.cache/kuberl/models``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    base = os.environ.get("KUBERL_CACHE")
    return (Path(base).expanduser() if base else Path.home() / ".cache" / "kuberl") / "models"


def resolve_model(name: str, cache_dir: str | os.PathLike | None = None, key: str = "model.name") -> str:
    """Return a local directory for ``embedded:``/``builtin:`` names, or ``name`` unchanged when it is
    a model directory or could be a hub id; errors name ``key``, the setting that held ``name``."""
    kind, sep, rest = name.partition(":")
    if not sep or kind not in {"embedded", "builtin"}:
        return hub_id_or_directory(name, key)
    root = cache_root(cache_dir)
    if kind == "embedded":
        if rest not in EMBEDDED:
            raise ModelNotFoundError(
                f"unknown model {name!r}; embedded models: {', '.join(sorted(EMBEDDED))}"
            )
        import trainer.models.embedded as embedded

        if rest == "gemma3-270m":
            chunks, sha256 = embedded.find_gemma3_chunks()  # fails early when the packages are missing
            return str(
                _cached(
                    root,
                    f"{rest}-v{_FORMAT_VERSION}",
                    lambda out: embedded.convert_gemma3(chunks, sha256, out),
                )
            )
        gguf = (
            embedded.find_smollm2_gguf()
        )  # fails early, before any lock or temp dir, when the package is missing
        return str(
            _cached(root, f"{rest}-v{_FORMAT_VERSION}", lambda out: embedded.convert_smollm2(gguf, out))
        )

    base, _, query = rest.partition("?")
    if base not in BUILTIN:
        raise ModelNotFoundError(f"unknown model {name!r}; builtin models: {', '.join(sorted(BUILTIN))}")
    params = _parse_tiny_params(name, query)
    key = "tiny" + "".join(f"-{k}{v}" for k, v in sorted(params.items())) + f"-v{TINY_VERSION}"
    from trainer.models.tiny import build_tiny_model

    return str(_cached(root, key, lambda out: build_tiny_model(out, **params)))


def hub_id_or_directory(name: str, key: str = "model.name", need_config: bool = True) -> str:
    """``name`` itself when it is a model directory or could be a hub id; a one-line error otherwise.

    A hub id is ``name`` or ``org/name``: it never starts with ``/``, ``.`` or ``~`` and has at most one
    slash. Anything else is meant as a local path, and must be a directory (holding a ``config.json``
    when ``need_config``: a model, not only a tokenizer).
    """
    path = Path(name).expanduser()
    if path.is_dir():
        if need_config and not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"{key}={name}: the directory has no config.json, so it is not a Hugging Face model "
                "directory; point it at one (e.g. the output of make convert)"
            )
        return str(path)
    looks_like_path = name.startswith(("/", ".", "~")) or name.count("/") > 1 or not name.strip()
    if looks_like_path or path.exists():
        raise ModelNotFoundError(
            f"{key}={name}: no such local directory, and not a hub id either (those read org/name); "
            "pass an existing model directory, a hub id, or embedded:smollm2-135m-instruct"
        )
    return name


def _parse_tiny_params(name: str, query: str) -> dict[str, int]:
    params: dict[str, int] = {}
    for k, v in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        if k not in _TINY_PARAMS:
            raise ModelNotFoundError(
                f"model {name!r}: unknown parameter {k!r}; allowed: {', '.join(sorted(_TINY_PARAMS))}"
            )
        try:
            params[k] = int(v)
        except ValueError:
            raise ModelNotFoundError(f"model {name!r}: {k} must be an integer, got {v!r}") from None
    return params


def _cached(root: Path, key: str, build: Callable[[str], object]) -> Path:
    """Return ``root/key``, running ``build(tmp_dir)`` and renaming it into place if it is absent."""
    final = root / key
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        try:
            if final.is_dir():  # another process built it while we waited
                return final
            for stale in root.glob(f".{key}.tmp-*"):  # left by a killed build; nobody else holds the lock
                shutil.rmtree(stale, ignore_errors=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=root))
            try:
                build(str(tmp))
                tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any model dir
                os.rename(tmp, final)
            except OSError:
                if not final.is_dir():  # a lock-less writer (e.g. another host on NFS) won the rename
                    raise
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return final
