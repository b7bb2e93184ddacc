"""Checkpoints that survive preemption on any shared filesystem: written in place, committed by a
marker written last, found again by ``resume=auto``.

Layout of ``checkpoint_dir/<experiment>/step_N/``::

    policy/weights/        torch DCP, written by every FSDP rank in parallel
    policy/optimizer/      torch DCP (AdamW state and LR scheduler)
    policy/tokenizer/      tokenizer files
    policy/hf_config/      config.json and generation_config.json of the base model
    config.yaml            the run's resolved config
    dataloader.json        the prompt loader's position after step N
    training_info.json     step, consumed samples, run name, tracker run ids, metrics, RNG state, save time
    COMMITTED              the marker, written last: every file above with its size

A checkpoint is complete exactly when ``COMMITTED`` exists. The usual way to commit a directory,
writing it under a temporary name and renaming it, does not work on Cloud Storage FUSE with a flat
bucket (no hierarchical namespace), which cannot rename a non-empty directory; a marker is one small
file, which every bucket kind and every POSIX filesystem can create atomically (written to a
temporary name beside it, then renamed: a file rename, not a directory one). So a kill at any moment
leaves either the complete checkpoints that were there, or those plus the new one; a step directory
without the marker is a save that was cut off. It is never resumed from, listed or converted, and
the next run removes it with a log line. Removing a checkpoint (``keep_top_k`` pruning, replacing a
step) deletes its marker first, so a removal cut off halfway never leaves a half checkpoint that
looks whole. The marker also lists the files and their sizes, so a checkpoint damaged later (a shard
deleted by hand) is reported in one line instead of failing deep inside DCP.

Checkpoints of the earlier protocol (a ``.tmp-step_N-*`` directory renamed to ``step_N`` once whole)
have no marker but were committed by that rename: a ``step_N`` with ``training_info.json`` and no
``checkpoint_format`` in it is such a checkpoint, and counts as complete. Leftover ``.tmp-step_*``
directories of that protocol are removed at start.

Nothing is ever resumed silently: the trainer says in one line which checkpoint it resumed or that
it starts fresh. A resume under another config than the checkpoint's (a learning rate changed by a
``helm upgrade`` between two attempts of a RayJob) or another image refuses in one line naming what
changed (:func:`config_changes`), unless ``checkpointing.allow_changed_config=true``; the keys that
change where and how fast a run trains, not what it learns, may change freely (:data:`MAY_CHANGE`).

One run writes a directory at a time: :mod:`trainer.lease` holds it, and the Checkpointer calls its
``guard`` before every removal and every commit, so a run that lost its lease writes nothing more.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the converter imports this module and needs nothing of the trainer's config
    from trainer.config import CheckpointConfig

_STEP = re.compile(r"^step_(\d+)$")
INFO = "training_info.json"
MARKER = "COMMITTED"
FORMAT = 2  # training_info.json["checkpoint_format"]: 2 = committed by MARKER; absent = renamed directory


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message says why and what to do."""


# ----- one step directory ---------------------------------------------------------------------------


def step_number(path: Path) -> int | None:
    m = _STEP.match(path.name)
    return int(m.group(1)) if m else None


def read_info(path: Path) -> dict[str, Any]:
    return json.loads((path / INFO).read_text())


def _is_legacy(path: Path) -> bool:
    """Committed by the earlier rename protocol: training_info.json without a format number."""
    try:
        return "checkpoint_format" not in read_info(path)
    except (OSError, ValueError):
        return False


def is_complete(path: Path) -> bool:
    """Committed: the marker is there (or it is a checkpoint of the earlier protocol)."""
    return (path / MARKER).is_file() or ((path / INFO).is_file() and _is_legacy(path))


def problem(path: Path) -> str | None:
    """Why ``path`` cannot be resumed from or converted, or None when it is a whole checkpoint.

    Checks the marker and every file it lists (existence and size): a stat per file, no reads.
    """
    if not path.is_dir():
        return f"{path} does not exist"
    if not (path / MARKER).is_file():
        if (path / INFO).is_file() and _is_legacy(path):
            for sub in ("policy/weights/.metadata", "policy/optimizer/.metadata"):
                if not (path / sub).is_file():
                    return f"{path} is damaged: {sub} is missing"
            return None
        return f"{path} is incomplete: no {MARKER} marker (its save was cut off)"
    try:
        files = json.loads((path / MARKER).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{path}/{MARKER} cannot be read; the checkpoint is damaged"
    for rel, size in files.items():
        f = path / rel
        if not f.is_file():
            return f"{path} is damaged: {rel} is missing ({len(files)} files listed in {MARKER})"
        if f.stat().st_size != size:
            return f"{path} is damaged: {rel} has {f.stat().st_size} bytes, {MARKER} says {size}"
    return None


def write_atomic(path: Path, text: str) -> None:
    """Create or replace the small file ``path`` so that readers see the old content or the new, never
    part of it: write a temporary file beside it, flush it to storage, rename it (a file rename,
    which flat GCS buckets support)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_marker(path: Path, step: int) -> None:
    """Commit ``path``: list what is in it and write the marker, last. Nothing may be written after."""
    files = {
        str(f.relative_to(path)): f.stat().st_size
        for f in sorted(path.rglob("*"))
        if f.is_file() and f.name != MARKER and not f.name.endswith(".tmp")
    }
    write_atomic(
        path / MARKER, json.dumps({"step": step, "committed_at": time.time(), "files": files}, indent=1)
    )


def remove(path: Path) -> None:
    """Delete a checkpoint, marker first: a removal cut off halfway leaves an incomplete step, which is
    ignored and cleaned, never a half checkpoint that looks whole."""
    for name in (MARKER, INFO):  # INFO too: without a marker, a legacy INFO would still mean complete
        try:
            (path / name).unlink()
        except FileNotFoundError:
            pass
    shutil.rmtree(path, ignore_errors=True)


# ----- the checkpoints of one experiment ------------------------------------------------------------


class Checkpointer:
    def __init__(self, cfg: CheckpointConfig, experiment: str, guard: Callable[[], None] | None = None):
        self.cfg = cfg
        self.root = Path(cfg.checkpoint_dir) / experiment
        # Called before every removal and every commit; raises when this run may no longer write here.
        self.guard = guard or (lambda: None)

    # ----- finding ---------------------------------------------------------------------------------
    def step_dirs(self) -> list[tuple[int, Path]]:
        """Every ``step_N`` directory, complete or not, by step."""
        if not self.root.is_dir():
            return []
        found = [(step_number(p), p) for p in self.root.iterdir() if p.is_dir()]
        return sorted((n, p) for n, p in found if n is not None)

    def complete_steps(self) -> list[tuple[int, Path]]:
        return [(n, p) for n, p in self.step_dirs() if is_complete(p)]

    def clean_stale(self) -> list[str]:
        """Remove what cut-off saves left: ``step_N`` without a marker, and the earlier protocol's
        temporary directories. Returns one line per removal (the caller prints them)."""
        lines = []
        self.guard()
        for _, path in self.step_dirs():
            if not is_complete(path):
                remove(path)
                lines.append(
                    f"kuberl: removed {path}: incomplete (no {MARKER} marker), a save that was cut off"
                )
        if self.root.is_dir():
            for path in self.root.glob(".tmp-step_*"):
                shutil.rmtree(path, ignore_errors=True)
                lines.append(f"kuberl: removed {path}: a temporary directory of a cut-off save")
        return lines

    def resume_path(self) -> tuple[Path | None, list[str]]:
        """The checkpoint to resume from under ``checkpointing.resume`` (auto | never | PATH), and a
        line for each damaged checkpoint that ``auto`` passed over."""
        mode = self.cfg.resume
        if mode == "never":
            return None, []
        if mode != "auto":
            why = problem(Path(mode))
            if why:
                raise CheckpointError(
                    f"checkpointing.resume={mode}: {why}; use auto, never, or another step_N"
                )
            return Path(mode), []
        skipped = []
        for _, path in reversed(self.complete_steps()):
            why = problem(path)
            if why is None:
                return path, skipped
            skipped.append(f"kuberl: warning: not resuming from {why}; trying the step before it")
        return None, skipped

    # ----- writing ---------------------------------------------------------------------------------
    def begin(self, step: int) -> tuple[Path, str | None]:
        """The directory the ranks write step ``step`` into, and a line if an older one was replaced."""
        self.guard()
        path = self.root / f"step_{step}"
        replaced = None
        if path.exists():  # a re-run of the same step (resume=never, or a re-save after a cut-off one)
            if is_complete(path):
                replaced = f"kuberl: replacing checkpoint {path} of an earlier run"
            remove(path)
        (path / "policy").mkdir(parents=True)
        return path, replaced

    def commit(self, path: Path, step: int, info: dict[str, Any], loader_state: dict, config: dict) -> None:
        """Write the driver's files, then the marker (last), then prune."""
        import yaml

        (path / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        (path / "dataloader.json").write_text(json.dumps(loader_state))
        (path / INFO).write_text(
            json.dumps({**info, "checkpoint_format": FORMAT, "provenance": provenance(config)}, indent=1)
        )
        self.guard()
        write_marker(path, step)
        self._prune()

    def _prune(self) -> None:
        keep = self.cfg.keep_top_k
        steps = self.complete_steps()
        if keep is None or len(steps) <= keep:
            return
        latest = steps[-1]
        name = self.cfg.metric_name

        def score(item: tuple[int, Path]) -> float:
            value = read_info(item[1]).get("metrics", {}).get(name) if name else None
            if value is None:
                return float("-inf") if name else float(item[0])
            return value if self.cfg.higher_is_better else -value

        self.guard()
        ranked = sorted(steps, key=score, reverse=True)
        # The latest checkpoint always stays: it is the one preemption resumes from.
        kept = set(p for _, p in ranked[:keep]) | {latest[1]}
        for _, path in steps:
            if path not in kept:
                remove(path)


def rng_info(seed: int, step: int) -> dict[str, Any]:
    """Every random draw of a step is seeded from (seed, step): sampling uses seed + step, and the
    prompt order per epoch uses seed + epoch. Restoring the step restores the streams exactly."""
    return {"seed": seed, "next_sampling_seed": seed + step + 1, "saved_at": time.time()}


# ----- what a checkpoint was trained under ------------------------------------------------------------

# Keys that change where and how fast a run trains, not what it learns: a resume may change them freely
# (more steps, another cluster shape, other micro-batches, other trackers). A key here that names a
# section covers every key under it. tests/test_checkpoint_lineage.py checks each names a real key.
MAY_CHANGE = (
    "experiment_name",
    "checkpointing",
    "logger",
    "cluster",
    "grpo.max_num_steps",
    "grpo.val_period",
    "grpo.val_at_start",
    "policy.micro_batch_size",
    "policy.logprob_micro_batch_size",
    "policy.max_tokens_per_microbatch",
    "policy.logprob_max_tokens_per_microbatch",
    "policy.activation_checkpointing",
    "policy.reshard_after_forward",
    "policy.sequence_parallel_size",
    "generation.batch_size",
    "generation.gpu_memory_utilization",
    "generation.enforce_eager",
    "generation.refit_bucket_mb",
    "generation.engine_start_timeout_s",
    "generation.refit_timeout_s",
    "generation.weight_group_timeout_s",
    "generation.resources",
    "generation.endpoint",
)


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: list(tree) if isinstance(tree, tuple) else tree}


def _may_change(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in MAY_CHANGE)


def config_hash(config: dict[str, Any]) -> str:
    """A short hash of what a run learns under: every key of the resolved config but :data:`MAY_CHANGE`."""
    import hashlib

    kept = {k: v for k, v in sorted(_flat(config).items()) if not _may_change(k)}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


def code_version() -> str:
    try:
        from importlib.metadata import version

        return f"kuberl {version('kuberl')}"
    except Exception:  # not installed as a package (a source tree on PYTHONPATH)
        return "kuberl (source tree)"


def provenance(config: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint was trained under, beyond its config.yaml: the config's hash, the job image (the
    chart's pods carry it in $KUBERL_IMAGE) and the code's version."""
    return {
        "config_hash": config_hash(config),
        "image": os.environ.get("KUBERL_IMAGE") or None,
        "code_version": code_version(),
    }


def _show(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


def config_changes(checkpoint: Path, config: dict[str, Any]) -> list[str]:
    """What differs between the config and image ``checkpoint`` was saved under and this run's, one
    ``key: old -> new`` each; keys of :data:`MAY_CHANGE` and keys only one side has (a key added or
    removed by a newer kuberl, whose default keeps the old behaviour) are not compared."""
    import yaml

    try:
        saved = yaml.safe_load((checkpoint / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return []  # a checkpoint without its config (the earliest protocol): nothing to compare with
    before, now = _flat(saved or {}), _flat(config)
    changes = [
        f"{k}: {_show(before[k])} -> {_show(now[k])}"
        for k in sorted(before.keys() & now.keys())
        if not _may_change(k) and before[k] != now[k]
    ]
    try:
        image_then = read_info(checkpoint).get("provenance", {}).get("image")
    except (OSError, ValueError):
        image_then = None
    image_now = os.environ.get("KUBERL_IMAGE") or None
    if image_then and image_now and image_then != image_now:
        changes.append(f"image: {image_then} -> {image_now}")
    return changes


def refuse_changes(checkpoint: Path, changes: list[str]) -> CheckpointError:
    shown = "; ".join(changes[:4]) + (f" (and {len(changes) - 4} more)" if len(changes) > 4 else "")
    return CheckpointError(
        f"checkpointing: {checkpoint} was saved under another config: {shown}. A resumed run must train "
        "under what its checkpoint was trained with: restore those values, start a new lineage "
        "(checkpointing.resume=never or another checkpointing.checkpoint_dir), or set "
        "checkpointing.allow_changed_config=true to resume with the changes"
    )
