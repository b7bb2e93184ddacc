"""A tiny run through the real entry point with all three trackers: each holds the same reward curve, the
perf/ metrics of every step, the config and the rollout tables; the checkpoint keeps the tracker run ids,
and a run resumed from it continues the same W&B and MLflow runs."""

from __future__ import annotations

import json
import math

import pytest

from tests.tiny_run import train_tiny
from tests.tracking import readback

pytestmark = pytest.mark.slow

STEPS = 3
PERF = (
    "perf/generated_tokens_per_s",
    "perf/trained_tokens_per_s",
    "perf/mfu",
    "perf/peak_memory_gib_max",
    "perf/peak_memory_gib/rank_0",
)


def test_should_send_the_same_curve_config_and_rollouts_to_every_backend_when_a_tiny_run_trains(
    trainer_env, tmp_path
):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    stdout, run_dir = train_tiny(
        trainer_env,
        tmp_path,
        f"grpo.max_num_steps={STEPS}",
        f"checkpointing.save_period={STEPS}",
        "logger.backends=[tensorboard,wandb,mlflow]",
        "logger.wandb.mode=offline",
        f"logger.mlflow.tracking_uri={uri}",
        "logger.num_table_rows=4",
    )
    steps = list(range(1, STEPS + 1))
    tb = readback.tensorboard(run_dir)
    assert sorted(tb["train/reward_mean"]) == steps

    info = json.loads((tmp_path / "ckpt" / "tiny" / f"step_{STEPS}" / "training_info.json").read_text())
    ids = info["tracker_runs"]
    assert set(ids) == {"wandb", "mlflow"}

    wb = readback.wandb_run(run_dir)
    ml = readback.mlflow_run(uri, ids["mlflow"])
    assert wb["ids"] == {ids["wandb"]}
    for name, history in (("wandb", wb["history"]), ("mlflow", ml["history"])):
        # TensorBoard stores float32: the same curve to its precision
        assert history["train/reward_mean"] == pytest.approx(tb["train/reward_mean"], rel=1e-6), name
        for key in PERF:
            assert sorted(history[key]) == steps, (name, key)
    for key in PERF:
        assert sorted(tb[key]) == steps, key
    # 0 for a step that trained on nothing (every advantage zero); against a CPU peak measured once, at
    # start, a loaded machine can move either figure: the check is that MFU is a number every step
    mfus = list(tb["perf/mfu"].values())
    assert all(math.isfinite(v) and v >= 0 for v in mfus) and any(v > 0 for v in mfus), mfus
    assert all(v > 0 for v in tb["perf/peak_memory_gib_max"].values())

    assert wb["config"]["experiment_name"] == "tiny" and ml["params"]["experiment_name"] == "tiny"
    assert wb["config"]["grpo.max_num_steps"] == STEPS and ml["params"]["grpo.max_num_steps"] == str(STEPS)
    first = json.loads((run_dir / "train_data_step1.jsonl").read_text().splitlines()[0])
    for name, tables in (("wandb", wb["tables"]), ("mlflow", ml["tables"])):
        assert sorted(tables) == steps and len(tables[1]) == 4, name
        assert (
            tables[1][0]["response"] == first["response"]
            and tables[1][0]["answer_note"] == first["answer_note"]
        )
    assert sorted(readback.tensorboard_text(run_dir, "rollouts")) == steps

    progress = [line for line in stdout.splitlines() if line.startswith("step ")]
    assert len(progress) == STEPS and all("| MFU " in line and " GiB" in line for line in progress)
    assert "kuberl: perf: MFU against CPU" in stdout
    assert f"metrics -> tensorboard, wandb run {ids['wandb']}, mlflow run {ids['mlflow']}" in stdout

    # One more step, resumed from the checkpoint: the same runs go on.
    stdout, resumed_dir = train_tiny(
        trainer_env,
        tmp_path,
        f"grpo.max_num_steps={STEPS + 1}",
        "logger.backends=[tensorboard,wandb,mlflow]",
        "logger.wandb.mode=offline",
        f"logger.mlflow.tracking_uri={uri}",
    )
    assert resumed_dir == run_dir and f"resumed from {tmp_path / 'ckpt' / 'tiny' / f'step_{STEPS}'}" in stdout
    wb, ml = readback.wandb_run(run_dir), readback.mlflow_run(uri, ids["mlflow"])
    assert wb["ids"] == {ids["wandb"]}
    steps.append(STEPS + 1)
    assert (
        sorted(wb["history"]["train/reward_mean"]) == steps
        and sorted(ml["history"]["train/reward_mean"]) == steps
    )
    assert ml["run"].info.status == "FINISHED"
