"""The reward and feedback registries check what a run configures (names, a reward's kwargs and weight)
before it starts, in one line naming the key."""

from __future__ import annotations

import pytest

from tests.cli import refuse_ray, run_main
from trainer import rewards
from trainer.__main__ import main as trainer_main
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
    with pytest.raises(ConfigError, match=r"^reward: "):  # python -m trainer.tools.eval's key
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


# -- a reward's kwargs and weight, checked before the run starts (issue 41) ---------------------------


def _plugin_takes_scale(ground_truth, response, *, scale: float = 1.0):
    return scale * (response == ground_truth)


def _plugin_needs_table(ground_truth, response, *, table):
    return float(table.get(response) == ground_truth)


def _plugin_takes_anything(ground_truth, response, **kwargs):
    return 0.0


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        (
            [RewardSpec("math"), RewardSpec("arithmetic", kwargs={"bogus": 1})],
            "env.reward_functions[1].kwargs.bogus: arithmetic_reward() takes no argument 'bogus'; "
            "it takes: unboxed_score, question",
        ),
        (
            [RewardSpec("trainer.rewards.math_rewards:exact_alnum_reward", kwargs={"answer_tags": "a"})],
            "env.reward_functions[0].kwargs.answer_tags: exact_alnum_reward() takes no argument 'answer_tags'; "
            "it takes: answer_tag",
        ),
        ([RewardSpec("math", float("nan"))], "env.reward_functions[0].weight=nan must be a finite number"),
        (
            [RewardSpec("math"), RewardSpec("format", float("inf"))],
            "env.reward_functions[1].weight=inf must be a finite",
        ),
        ([RewardSpec("math", -float("inf"))], "env.reward_functions[0].weight=-inf must be a finite number"),
    ],
)
def test_should_name_the_index_and_key_in_one_line_when_a_reward_entry_is_bad(specs, message):
    with pytest.raises(ConfigError) as e:
        rewards.check_specs(specs)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_should_bind_every_builtin_rewards_preset_kwargs_when_the_run_starts():
    from trainer.config import load

    for preset in ("arithmetic", "math", "gsm8k", "code_unit_tests", "cpp_contest"):
        rewards.check_specs(load([f"rewards={preset}"]).env.reward_functions)


def test_should_bind_a_plugins_kwargs_against_its_own_signature():
    key = "env.reward_functions[0].kwargs"
    rewards.registry.check_kwargs(_plugin_takes_scale, {"scale": 0.5}, key)
    rewards.registry.check_kwargs(_plugin_takes_anything, {"whatever": 1}, key)  # **kwargs takes every key
    rewards.registry.check_kwargs(_plugin_needs_table, {"table": {}}, key)
    with pytest.raises(
        ConfigError,
        match=r"^env.reward_functions\[0\].kwargs.scal: _plugin_takes_scale\(\) takes no "
        r"argument 'scal'; it takes: scale$",
    ):
        rewards.registry.check_kwargs(_plugin_takes_scale, {"scal": 0.5}, key)
    with pytest.raises(
        ConfigError,
        match=r"^env.reward_functions\[0\].kwargs: _plugin_needs_table\(ground_truth, "
        r"response, \*\*kwargs\) cannot be called with these: .*'table'",
    ):
        rewards.registry.check_kwargs(_plugin_needs_table, {}, key)


@pytest.mark.parametrize(
    ("override", "line"),
    [
        (
            "env.reward_functions=[{name:arithmetic,weight:1,kwargs:{bogus:1}}]",
            "kuberl: error: env.reward_functions[0].kwargs.bogus: arithmetic_reward() takes no argument 'bogus'; "
            "it takes: unboxed_score, question",
        ),
        (
            "env.reward_functions=[{name:arithmetic,weight:nan}]",
            "kuberl: error: env.reward_functions[0].weight=nan must be a finite number",
        ),
        (
            "env.reward_functions=[{name:arithmetic,weight:inf}]",
            "kuberl: error: env.reward_functions[0].weight=inf must be a finite number",
        ),
    ],
)
def test_should_stop_the_run_at_start_in_one_line_when_the_reward_config_is_bad(override, line, monkeypatch):
    # issue 41: these ran to the end, every sample 0 with a warning each, or every reward nan
    refuse_ray(monkeypatch)
    proc = run_main(trainer_main, ["experiment=cpu-demo", override])
    assert proc.returncode == 2 and proc.stderr.strip() == line, (proc.returncode, proc.stderr[-2000:])
