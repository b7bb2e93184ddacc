"""The ``skyrl_gym`` environment on SkyRL-gym's real environments: its rewards must be SkyRL's own reward
functions' on right and wrong answers, its observations SkyRL's messages; and every way an environment can
fail (raise, hang, rewrite the prompt, answer nonsense) ends an episode with reward 0 or one clear line."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from types import SimpleNamespace

import pytest

skyrl_gym = pytest.importorskip("skyrl_gym")  # the envs extra; make setup installs it (dev)

from skyrl_gym.envs.aime.utils import compute_score as aime_score  # noqa: E402
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput  # noqa: E402
from skyrl_gym.envs.gsm8k.utils import compute_score as gsm8k_score  # noqa: E402

import trainer.data as data  # noqa: E402
from trainer.config import ConfigError  # noqa: E402
from trainer.envs import build, names  # noqa: E402
from trainer.envs import skyrl_gym as adapter  # noqa: E402

QUESTION = [
    {"role": "user", "content": "Natalia sold 48 clips in April and half as many in May. How many in all?"}
]

# (response, ground truth): right and wrong in the ways GSM8K answers come (SkyRL's strict "####" format)
GSM8K_CASES = [
    ("48 + 24 = 72\n#### 72", "72"),
    ("#### 72", "72"),
    ("The total is #### 1,234", "1234"),
    ("48 + 24 = 72\n#### 71", "72"),
    ("The answer is 72.", "72"),  # no "####": SkyRL's strict extraction finds nothing
    ("#### -3", "-3"),
    ("", "72"),
]


def example(ground_truth, **extra):
    return {"id": "ex-0", "messages": QUESTION, "ground_truth": ground_truth, **extra}


def run(env, ex, turns):
    """Feed ``turns`` to one episode; the Steps it returned."""
    episode = env.episode(ex)
    steps = []
    try:
        for text in turns:
            steps.append(episode.step(text))
            if steps[-1].done:
                break
    finally:
        episode.close()
    return steps


def test_should_pay_skyrl_gsm8k_reward_function_when_answers_are_right_and_wrong() -> None:
    env = build("skyrl_gym", {"env_class": "gsm8k"})
    paid = []
    for response, truth in GSM8K_CASES:
        (step,) = run(env, example(truth), [response])
        assert step.done and step.messages == []
        assert step.reward == gsm8k_score(response, truth), response
        paid.append(step.reward)
    assert paid.count(1.0) == 4 and paid.count(0) == 3  # both sides of the table are exercised


def test_should_relay_observations_and_sum_turn_rewards_when_the_environment_is_multi_turn() -> None:
    env = build("skyrl_gym", {"env_class": "gsm8k_multi_turn", "extras": {"max_turns": 3}})
    turns = ["I think #### 70", "then #### 72", "unused"]
    steps = run(env, example("72"), turns)

    # SkyRL's own environment, stepped by hand on the same turns, is the oracle
    own = skyrl_gym.make(
        "gsm8k_multi_turn", env_config={}, extras={"reward_spec": {"ground_truth": "72"}, "max_turns": 3}
    )
    own.init(QUESTION)
    first, second = own.step(turns[0]), own.step(turns[1])
    assert [s.done for s in steps] == [False, True]
    assert steps[0].messages == first["observations"] and steps[0].messages[0]["role"] == "user"
    assert steps[0].reward is None  # set when done
    assert steps[1].reward == pytest.approx(first["reward"] + second["reward"])
    assert 1.0 < steps[1].reward < 1.1  # a format point for the wrong turn, 1 for the right one


def test_should_end_at_the_environment_max_turns_when_every_answer_is_wrong() -> None:
    env = build("skyrl_gym", {"env_class": "gsm8k_multi_turn", "extras": {"max_turns": 2}})
    steps = run(env, example("72"), ["#### 1", "#### 2", "#### 3"])
    assert [s.done for s in steps] == [False, True]
    assert steps[-1].reward == pytest.approx(2 * gsm8k_score("#### 1", "72", format_score=0.2 / 2))


def write_skyrl_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def data_cfg(path, **overrides):
    base = dict(
        name="skyrl_gym", path=str(path), hf_name=None, hf_config=None, split="train", max_examples=None,
        shuffle=False, seed=0, system_prompt=None, prompt_template="{question}", options={},
    )  # fmt: skip
    return SimpleNamespace(**{**base, **overrides})


def test_should_read_a_skyrl_dataset_and_pass_each_row_to_the_environment_when_named_skyrl_gym(
    tmp_path,
) -> None:
    # rows as SkyRL's math datasets write them: the AIME environment reads reward_model, not reward_spec
    rows = [
        {
            "data_source": "aime",
            "prompt": [
                {"role": "system", "content": "Box the answer."},
                {"role": "user", "content": f"{n} + 1?"},
            ],
            "env_class": "aime",
            "reward_model": {"style": "rule", "ground_truth": str(n + 1)},
            "extra_info": {"index": n},
        }
        for n in range(3)
    ]
    examples = data.get("skyrl_gym")(data_cfg(write_skyrl_rows(tmp_path / "aime.jsonl", rows)), "train")
    assert [ex["messages"] for ex in examples] == [r["prompt"] for r in rows]
    assert examples[0]["env_extras"]["reward_model"] == rows[0]["reward_model"]
    assert "env_class" not in examples[0]["env_extras"] and "prompt" not in examples[0]["env_extras"]

    env = build("skyrl_gym", {"env_class": "aime"})
    paid = []
    for ex, n in zip(examples, range(3)):
        # DAPO's format, which this environment's scorer reads: right, wrong, and a boxed answer it does not read
        for response in (f"So, Answer: {n + 1}", f"Answer: {n + 7}", f"so \\boxed{{{n + 1}}}"):
            (step,) = run(env, ex, [response])
            assert step.reward == aime_score(response, str(n + 1))["score"], response
            paid.append(step.reward)
    assert paid == [1.0, -1.0, -1.0] * 3


def test_should_take_the_ground_truth_as_reward_spec_when_the_example_is_from_another_dataset(
    tmp_path,
) -> None:
    (tmp_path / "gsm8k.jsonl").write_text(
        json.dumps({"question": "2 + 2?", "answer": "2 + 2 = 4\n#### 4"}) + "\n"
    )
    cfg = data_cfg(tmp_path / "gsm8k.jsonl", name="gsm8k", prompt_key="question", answer_key="answer")
    (ex,) = data.get("gsm8k")(cfg, "train")
    env = build("skyrl_gym", {"env_class": "gsm8k"})
    assert run(env, ex, ["#### 4"])[0].reward == 1.0
    assert run(env, ex, ["#### 5"])[0].reward == 0.0


def test_should_be_registered_by_name_when_trainer_envs_builds_it() -> None:
    assert "skyrl_gym" in names() and "skyrl_gym" in data.names()
    env = build("skyrl_gym", {"env_class": "gsm8k", "env_kwargs": {}, "step_timeout_s": 5})
    assert isinstance(env, adapter.SkyRLGym) and env.name == "skyrl_gym" and env.tools() is None


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"env_class": "gsm8k_typo"}, "env.environment_kwargs.env_class='gsm8k_typo' is not a SkyRL-gym environment; valid: aime, gsm8k,"),
        ({"env_class": "gsm8k", "env_kwargs": [1]}, "env.environment_kwargs.env_kwargs must be a mapping"),
        ({"env_class": "gsm8k", "step_timeout_s": 0}, "env.environment_kwargs.step_timeout_s=0 must be"),
        ({}, "env.environment_kwargs for 'skyrl_gym'"),  # env_class is required
    ],
)  # fmt: skip
def test_should_refuse_in_one_line_when_the_kwargs_are_wrong(kwargs, says) -> None:
    with pytest.raises(ConfigError) as e:
        build("skyrl_gym", kwargs)
    assert str(e.value).startswith(says) and "\n" not in str(e.value)


def test_should_name_the_extra_in_one_line_when_skyrl_gym_is_not_installed(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "skyrl_gym", None)  # what an import of a missing package raises
    with pytest.raises(ConfigError) as e:
        build("skyrl_gym", {"env_class": "gsm8k"})
    assert str(e.value) == (
        "env.environment=skyrl_gym needs the skyrl-gym package: pip install 'kuberl-trainer[envs]'"
    )


class Misbehaving(BaseTextEnv):
    """A SkyRL-gym environment that fails the way ``extras["mode"]`` says."""

    release = threading.Event()  # lets a hung step finish when the test ends

    def __init__(self, env_config=None, extras=None):
        super().__init__()
        self.mode = extras["mode"]

    def init(self, prompt):
        if self.mode == "rewrite":
            return [{"role": "system", "content": "a prompt of its own"}, *prompt], {}
        if self.mode == "init_raises":
            raise RuntimeError("no database")
        return prompt, {}

    def step(self, action):
        if self.mode == "raise":
            raise KeyError("tool crashed")
        if self.mode == "hang":
            self.release.wait(60)
        if self.mode == "nan":
            return BaseTextEnvStepOutput(observations=[], reward=float("nan"), done=True, metadata={})
        if self.mode == "silent":  # goes on, with nothing to say
            return BaseTextEnvStepOutput(observations=[], reward=0.5, done=False, metadata={})
        if self.mode == "bad_observations":
            return BaseTextEnvStepOutput(observations="not messages", reward=0.5, done=False, metadata={})
        return BaseTextEnvStepOutput(observations=[], reward=0.5, done=True, metadata={})


@pytest.fixture
def misbehaving():
    Misbehaving.release.clear()
    skyrl_gym.register(id="kuberl_test_misbehaving", entry_point=Misbehaving)
    try:
        yield
    finally:
        Misbehaving.release.set()
        skyrl_gym.envs.registration.deregister("kuberl_test_misbehaving")


@pytest.mark.parametrize("mode", ["raise", "hang", "nan", "bad_observations", "init_raises"])
def test_should_end_the_episode_with_reward_zero_and_log_once_when_the_environment_fails(
    misbehaving, mode, caplog, monkeypatch
) -> None:
    monkeypatch.setattr(adapter, "_logged", set())
    env = build("skyrl_gym", {"env_class": "kuberl_test_misbehaving", "step_timeout_s": 0.5})
    ex = example(None, env_extras={"mode": mode})
    with caplog.at_level(logging.WARNING, logger="trainer.envs.skyrl_gym"):
        start = time.monotonic()
        first = run(env, ex, ["#### 1"])
        second = run(env, ex, ["#### 1"])
    assert time.monotonic() - start < 5  # a hung step is abandoned at the timeout, not waited for
    for (step,) in (first, second):
        assert step == type(step)(messages=[], done=True, reward=0.0, info={"errors": 1.0})
    (note,) = [r.getMessage() for r in caplog.records]  # two failures, one line
    assert note.startswith("skyrl_gym 'kuberl_test_misbehaving': ") and "reward 0" in note


def test_should_pay_what_the_environment_says_when_it_behaves(misbehaving) -> None:
    env = build("skyrl_gym", {"env_class": "kuberl_test_misbehaving"})
    (step,) = run(env, example(None, env_extras={"mode": "fine"}), ["anything"])
    assert step.done and step.reward == 0.5 and "errors" not in step.info


def test_should_end_with_the_rewards_so_far_when_the_environment_goes_on_without_a_message(
    misbehaving, caplog, monkeypatch
) -> None:
    monkeypatch.setattr(adapter, "_logged", set())
    env = build("skyrl_gym", {"env_class": "kuberl_test_misbehaving"})
    with caplog.at_level(logging.WARNING, logger="trainer.envs.skyrl_gym"):
        (step,) = run(env, example(None, env_extras={"mode": "silent"}), ["anything", "more"])
    assert step.done and step.messages == [] and step.reward == 0.5
    assert "without observations" in caplog.records[0].getMessage()


def test_should_refuse_an_environment_when_its_init_rewrites_the_prompt(misbehaving) -> None:
    env = build("skyrl_gym", {"env_class": "kuberl_test_misbehaving"})
    with pytest.raises(ConfigError, match="rewrites the prompt in init"):
        env.episode(example(None, env_extras={"mode": "rewrite"}))


def test_should_say_which_example_when_the_data_does_not_fit_the_environment() -> None:
    env = build("skyrl_gym", {"env_class": "aime"})  # reads reward_model, which a reward_spec row lacks
    with pytest.raises(
        ConfigError, match=r"env_class='aime' cannot start on example 'ex-0' of data.name: reward_model"
    ):
        env.episode(example("4"))


@pytest.mark.parametrize(
    ("row", "says"),
    [
        ({"question": "2 + 2?", "reward_spec": {"ground_truth": "4"}}, "no column 'prompt' (SkyRL's format); columns: question, reward_spec"),
        ({"prompt": "2 + 2?", "reward_spec": {"ground_truth": "4"}}, "'prompt' must be a non-empty list of chat messages"),
        ({"prompt": [{"role": "user"}], "reward_spec": {"ground_truth": "4"}}, "each 'prompt' message needs a string role and content"),
    ],
)  # fmt: skip
def test_should_refuse_in_one_line_when_a_row_is_not_skyrl_format(tmp_path, row, says) -> None:
    path = write_skyrl_rows(tmp_path / "bad.jsonl", [row])
    with pytest.raises(ValueError) as e:
        data.get("skyrl_gym")(data_cfg(path), "train")
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("setting", [{"system_prompt": "Be brief."}, {"prompt_template": "Q: {question}"}])
def test_should_refuse_a_prompt_setting_it_would_ignore_when_the_rows_carry_their_messages(
    tmp_path, setting
) -> None:
    path = write_skyrl_rows(
        tmp_path / "ok.jsonl", [{"prompt": QUESTION, "reward_spec": {"ground_truth": "72"}}]
    )
    assert data.get("skyrl_gym")(data_cfg(path), "train")[0]["messages"] == QUESTION
    with pytest.raises(ValueError, match="takes each row's prompt messages as they are"):
        data.get("skyrl_gym")(data_cfg(path, **setting), "train")
