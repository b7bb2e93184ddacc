"""The checkpoint commit protocol on a filesystem that refuses directory renames, as Cloud Storage
FUSE does on a flat bucket; the prompt stream's position; the preemption decision.

Checkpoints here are written by the real :class:`Checkpointer` with real DCP shards (``dcp.save`` in
one process, as each rank writes its own); a crash is an exception raised at the chosen moment,
which leaves the files exactly as a kill would. The end-to-end versions, with the trainer and a Ray
cluster killed for real, are in ``test_checkpoint_resume.py``.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import warnings
from pathlib import Path

import pytest
import torch

from trainer import checkpoint
from trainer.checkpoint import MARKER, Checkpointer, CheckpointError
from trainer.config import CheckpointConfig
from trainer.data.loader import PromptLoader

from .faults import refuse_dir_renames


class Crash(BaseException):
    """Stands for SIGKILL: nothing after the moment it is raised runs."""


@pytest.fixture
def flat_bucket(monkeypatch):
    refuse_dir_renames(patch=monkeypatch.setattr)


def _ckpt(tmp_path: Path, **kw) -> Checkpointer:
    return Checkpointer(CheckpointConfig(checkpoint_dir=str(tmp_path), **kw), "exp")


def _save(
    ck: Checkpointer, step: int, metrics: dict | None = None, crash_before_marker: bool = False
) -> Path:
    """What TrainState.save does: the ranks' DCP shards into step_N, then the driver's commit."""
    import torch.distributed.checkpoint as dcp

    path, _ = ck.begin(step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "no process group": intended
        for part in ("weights", "optimizer"):
            state = {"w": torch.full((4, 3), float(step)), "b": torch.arange(5.0) * step}
            dcp.save(state, checkpoint_id=str(path / "policy" / part), no_dist=True)
    (path / "policy" / "tokenizer").mkdir()
    (path / "policy" / "tokenizer" / "tokenizer.json").write_text("{}")
    info = {"step": step, "metrics": metrics or {}, "run_name": "r"}
    if crash_before_marker:

        def crash(*a):
            raise Crash

        real, checkpoint.write_marker = checkpoint.write_marker, crash
        try:
            with pytest.raises(Crash):
                ck.commit(path, step, info, {"epoch": 0, "position": step}, {"seed": 1})
        finally:
            checkpoint.write_marker = real
    else:
        ck.commit(path, step, info, {"epoch": 0, "position": step}, {"seed": 1})
    return path


def _names(ck: Checkpointer) -> list[str]:
    return sorted(p.name for p in ck.root.iterdir())


# ----- the commit protocol --------------------------------------------------------------------------


def test_the_test_filesystem_refuses_directory_renames_but_not_file_renames(flat_bucket, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f").write_text("x")
    for move in (os.rename, os.replace, shutil.move, Path.rename):
        with pytest.raises(OSError) as e:
            move(tmp_path / "a", tmp_path / "b")
        assert e.value.errno in (errno.EXDEV, errno.EPERM)
    os.replace(tmp_path / "a" / "f", tmp_path / "a" / "g")  # files still move
    assert (tmp_path / "a" / "g").read_text() == "x"


def test_should_commit_with_a_marker_written_last_when_directories_cannot_be_renamed(flat_bucket, tmp_path):
    ck = _ckpt(tmp_path)
    path = _save(ck, 2)
    assert path == ck.root / "step_2" and _names(ck) == ["step_2"]
    marker = json.loads((path / MARKER).read_text())
    assert marker["step"] == 2
    # Everything the step holds is listed with its size, and nothing else was left beside it.
    on_disk = {
        str(f.relative_to(path)): f.stat().st_size
        for f in path.rglob("*")
        if f.is_file() and f.name != MARKER
    }
    assert marker["files"] == on_disk
    assert {
        "policy/weights/.metadata",
        "policy/optimizer/.metadata",
        "training_info.json",
        "dataloader.json",
        "config.yaml",
    } <= set(on_disk)
    assert not [f for f in path.rglob("*") if f.name.endswith(".tmp")]
    assert json.loads((path / "training_info.json").read_text())["checkpoint_format"] == checkpoint.FORMAT
    assert ck.resume_path() == (path, [])
    assert checkpoint.problem(path) is None


def test_should_resume_the_previous_step_when_killed_between_the_shards_and_the_marker(flat_bucket, tmp_path):
    ck = _ckpt(tmp_path)
    step_2 = _save(ck, 2)
    step_4 = _save(ck, 4, crash_before_marker=True)
    # Every shard and driver file of step 4 is there; only the marker is not.
    assert (step_4 / "policy" / "weights" / ".metadata").is_file() and (
        step_4 / "training_info.json"
    ).is_file()
    assert not checkpoint.is_complete(step_4)
    assert [n for n, _ in ck.complete_steps()] == [2]
    assert ck.resume_path() == (step_2, [])
    assert "no COMMITTED marker" in checkpoint.problem(step_4)
    lines = ck.clean_stale()
    assert lines == [f"kuberl: removed {step_4}: incomplete (no {MARKER} marker), a save that was cut off"]
    assert _names(ck) == ["step_2"] and checkpoint.problem(step_2) is None


def test_should_refuse_an_incomplete_step_named_by_path_in_one_line(flat_bucket, tmp_path):
    step_4 = _save(_ckpt(tmp_path), 4, crash_before_marker=True)
    with pytest.raises(CheckpointError) as e:
        _ckpt(tmp_path, resume=str(step_4)).resume_path()
    assert str(e.value) == (
        f"checkpointing.resume={step_4}: {step_4} is incomplete: no COMMITTED marker (its save was cut off); "
        "use auto, never, or another step_N"
    )


def test_should_prune_to_keep_top_k_without_renaming_and_keep_the_latest(flat_bucket, tmp_path):
    ck = _ckpt(tmp_path, keep_top_k=2, metric_name="val/accuracy")
    for step, acc in ((1, 0.9), (2, 0.1), (3, 0.5), (4, 0.2)):
        _save(ck, step, {"val/accuracy": acc})
    # Best two by accuracy are 1 and 3; 4 stays too, as the latest (what preemption resumes from).
    assert _names(ck) == ["step_1", "step_3", "step_4"]


def test_should_leave_an_incomplete_step_when_a_removal_is_cut_off(flat_bucket, tmp_path, monkeypatch):
    ck = _ckpt(tmp_path, keep_top_k=1)
    _save(ck, 1)

    def cut_off(path, ignore_errors=False):
        raise Crash

    monkeypatch.setattr(checkpoint.shutil, "rmtree", cut_off)
    with pytest.raises(Crash):
        _save(ck, 2)  # committed, then pruning step_1 is cut off after its marker went
    monkeypatch.undo()
    assert not checkpoint.is_complete(tmp_path / "exp" / "step_1")
    assert [n for n, _ in ck.complete_steps()] == [2]
    assert "step_1" in ck.clean_stale()[0]


def test_should_replace_a_complete_step_of_an_earlier_run_and_say_so(flat_bucket, tmp_path):
    ck = _ckpt(tmp_path)
    _save(ck, 2)
    path, line = ck.begin(2)
    assert line == f"kuberl: replacing checkpoint {path} of an earlier run"
    assert list(path.iterdir()) == [path / "policy"] and not list((path / "policy").iterdir())


def test_should_pass_over_a_damaged_checkpoint_with_a_line_and_resume_the_one_before(flat_bucket, tmp_path):
    ck = _ckpt(tmp_path)
    step_2, step_4 = _save(ck, 2), _save(ck, 4)
    shard = next((step_4 / "policy" / "weights").glob("*.distcp"))
    shard.unlink()  # deleted by hand, long after the commit
    path, lines = ck.resume_path()
    assert path == step_2
    rel = shard.relative_to(step_4)
    assert lines == [
        f"kuberl: warning: not resuming from {step_4} is damaged: {rel} is missing "
        f"({len(json.loads((step_4 / MARKER).read_text())['files'])} files listed in COMMITTED); "
        "trying the step before it"
    ]
    assert ck.clean_stale() == []  # damaged but committed: kept for a person to look at, never deleted


def test_should_resume_a_checkpoint_of_the_earlier_rename_protocol(tmp_path):
    """Old layout: committed by renaming .tmp-step_N-* to step_N; training_info.json has no format."""
    ck = _ckpt(tmp_path)
    old = _save(ck, 3)
    (old / MARKER).unlink()
    info = json.loads((old / "training_info.json").read_text())
    del info["checkpoint_format"]
    (old / "training_info.json").write_text(json.dumps(info))
    (ck.root / ".tmp-step_4-0123abcd" / "policy").mkdir(parents=True)  # its cut-off save
    assert checkpoint.is_complete(old) and checkpoint.problem(old) is None
    lines = ck.clean_stale()
    assert len(lines) == 1 and ".tmp-step_4-0123abcd" in lines[0]
    assert ck.resume_path() == (old, []) and _names(ck) == ["step_3"]


# ----- the prompt stream ----------------------------------------------------------------------------


def _examples(n: int) -> list[dict]:
    return [{"id": i, "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(n)]


def test_should_continue_the_prompt_stream_exactly_across_epochs_when_restored():
    ids = lambda batch: [ex["id"] for ex in batch]  # noqa: E731
    whole = PromptLoader(_examples(10), 4, seed=7)
    expected = [ids(whole.next_batch()) for _ in range(7)]  # 28 prompts: two epoch boundaries
    first = PromptLoader(_examples(10), 4, seed=7)
    seen = [ids(first.next_batch()) for _ in range(3)]  # stops inside epoch 1 (position 2)
    state = json.loads(json.dumps(first.state_dict()))  # as dataloader.json stores it
    second = PromptLoader(_examples(10), 4, seed=7)
    assert second.load_state_dict(state) is None
    seen += [ids(second.next_batch()) for _ in range(4)]
    assert seen == expected
    assert sorted(sum(expected[:5], [])[:10]) == list(range(10))  # an epoch is each prompt once


def test_should_warn_in_one_line_when_the_prompts_differ_from_the_checkpoints():
    state = PromptLoader(_examples(10), 4, seed=7).state_dict()
    warning = PromptLoader(_examples(12), 4, seed=7).load_state_dict(state)
    assert warning.startswith("kuberl: warning: the prompts differ from the checkpoint's (12 now, 10 then")
    assert "\n" not in warning
    assert PromptLoader(_examples(10), 4, seed=8).load_state_dict(state) is not None  # another order
    assert (
        PromptLoader(_examples(10), 4, seed=7).load_state_dict({"epoch": 0, "position": 3}) is None
    )  # older file


# ----- preemption -----------------------------------------------------------------------------------


def test_preemption_handler_belongs_to_the_run_and_is_removed_at_close():
    from trainer.preemption import Preemption

    before = signal.getsignal(signal.SIGTERM)
    p = Preemption(grace_s=25)
    p.install()
    try:
        assert not p.requested and p.left_s() == 25
        os.kill(os.getpid(), signal.SIGTERM)  # handled in this thread at the next bytecode
        assert p.requested and p.left_s() <= 25
    finally:
        p.uninstall()
    assert signal.getsignal(signal.SIGTERM) is before


class _Saves:
    def __init__(self, fail: bool = False):
        self.calls, self.fail = 0, fail

    def __call__(self):
        self.calls += 1
        if self.fail:
            raise RuntimeError("actor died\nunexpectedly")


def _state(tmp_path, *, step: int, saved_step: int | None, save_s: float | None, left: float, fail=False):
    """A TrainState at a safe point after SIGTERM, without workers: only what the decision reads."""
    from trainer.config import Config
    from trainer.preemption import Preemption
    from trainer.run import Progress, TrainState

    state = TrainState.__new__(TrainState)
    state.cfg = Config()
    state.preemption = Preemption(grace_s=state.cfg.checkpointing.preemption_grace_s)
    state.preemption.left_s = lambda: left
    state.preemption.received_at = 0.0
    saved = tmp_path / f"step_{saved_step}" if saved_step is not None else None
    state.progress = Progress(step=step, loader_state={}, saved=saved, saved_step=saved_step, save_s=save_s)
    state.save = _Saves(fail)
    return state


@pytest.mark.parametrize(
    "case, saves, line",
    [
        (
            "fits",
            1,
            "kuberl: SIGTERM: saving step 5 (20.0s of checkpointing.preemption_grace_s=25 left; "
            "the last save took 3.0s)",
        ),
        (
            "too_slow",
            0,
            "kuberl: SIGTERM: not saving step 5: a save takes about 30.0s and 20.0s of "
            "checkpointing.preemption_grace_s=25 are left; the next run resumes from {ck}/step_4, "
            "redoing steps 5-5",
        ),
        (
            "untimed",
            1,
            "kuberl: SIGTERM: saving step 5 (20.0s of checkpointing.preemption_grace_s=25 left; "
            "no save timed yet in this run, it may not fit)",
        ),
        ("saved", 0, "kuberl: SIGTERM: step 5 is saved; exiting, the next run resumes from {ck}/step_5"),
        (
            "fails",
            1,
            "kuberl: SIGTERM: saving step 5 failed (RuntimeError: actor died); the next run resumes "
            "from {ck}/step_4, redoing steps 5-5",
        ),
        (
            "nothing",
            0,
            "kuberl: SIGTERM: not saving step 5: a save takes about 30.0s and 20.0s of "
            "checkpointing.preemption_grace_s=25 are left; the next run starts from scratch "
            "(no complete checkpoint)",
        ),
    ],
)
def test_should_save_at_preemption_only_when_the_save_fits_in_the_grace_budget(
    case, saves, line, tmp_path, capsys
):
    from trainer.preemption import Preempted

    saved_step = {"saved": 5, "nothing": None}.get(case, 4)
    save_s = {"fits": 3.0, "fails": 3.0, "untimed": None}.get(case, 30.0)
    state = _state(tmp_path, step=5, saved_step=saved_step, save_s=save_s, left=20.0, fail=case == "fails")
    with pytest.raises(Preempted) as e:
        state.preemption_point()
    assert state.save.calls == saves
    assert capsys.readouterr().out.splitlines()[-1] == line.format(ck=tmp_path)  # "fails": after "saving"
    assert e.value.step == 5 and e.value.saved_step == saved_step


def test_should_not_stop_at_a_safe_point_without_sigterm(tmp_path):
    state = _state(tmp_path, step=5, saved_step=4, save_s=1.0, left=25.0)
    state.preemption.received_at = None
    state.preemption_point()
    assert state.save.calls == 0
