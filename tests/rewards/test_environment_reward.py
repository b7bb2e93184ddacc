"""The ``environment`` reward pays what a multi-turn environment scored its episode, carried to the reward
tasks with the sample; an episode it did not score gets 0 and a note saying so."""

from __future__ import annotations

import pytest

from trainer.config import EnvConfig, RewardSpec
from trainer.rewards.runner import RewardRunner, score_one


def test_should_pay_the_environments_score_by_weight_beside_the_other_rewards():
    specs = [RewardSpec("environment", 0.5), RewardSpec("arithmetic", 1.0)]
    result = score_one(specs, "7", "7", None, 1.0)
    assert result.scores == {"environment": 1.0, "arithmetic": 1.0} and result.total == 1.5 and result.correct
    result = score_one(specs, "7", "7", None, None)
    assert result.scores["environment"] == 0.0 and result.total == 1.0 and not result.correct
    assert result.answer_note == "the environment gave no reward for this episode"


@pytest.mark.slow
def test_should_carry_the_environments_score_to_the_reward_tasks_when_submitted_with_the_sample(ray_local):
    runner = RewardRunner(EnvConfig([RewardSpec("environment")], reward_timeout_s=60))
    ids = runner.submit(
        [("1", "x", "q", [{"role": "user", "content": "q"}], 0.25), ("1", "x", "q"), ("1", "x")]
    )
    assert [r.total for r in runner.results(ids)] == [0.25, 0.0, 0.0]
