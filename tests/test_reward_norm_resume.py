"""Running reward normalisation is run state: a checkpoint carries each entry's window and a resumed run
continues it, so step 3 of a run resumed from step 2 is normalised by the scores of steps 1 to 3, as an
uninterrupted run's is (a resume that lost the windows would normalise step 3 by its own scores alone)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .tiny_run import run_in_process

pytestmark = pytest.mark.slow

ENTRY = "tests.rewards.length_reward:length"


def _overrides(tmp: Path, steps: int) -> list[str]:
    return [
        "experiment=tiny",
        f"grpo.max_num_steps={steps}",
        "checkpointing.save_period=2",
        "cluster.cpu_workers_per_node=1",
        f"env.reward_functions=[{{name: '{ENTRY}', normalize: running, window: 3}}]",
        f"logger.log_dir={tmp / 'logs'}",
        f"checkpointing.checkpoint_dir={tmp / 'ckpt'}",
    ]


def _raw_scores(tmp: Path, step: int) -> list[float]:
    (run_dir,) = list((tmp / "logs" / "tiny").iterdir())  # a resumed run appends to its own run
    rows = (run_dir / f"train_data_step{step}.jsonl").read_text().splitlines()
    return [json.loads(row)["rewards"][ENTRY] for row in rows]


def _norm_mean(tmp: Path, step: int) -> float:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run_dir,) = list((tmp / "logs" / "tiny").iterdir())
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    (event,) = [e for e in acc.Scalars(f"train/reward/{ENTRY}/norm_mean") if e.step == step]
    return event.value


def test_should_continue_the_running_reward_windows_when_a_run_resumes(trainer_env, tmp_path):
    first = run_in_process(_overrides(tmp_path, 2), trainer_env)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    info = json.loads((tmp_path / "ckpt" / "tiny" / "step_2" / "training_info.json").read_text())
    window = info["rewards"]["normalize"]["windows"][ENTRY]
    assert window["window"] == 3 and [n for n, _, _ in window["steps"]] == [256, 256]  # steps 1 and 2

    resumed = run_in_process(_overrides(tmp_path, 3), trainer_env)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout and "no running reward statistics" not in resumed.stdout
    scores = [s for step in (1, 2, 3) for s in _raw_scores(tmp_path, step)]
    step_3 = _raw_scores(tmp_path, 3)
    assert _norm_mean(tmp_path, 3) == pytest.approx(sum(scores) / len(scores), rel=1e-5)
    assert sum(scores) / len(scores) != pytest.approx(sum(step_3) / len(step_3), rel=1e-3)  # not vacuous
