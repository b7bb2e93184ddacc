"""policy.lr_schedule: the learning rate each optimizer step runs at, as a pure function and through the real
PolicyWorker's optimizer (one float32 rank, gloo, in this process)."""

from __future__ import annotations

import math

import pytest

from tests.policy.helpers import one_rank_worker, skewed_samples
from trainer.config import ConfigError, load
from trainer.policy.worker import lr_factor


def test_should_keep_the_rate_after_warm_up_when_constant() -> None:
    assert [lr_factor(s, 4, 10, "constant", 0.0) for s in range(7)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0]
    assert [lr_factor(s, 0, 10, "constant", 0.0) for s in range(3)] == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 3])
@pytest.mark.parametrize("floor", [0.0, 0.1])
def test_should_decay_from_the_full_rate_to_the_floor_over_the_run(schedule, warmup, floor) -> None:
    """Full rate on the first step after warm-up, never rising after it, still moving on the run's last step,
    at the floor one step past it and after (a run extended past its planned end)."""
    total = 20
    f = [lr_factor(s, warmup, total, schedule, floor) for s in range(total + 5)]
    assert f[warmup] == 1.0
    assert all(a >= b for a, b in zip(f[warmup:], f[warmup + 1 :]))
    assert f[total - 1] > floor
    assert f[total:] == pytest.approx([floor] * 5)
    middle = warmup + (total - warmup) // 2 if (total - warmup) % 2 == 0 else None
    if middle is not None:  # halfway: the mean of the two ends, for both shapes
        assert f[middle] == pytest.approx((1.0 + floor) / 2)
    if schedule == "cosine":  # a quarter of the way: cos(pi/4) of the span left, not linear's 3/4
        quarter = warmup + (total - warmup) / 4
        if quarter.is_integer():
            assert f[int(quarter)] == pytest.approx(floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi / 4)))


def test_should_refuse_an_unknown_schedule_or_a_floor_it_would_ignore() -> None:
    with pytest.raises(ConfigError, match="policy.lr_schedule"):
        load(["experiment=tiny", "policy.lr_schedule=step"])
    with pytest.raises(ConfigError, match="policy.min_lr_ratio=0.1 takes effect only with a decay"):
        load(["experiment=tiny", "policy.min_lr_ratio=0.1"])
    with pytest.raises(ConfigError, match=r"policy.min_lr_ratio=1.5 must be in \[0, 1\]"):
        load(["experiment=tiny", "policy.lr_schedule=linear", "policy.min_lr_ratio=1.5"])


def test_should_train_each_step_at_the_scheduled_rate_through_the_real_worker(tiny_model_path) -> None:
    """Four optimizer steps of a run planned at two GRPO steps of two minibatches: the rate each step reports
    (``train/lr``) and the one AdamW used follow the schedule over the run's optimizer steps, not its GRPO steps."""
    overrides = [
        "policy.learning_rate=1e-3",
        "policy.warmup_steps=1",
        "policy.lr_schedule=cosine",
        "policy.min_lr_ratio=0.2",
        "grpo.max_num_steps=2",
        "grpo.num_minibatches=2",
    ]
    with one_rank_worker(tiny_model_path, overrides) as w:
        samples = skewed_samples()
        counts = {"tokens": float(sum(sum(s.response_mask) for s in samples)), "seqs": float(len(samples))}
        used, reported = [], []
        for _ in range(4):
            used.append(w.optimizer.param_groups[0]["lr"])
            reported.append(w.train([samples], [counts])["lr"])
    planned = [1e-3 * lr_factor(s, 1, 4, "cosine", 0.2) for s in range(4)]
    assert used == pytest.approx(planned)
    assert planned == pytest.approx([1e-3, 1e-3, 1e-3 * (0.2 + 0.8 * 0.75), 1e-3 * (0.2 + 0.8 * 0.25)])
    # what a step reports is the rate the next one runs at (the scheduler has stepped)
    assert reported[:3] == pytest.approx(planned[1:])
