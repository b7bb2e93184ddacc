"""A model-scored reward that fails is loud: a replica that hangs on a batch or raises on it costs that batch's
samples their reward, and when more than ``env.reward_failure_budget`` of a step's samples are lost the step
ends in one line naming the cause, within ``env.reward_timeout_s`` plus a margin (issue 62, item 4). Real Ray
actors of the reward-model pool's kind, with workers of this module that hang or raise as a broken model
would (an OOM, a template that refuses a system turn, a kernel that never returns)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from trainer.config import EnvConfig, RewardModelConfig, RewardSpec
from trainer.rewards import actors
from trainer.rewards.runner import RewardFailureError, RewardRunner

TIMEOUT_S = 2.0
MARGIN_S = (
    30.0  # the runner's polling and Ray's scheduling, far above both: a bound against a hang, not a speed
)


class _Worker:
    """A replica that scores each response by its length, except the ones it is told to break on."""

    def __init__(self, cfg: RewardModelConfig):
        self.cfg = cfg

    def ready(self) -> dict:
        return {}

    def score(self, items: list[tuple[list[dict], str]]):
        yield None  # started: the runner's time limit counts from here
        responses = [response for _, response in items]
        if "hang" in responses:
            time.sleep(3600)
        if "raise" in responses:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        yield [float(len(r)) for r in responses], [""] * len(responses), 0.0


class _Pool(actors.ModelPool):
    NAME, SECTION, WHAT, worker = "reward_model", "reward_model", "reward model", _Worker

    def model_name(self) -> str:
        return "reward_model.name=broken"

    def item(self, ground_truth: Any, response: str, messages: list[dict]) -> tuple[list[dict], str]:
        return messages, response

    def describe(self) -> str:
        return "a reward model that breaks on demand"

    def finish(self, raw: float | None, note: str) -> tuple[float, float | None, str]:
        return (0.0 if raw is None else raw), raw, note


@pytest.fixture
def runner(ray_local):
    pool = _Pool(RewardModelConfig(name="broken", num_cpus=0.0))
    pool.wait_ready()
    env = EnvConfig([RewardSpec("reward_model")], reward_timeout_s=TIMEOUT_S, reward_failure_budget=0.25)
    try:
        yield RewardRunner(env, scorers=pool)
    finally:
        pool.shutdown(graceful=False)


def _step(runner: RewardRunner, responses: list[str]) -> list:
    messages = [{"role": "user", "content": "2+2?"}]
    return runner.results(runner.submit([(None, r, "2+2?", messages) for r in responses]))


@pytest.mark.parametrize(
    "broken, cause",
    [
        ("hang", f"reward model timed out after {TIMEOUT_S:g}s"),
        ("raise", "reward model raised RuntimeError: CUDA"),
    ],
)
def test_should_stop_the_step_in_one_line_naming_the_cause_when_the_reward_model_hangs_or_raises(
    runner, broken, cause
):
    assert [r.total for r in _step(runner, ["ok", "four"])] == [2.0, 4.0]  # the pool scores when well
    t0 = time.monotonic()
    with pytest.raises(RewardFailureError) as e:
        _step(runner, ["ok", broken, "fine", "good"])  # one batch: every sample of the step is lost
    line = str(e.value)
    assert time.monotonic() - t0 < TIMEOUT_S + MARGIN_S
    assert "\n" not in line and line.startswith("4 of 4 samples lost their reward this step"), line
    assert cause in line and "env.reward_failure_budget" in line


def test_should_restart_a_replica_stuck_past_the_time_limit_so_the_next_step_scores(ray_local):
    """ray.cancel cannot stop an actor's running call: a replica still on a batch after the limit is replaced,
    so the next step's batch does not wait behind it (for START_TIMEOUT_S, then an error)."""
    pool = _Pool(RewardModelConfig(name="broken", num_cpus=0.0, replicas=2))
    pool.wait_ready()
    env = EnvConfig([RewardSpec("reward_model")], reward_timeout_s=TIMEOUT_S, reward_failure_budget=0.5)
    try:
        runner = RewardRunner(env, scorers=pool)
        stuck = pool.workers[0]
        # two batches, one per replica: the first hangs, within the budget (2 of 4 samples)
        assert [r.total for r in _step(runner, ["ok", "hang", "fine", "good"])] == [0.0, 0.0, 4.0, 4.0]
        assert pool.restarts == 1 and pool.workers[0] is not stuck
        t0 = time.monotonic()
        assert [r.total for r in _step(runner, ["a", "bb", "ccc", "dddd"])] == [1.0, 2.0, 3.0, 4.0]
        assert time.monotonic() - t0 < MARGIN_S
    finally:
        pool.shutdown(graceful=False)
