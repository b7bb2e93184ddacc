"""The reward and feedback registries check the names a run configures, in one line naming the key."""

from __future__ import annotations

import pytest

from trainer import rewards
from trainer.config import ConfigError, EnvConfig, RewardSpec
from trainer.rewards import feedback


def test_should_accept_registered_and_importable_rewards():
    rewards.check("math", "env.reward_functions[0].name")
    rewards.check("trainer.rewards.math_rewards:exact_alnum_reward", "env.reward_functions[0].name")


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("nope", "unknown reward 'nope'; registered: arithmetic, code_unit_tests, "),
        ("no.such.module:fn", "reward 'no.such.module:fn': cannot import module 'no.such.module'"),
        (
            "trainer.rewards.math_rewards:nope",
            "reward 'trainer.rewards.math_rewards:nope': module 'trainer.rewards.math_rewards' has no callable 'nope'",
        ),
    ],
)
def test_should_name_the_key_in_one_line_when_a_reward_cannot_be_found(name, reason):
    specs = [RewardSpec("math"), RewardSpec(name)]
    with pytest.raises(ConfigError) as e:
        rewards.check_specs(specs)
    message = str(e.value)
    assert message.startswith(f"env.reward_functions[1].name: {reason}") and "\n" not in message, message
    with pytest.raises(ConfigError, match=r"^reward: "):  # python -m trainer.eval's key
        rewards.check(name, "reward")


def test_should_take_the_first_rewards_feedback_when_a_multi_turn_run_names_none():
    env = EnvConfig([RewardSpec("code_unit_tests", kwargs={"time_limit_s": 1.0}), RewardSpec("format")])
    feedback.configure(env, max_rollout_turns=1)
    assert env.feedback is None  # single-turn: no feedback wanted
    feedback.configure(env, max_rollout_turns=3)
    assert (env.feedback, env.feedback_kwargs) == ("code_unit_tests", {"time_limit_s": 1.0})
    env.feedback_kwargs["time_limit_s"] = 2.0
    assert env.reward_functions[0].kwargs == {"time_limit_s": 1.0}  # a copy, not the reward's own dict
    feedback.configure(env, max_rollout_turns=3)  # again: nothing changes
    assert (env.feedback, env.feedback_kwargs) == ("code_unit_tests", {"time_limit_s": 2.0})


@pytest.mark.parametrize(("first", "given"), [("math", None), ("code_unit_tests", "math")])
def test_should_say_which_feedback_exists_when_a_multi_turn_run_has_none(first, given):
    env = EnvConfig([RewardSpec(first)], feedback=given)
    with pytest.raises(ConfigError) as e:
        feedback.configure(env, max_rollout_turns=2)
    assert str(e.value) == (
        f"grpo.max_rollout_turns=2 needs execution feedback: env.feedback={given!r}; available: code_unit_tests"
    )
