"""The reward runner on a real local Ray instance: weights combine, and a crashing or hanging reward
costs its sample, never the run."""

from __future__ import annotations

import time

import pytest

from trainer.config import EnvConfig, RewardSpec
from trainer.rewards.runner import RewardRunner, score_one


def _boom(ground_truth, response, **kwargs):
    raise RuntimeError("reward bug")


def _hang(ground_truth, response, **kwargs):
    if response == "hang":
        time.sleep(600)
    return 1.0, True


def _kill(ground_truth, response, **kwargs):
    import os

    os._exit(1)


def test_should_combine_rewards_by_weight_when_several_are_configured():
    specs = [RewardSpec("exact_alnum", 0.8), RewardSpec("format", 0.2, {"think_tag": "think", "answer_tag": "answer"})]
    r = score_one(specs, "42", "<think>hm</think> <answer>42</answer>")
    assert r.scores == {"exact_alnum": 1.0, "format": 1.0}
    assert r.total == pytest.approx(1.0) and r.correct
    r = score_one(specs, "41", "<think>hm</think> <answer>42</answer>")
    assert r.total == pytest.approx(0.2) and not r.correct


def test_should_score_zero_and_warn_when_a_reward_raises():
    r = score_one([RewardSpec("tests.rewards.test_runner:_boom"), RewardSpec("exact_alnum")], "7", "7")
    assert r.scores["tests.rewards.test_runner:_boom"] == 0.0 and r.scores["exact_alnum"] == 1.0
    assert "reward bug" in r.warnings[0]


def test_should_check_the_names_on_the_driver_when_a_runner_is_built():
    from trainer.config import ConfigError

    with pytest.raises(ConfigError, match=r"^env.reward_functions\[1\].name: unknown reward 'nope'"):
        RewardRunner(EnvConfig([RewardSpec("math"), RewardSpec("nope")]))
    with pytest.raises(ConfigError, match=r"^env.feedback=None is not allowed; choose one of: code_unit_tests$"):
        RewardRunner(EnvConfig([RewardSpec("math")]), feedback=True)


@pytest.mark.slow
def test_should_time_out_hanging_and_dying_rewards_without_blocking_others(ray_local, caplog):
    runner = RewardRunner(EnvConfig([RewardSpec("tests.rewards.test_runner:_hang")], reward_timeout_s=5,
                                    max_concurrent_rewards=3))
    start = time.monotonic()
    ids = runner.submit([(None, "hang"), (None, "ok"), (None, "ok"), (None, "ok")])
    results = runner.results(ids)
    assert time.monotonic() - start < 60
    assert [r.total for r in results] == [0.0, 1.0, 1.0, 1.0]
    assert "timed out" in results[0].warnings[0]
    dying = RewardRunner(EnvConfig([RewardSpec("tests.rewards.test_runner:_kill")], reward_timeout_s=30))
    (dead,) = dying.results(dying.submit([(None, "x")]))
    assert dead.total == 0.0 and dead.warnings
