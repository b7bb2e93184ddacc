"""``python -m trainer.tools.convert --checkpoint CKPT/step_N --output DIR``: a training checkpoint as a
Hugging Face model directory (safetensors shards, config, generation config, tokenizer).

The policy weights in a checkpoint are a torch.distributed.checkpoint (DCP) directory written by
every FSDP rank, each rank its own slices. This converter needs no process group and no GPU, and it
never holds the whole model: it reads the DCP metadata (names, shapes, dtypes), plans the output
shards from it, then asks DCP for only the tensors of one output shard at a time (DCP reads just
those byte ranges), writes that shard and frees it. Peak memory is about one output shard
(``--max-shard-size``) plus the interpreter, however large the model.

The tensor names are the HF model's own ``state_dict()`` names. The model is also built on the meta
device from ``hf_config/config.json`` (no memory) to check names and shapes, to find the tied
weights (with ``tie_word_embeddings`` the checkpoint holds ``model.embed_tokens.weight`` only, and so
does the output: from_pretrained re-ties ``lm_head``), and to undo transformers' load-time weight
renamings, as ``save_pretrained`` does. Like NeMo-RL's ``convert_dcp_to_hf`` and verl's model merger,
the output loads with ``AutoModelForCausalLM.from_pretrained``; unlike their whole-state-dict loads,
it streams.

A LoRA run's checkpoint (``policy.lora``; ``policy/lora.json`` says so) holds the adapters alone. It
converts to a PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``, the
tokenizer), which plain ``peft`` (``PeftModel.from_pretrained``) and vLLM load over the base model; or,
with ``--merge``, to a Hugging Face model with the adapters folded into the base weights
(``W + alpha/r * B @ A``, in float32), read from the base model the run trained (``--base`` overrides
it). The merge holds the whole model in memory, unlike the streamed conversion above.

Only committed checkpoints convert: a ``step_N`` without the ``COMMITTED`` marker (a save that was
cut off, see :mod:`trainer.checkpoint`) is refused with the latest complete step to use instead.

The output is written into ``DIR.tmp`` and renamed into place, so ``DIR`` is either whole or absent.
This is the converter's own output directory on local or hierarchical storage; unlike checkpoints,
it is not written concurrently by many ranks, so a rename that a flat GCS bucket refuses fails the
conversion with the OS error and leaves the source checkpoint untouched.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from trainer.checkpoint import MARKER, is_complete, step_number

USAGE_HINT = "python -m trainer.tools.convert --checkpoint CKPT_DIR/step_N --output OUT_DIR"
WEIGHTS, HF_CONFIG, TOKENIZER = "policy/weights", "policy/hf_config", "policy/tokenizer"
_DTYPES = ("bfloat16", "float16", "float32")
_WEIGHT_FILES = re.compile(r".*\.(safetensors|bin|pt|pth|gguf)$|.*\.safetensors\.index\.json$")


class ConvertError(Exception):
    """A problem with the input or output; the message is one line meant for people."""


@dataclass
class Entry:
    """One tensor of the checkpoint: its HF name, shape and stored dtype (from the DCP metadata)."""

    name: str
    shape: tuple[int, ...]
    dtype: object  # torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def nbytes(self, dtype) -> int:
        return self.numel * dtype.itemsize


# ----- inputs ---------------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """``"2GB"`` -> 2_000_000_000, ``"500MiB"`` -> 524_288_000, ``"123"`` -> 123 bytes (as transformers)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", str(text), flags=re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise ConvertError(f"--max-shard-size {text!r}: use a size such as 2GB, 500MB or 5GiB")
    unit = (m.group(2) or "").lower()
    base = 1024 if unit.endswith("i") else 1000
    power = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}[unit[:1]]
    return int(float(m.group(1)) * base**power)


def check_checkpoint(ckpt: Path) -> None:
    """Fail with one line unless ``ckpt`` is a whole ``step_N`` directory."""
    if not ckpt.is_dir():
        raise ConvertError(
            f"--checkpoint {str(ckpt)!r} does not exist; pass a step_N directory of a training run"
        )
    if not (ckpt / "policy").is_dir():
        steps = _complete_steps(ckpt)
        if steps:
            raise ConvertError(
                f"--checkpoint {str(ckpt)!r} holds {len(steps)} checkpoints; pass one of them, "
                f"e.g. {steps[-1]} (the latest)"
            )
        raise ConvertError(
            f"--checkpoint {str(ckpt)!r} is not a checkpoint (no policy/ directory); pass a step_N directory"
        )
    if not is_complete(ckpt):
        others = [p for p in _complete_steps(ckpt.parent) if p != ckpt]
        hint = (
            f"e.g. {others[-1]} (the latest complete)"
            if others
            else "no other step in its directory is complete"
        )
        raise ConvertError(
            f"checkpoint {str(ckpt)!r} is incomplete: no {MARKER} marker (its save was cut off); "
            f"use another step_N, {hint}"
        )
    for sub, what in (
        (WEIGHTS + "/.metadata", "the DCP weights"),
        (HF_CONFIG + "/config.json", "the model config"),
    ):
        if not (ckpt / sub).is_file():
            raise ConvertError(
                f"checkpoint {str(ckpt)!r} is incomplete: {sub} ({what}) is missing; use another step_N"
            )
    if not (ckpt / TOKENIZER).is_dir() or not any((ckpt / TOKENIZER).iterdir()):
        raise ConvertError(
            f"checkpoint {str(ckpt)!r} is incomplete: {TOKENIZER}/ is missing or empty; use another step_N"
        )


def _complete_steps(root: Path) -> list[Path]:
    """The committed ``step_N`` directories under ``root``, by step."""
    steps = [p for p in root.glob("step_*") if p.is_dir() and step_number(p) is not None and is_complete(p)]
    return sorted(steps, key=step_number)


def read_entries(weights: Path) -> list[Entry]:
    """Tensor entries from the DCP metadata, in the order they were saved; checks the data files exist."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = FileSystemReader(str(weights)).read_metadata()
    except Exception as e:  # a truncated or foreign .metadata file
        raise ConvertError(
            f"{weights}/.metadata cannot be read ({type(e).__name__}: {e}); the checkpoint is damaged"
        ) from None
    files = {info.relative_path for info in (metadata.storage_data or {}).values()}
    missing = sorted(f for f in files if not (weights / f).is_file())
    if missing:
        raise ConvertError(
            f"checkpoint weights are incomplete: {weights / missing[0]} is missing ({len(missing)} files)"
        )
    return [
        Entry(name, tuple(md.size), md.properties.dtype)
        for name, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    ]


def meta_model(hf_config: Path):
    """The HF model on the meta device (no memory), or None when it cannot be built here."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(hf_config))
    except Exception as e:
        raise ConvertError(f"{hf_config}/config.json cannot be read by transformers ({e})") from None
    try:
        with torch.device("meta"):
            return config, AutoModelForCausalLM.from_config(config)
    except Exception as e:  # e.g. remote code: fall back to the config's tie flag, skip the checks
        print(
            f"convert: note: cannot build {type(config).__name__} to check tensor names ({e}); converting as is"
        )
        return config, None


def select_entries(entries: list[Entry], config, model) -> tuple[list[Entry], list[str]]:
    """The tensors to write, in the model's order, minus tied duplicates; checks names and shapes.

    Returns (entries, names dropped as tied).
    """
    by_name = {e.name: e for e in entries}
    if model is None:
        tied = (
            {"lm_head.weight"} if getattr(config.get_text_config(), "tie_word_embeddings", False) else set()
        )
        dropped = sorted(tied & set(by_name))
        return [e for e in entries if e.name not in tied], dropped
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items() if name not in tied}
    missing = [n for n in expected if n not in by_name]
    if missing:
        hint = ""
        if "lm_head.weight" in missing:
            hint = " (config.json has tie_word_embeddings=false, so lm_head.weight must be saved)"
        raise ConvertError(
            f"checkpoint lacks {len(missing)} of the model's {len(expected)} tensors, e.g. {missing[0]}{hint}; "
            "it does not match policy/hf_config"
        )
    unexpected = [n for n in by_name if n not in expected and n not in tied]
    if unexpected:
        raise ConvertError(
            f"checkpoint has {len(unexpected)} tensors the model in policy/hf_config does not, e.g. {unexpected[0]}"
        )
    for name, shape in expected.items():
        if by_name[name].shape != shape:
            raise ConvertError(
                f"{name}: checkpoint shape {list(by_name[name].shape)} != model shape {list(shape)}"
            )
    return [by_name[n] for n in expected], sorted(tied & set(by_name))


def plan_shards(entries: list[Entry], max_bytes: int, dtype) -> list[list[Entry]]:
    """Greedy, in order: a shard closes when the next tensor would push it past ``max_bytes``
    (a tensor larger than that gets a shard of its own, as in transformers)."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        n = e.nbytes(dtype or e.dtype)
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += n
    return shards if shards[0] else []


# ----- conversion -----------------------------------------------------------------------------------


def convert(
    checkpoint: str | os.PathLike,
    output: str | os.PathLike,
    *,
    max_shard_size: str | int = "2GB",
    dtype: str | None = None,
    overwrite: bool = False,
    merge: bool = False,
    base: str | None = None,
) -> dict:
    """Write the HF model directory ``output`` from the ``step_N`` directory ``checkpoint``.

    ``dtype`` (bfloat16/float16/float32) casts every tensor; None keeps each tensor's stored dtype.
    Returns a summary: shards, tensors, bytes, seconds. Raises :class:`ConvertError` on bad input.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import FileSystemReader

    t0 = time.monotonic()
    ckpt, out = Path(checkpoint).expanduser(), Path(output).expanduser()
    max_bytes = max_shard_size if isinstance(max_shard_size, int) else parse_size(max_shard_size)
    if dtype is not None and dtype not in _DTYPES:
        raise ConvertError(f"--dtype {dtype!r}: choose one of {', '.join(_DTYPES)}")
    out_dtype = getattr(torch, dtype) if dtype else None
    check_checkpoint(ckpt)
    if out.exists() and not out.is_dir():
        raise ConvertError(f"--output {str(out)!r} is a file; pass a directory path")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConvertError(f"--output {str(out)!r} exists and is not empty; pass --overwrite or another path")
    lora_file = ckpt / "policy" / "lora.json"
    if lora_file.is_file():
        return _convert_lora(ckpt, out, json.loads(lora_file.read_text()), out_dtype, merge, base, t0)
    if merge or base:
        raise ConvertError(
            f"--merge/--base: checkpoint {str(ckpt)!r} is of full weights, not a LoRA run; drop them"
        )

    weights = ckpt / WEIGHTS
    entries = read_entries(weights)
    config, model = meta_model(ckpt / HF_CONFIG)
    entries, dropped = select_entries(entries, config, model)
    shards = plan_shards(entries, max_bytes, out_dtype)
    if not shards:
        raise ConvertError(f"checkpoint {str(ckpt)!r} has no tensors in {WEIGHTS}")
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    total = sum(e.nbytes(out_dtype or e.dtype) for e in entries)
    note = f"; tied {', '.join(dropped)} not written (from_pretrained re-ties it)" if dropped else ""
    print(
        f"convert: {ckpt} -> {out}: {len(entries)} tensors, {_human(total)} in {len(shards)} "
        f"shard(s) of at most {_human(max_bytes)}{note}",
        flush=True,
    )

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a killed conversion
    tmp.mkdir(parents=True)
    try:
        weight_map: dict[str, str] = {}
        for i, (shard, fname) in enumerate(zip(shards, names, strict=True)):
            ts = time.monotonic()
            # Only this shard's tensors: DCP reads their byte ranges from every rank's file and
            # copies (and casts) them into these buffers.
            state = {e.name: torch.empty(e.shape, dtype=out_dtype or e.dtype) for e in shard}
            with warnings.catch_warnings():  # "no process group, loading in one process": intended
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(state, storage_reader=FileSystemReader(str(weights)), no_dist=True)
            if model is not None:
                state = _revert_renamings(model, state)
            save_file(state, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(state, fname))
            size = sum(t.numel() * t.element_size() for t in state.values())
            del state
            print(
                f"convert: shard {i + 1}/{len(shards)} {fname}: {len(shard)} tensors, {_human(size)} "
                f"({time.monotonic() - ts:.1f}s)",
                flush=True,
            )
        if len(shards) > 1:
            index = {
                "metadata": {"total_size": total, "total_parameters": sum(e.numel for e in entries)},
                "weight_map": dict(sorted(weight_map.items())),
            }
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps(index, indent=2, sort_keys=True) + "\n"
            )
        _write_config(ckpt / HF_CONFIG, tmp, dtype or _dominant_dtype(entries))
        _copy_files(ckpt / TOKENIZER, tmp)
        for path in tmp.rglob("*"):  # safetensors writes 0600; a model directory is shared like any other
            path.chmod(0o755 if path.is_dir() else 0o644)
        tmp.chmod(0o755)
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    seconds = time.monotonic() - t0
    print(f"convert: wrote {out} ({len(shards)} shard(s), {_human(total)}) in {seconds:.1f}s", flush=True)
    return {"output": str(out), "shards": names, "tensors": len(entries), "bytes": total, "seconds": seconds}


def _convert_lora(
    ckpt: Path, out: Path, info: dict, out_dtype, merge: bool, base: str | None, t0: float
) -> dict:
    """A LoRA checkpoint -> a PEFT adapter directory, or (``merge``) a merged Hugging Face model."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from trainer.config import LoRAConfig
    from trainer.models import lora as lora_mod

    lora = LoRAConfig(**info["lora"])
    weights = ckpt / WEIGHTS
    entries = read_entries(weights)
    if not entries or not all(lora_mod.is_adapter(e.name) for e in entries):
        raise ConvertError(
            f"checkpoint {str(ckpt)!r}: policy/lora.json says LoRA, but {WEIGHTS} is not adapters alone"
        )
    adapters = {e.name: torch.empty(e.shape, dtype=e.dtype) for e in entries}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(adapters, storage_reader=FileSystemReader(str(weights)), no_dist=True)
    base_path = base or info.get("model_path") or info.get("model_name")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if merge:
            what = _write_merged(tmp, adapters, lora, base_path, ckpt, out_dtype)
        else:
            cast = {n: (t.to(out_dtype) if out_dtype else t) for n, t in adapters.items()}
            lora_mod.save_adapter(str(tmp), cast.items(), lora, base or info.get("model_name") or base_path)
            what = f"PEFT adapter, rank {lora.rank}, {len(adapters)} tensors"
        _copy_files(ckpt / TOKENIZER, tmp)
        for path in tmp.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        tmp.chmod(0o755)
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    seconds = time.monotonic() - t0
    print(f"convert: {ckpt} -> {out}: {what} in {seconds:.1f}s", flush=True)
    return {"output": str(out), "tensors": len(adapters), "seconds": seconds, "merged": merge}


def _write_merged(tmp: Path, adapters: dict, lora, base_path: str | None, ckpt: Path, out_dtype) -> str:
    """The base model with ``adapters`` folded in, saved with ``save_pretrained`` into ``tmp``."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.models import lora as lora_mod
    from trainer.models import resolve_model

    try:
        path = base_path if base_path and Path(base_path).is_dir() else resolve_model(base_path or "")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except Exception as e:
        raise ConvertError(
            f"--merge: the base model {base_path!r} cannot be loaded ({str(e).splitlines()[0]}); pass --base DIR"
        ) from None
    model.config.tie_word_embeddings = getattr(model.config, "tie_word_embeddings", False)
    state = {name: t for name, t in model.state_dict().items()}
    policy_state = {}
    for name, t in state.items():  # policy names: an adapted module's weight sits under base_layer
        module = name.rsplit(".", 1)[0]
        if f"{module}.lora_A.{lora_mod.ADAPTER}.weight" in adapters:
            name = f"{module}.base_layer.{name.rsplit('.', 1)[1]}"
        policy_state[name] = t
    missing = [
        n
        for n in adapters
        if n.replace(f".lora_A.{lora_mod.ADAPTER}.", ".").replace(f".lora_B.{lora_mod.ADAPTER}.", ".")
        not in state
    ]
    if missing:
        raise ConvertError(
            f"--merge: the base model at {path} has no module for adapter {missing[0]}; pass --base DIR"
        )
    merged = lora_mod.merged_state_dict({**policy_state, **adapters}, lora)
    model.load_state_dict(merged, strict=True)
    if out_dtype is not None:
        model = model.to(out_dtype)
    model.save_pretrained(str(tmp))
    return f"merged into {path} (rank {lora.rank})"


def _human(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _revert_renamings(model, state: dict) -> dict:
    """Undo transformers' load-time renamings for this shard (identity for most dense models)."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, state)


def _dominant_dtype(entries: list[Entry]) -> str:
    """The stored dtype that holds the most bytes (float32 for a float32 run with bf16 buffers, say)."""
    by_dtype: dict[str, int] = {}
    for e in entries:
        key = str(e.dtype).removeprefix("torch.")
        by_dtype[key] = by_dtype.get(key, 0) + e.nbytes(e.dtype)
    return max(by_dtype, key=by_dtype.get)


def _write_config(src: Path, dst: Path, dtype: str) -> None:
    """Copy config.json (its dtype set to what was written), generation_config.json and any other
    non-weight files of the base model's config directory."""
    for path in sorted(src.iterdir()):
        if path.is_file() and not _WEIGHT_FILES.fullmatch(path.name):
            shutil.copy2(path, dst / path.name)
    config = json.loads((src / "config.json").read_text())
    config["dtype"] = dtype
    if "torch_dtype" in config:  # configs written by transformers < 5
        config["torch_dtype"] = dtype
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _copy_files(src: Path, dst: Path) -> None:
    for path in sorted(src.iterdir()):
        if path.is_file():
            shutil.copy2(path, dst / path.name)
        elif path.is_dir():
            shutil.copytree(path, dst / path.name)


def _replace(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``; an existing ``out`` (only with --overwrite) is moved aside first."""
    old = None
    if out.exists():
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(out, old)
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ----- command line ---------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage block
        print(
            f"kuberl: error: {message}; usage: {USAGE_HINT} [--max-shard-size 2GB] [--dtype bfloat16]",
            file=sys.stderr,
        )
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m trainer.tools.convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a step_N directory of a training run")
    parser.add_argument("--output", required=True, help="the Hugging Face model directory to write")
    parser.add_argument("--max-shard-size", default="2GB", help="largest safetensors file (default 2GB)")
    parser.add_argument(
        "--dtype", choices=_DTYPES, default=None, help="cast the weights (default: as stored)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --output")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="LoRA checkpoints: write a Hugging Face model with the adapters merged (default: a PEFT adapter directory)",
    )
    parser.add_argument(
        "--base", default=None, help="LoRA checkpoints: the base model (default: the run's model)"
    )
    args = parser.parse_args(argv)
    try:
        convert(
            args.checkpoint,
            args.output,
            max_shard_size=args.max_shard_size,
            dtype=args.dtype,
            overwrite=args.overwrite,
            merge=args.merge,
            base=args.base,
        )
    except ConvertError as e:
        print(f"kuberl: error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("kuberl: error: interrupted; the output was not written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
