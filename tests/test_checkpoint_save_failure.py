"""A checkpoint that cannot be written (a full volume, a failing mount) ends the run in one line that names the
cause out of Ray's wrapper, the free space, the fix and where a resubmission resumes from, with the retry exit
status; the previous complete checkpoint stays the one a resume reads (:func:`trainer.run.save_failed`)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from trainer.__main__ import RETRY_EXIT, exit_code
from trainer.checkpoint import Checkpointer
from trainer.config import load
from trainer.run import CheckpointSaveError, Progress, TrainState, save_failed

RESUMES = "the next run resumes from /ckpt/demo/step_20, redoing steps 21-30"
# what torch's zip writer raised on a rank when the volume filled mid-save (a make train on this machine)
SHORT_WRITE = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"


def test_should_say_the_volume_is_full_when_the_rank_ran_out_of_space() -> None:
    err = OSError(errno.ENOSPC, "No space left on device")
    line = str(save_failed(err, Path("/ckpt/demo/step_30"), RESUMES, free_bytes=3 * 2**20))
    assert line == (
        "saving checkpoint /ckpt/demo/step_30 failed (OSError: [Errno 28] No space left on device); 3.0 MiB free "
        "on its volume: the volume is full: free space there or set checkpointing.checkpoint_dir to a larger "
        f"one; {RESUMES}"
    )


def test_should_put_an_obscure_short_write_down_to_the_space_left() -> None:
    err = RuntimeError(SHORT_WRITE)
    full = str(save_failed(err, Path("/ckpt/x/step_3"), RESUMES, free_bytes=2**20))
    assert SHORT_WRITE in full and "the volume is full" in full and "\n" not in full
    roomy = str(save_failed(err, Path("/ckpt/x/step_3"), RESUMES, free_bytes=50 * 2**30))
    assert "the volume is full" not in roomy and "check that volume (permissions, mount)" in roomy
    assert "51200.0 MiB free" in roomy and roomy.endswith(RESUMES)


def test_should_retry_a_failed_save_rather_than_remember_it_as_permanent() -> None:
    assert exit_code(CheckpointSaveError("saving checkpoint x failed")) == RETRY_EXIT


def test_should_end_the_run_in_one_line_when_a_rank_cannot_write_its_shards(ray_local, tmp_path) -> None:
    """TrainState.save with real Ray ranks whose save raises what a full volume gave this machine: the run's
    error is the rank's own last line (not Ray's traceback), the step's directory is never committed, and
    the checkpoint before it stays the latest complete one."""
    ray = ray_local

    @ray.remote(num_cpus=0)
    class Rank:
        def save_checkpoint(self, path: str) -> None:
            Path(path, "policy").mkdir(parents=True, exist_ok=True)
            raise RuntimeError(SHORT_WRITE)

    class Policy:
        def __init__(self) -> None:
            self.workers = [Rank.remote(), Rank.remote()]

        def run(self, method, *args):
            return ray.get([getattr(w, method).remote(*args) for w in self.workers])

    cfg = load(["experiment=tiny", f"checkpointing.checkpoint_dir={tmp_path}"])
    state = object.__new__(TrainState)
    state.cfg, state.policy = cfg, Policy()
    state.checkpointer = Checkpointer(cfg.checkpointing, cfg.experiment_name)
    earlier = tmp_path / cfg.experiment_name / "step_2"
    state.progress = Progress(step=3, loader_state={}, saved=earlier, saved_step=2)
    try:
        with pytest.raises(CheckpointSaveError) as caught:
            state.save()
    finally:
        for w in state.policy.workers:
            ray.kill(w)
    line = str(caught.value)
    assert line.startswith(
        f"saving checkpoint {tmp_path / cfg.experiment_name / 'step_3'} failed (RuntimeError: "
    )
    assert SHORT_WRITE in line and "Traceback" not in line and "\n" not in line
    assert line.endswith(f"the next run resumes from {earlier}, redoing steps 3-3")
    assert all(step != 3 for step, _ in state.checkpointer.complete_steps())
