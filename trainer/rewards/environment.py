"""The ``environment`` reward: what a multi-turn environment that scores its own episodes said.

An environment (:mod:`trainer.envs`) may end an episode with a reward of its own (``Step.reward``); the
rollout loop hands it to the reward runner with the sample, and this entry of ``env.reward_functions``
pays it, by its weight, beside any other reward. An episode whose environment gave none scores 0 with a
note saying so.
"""

from __future__ import annotations

from typing import Any

from trainer.rewards.registry import Score, register


@register("environment")
def environment(ground_truth: Any, response: str, environment_reward: float | None = None) -> Score:
    if environment_reward is None:
        return Score(0.0, False, None, "the environment gave no reward for this episode")
    value = float(environment_reward)
    return Score(value, value >= 1.0, None, f"environment reward {value:g}")
