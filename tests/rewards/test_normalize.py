"""Per-entry reward normalisation (``env.reward_functions[*].normalize``): the running window's arithmetic
against numpy over a sequence of steps, what stays out of the statistics (failed and non-finite scores,
validation), a constant entry, the state a checkpoint carries, the config's checks, and one pass through
the runner on a real local Ray instance."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from trainer.config import ConfigError, EnvConfig, RewardSpec
from trainer.rewards.runner import (
    RewardNormalizer,
    RewardResult,
    RewardRunner,
    normalization_metrics,
    score_one,
)

TESTS = RewardSpec("unit_tests", 0.5)  # raw, in [0, 1]
RM = RewardSpec("rm", 0.5, normalize="running", window=3)  # on a reward model's scale


def _step(tests: list[float], rm: list[float]) -> list[RewardResult]:
    """One step's results as the runner holds them before normalising: raw scores and their raw sum."""
    out = []
    for t, s in zip(tests, rm):
        r = RewardResult(total=0.0, correct=True, scores={"unit_tests": t, "rm": s})
        r.total += TESTS.weight * t
        r.total += RM.weight * s
        out.append(r)
    return out


def _steps(seed: int, n: int) -> list[tuple[list[float], list[float]]]:
    """``n`` steps of random sizes: pass rates and reward-model scores that drift, as a policy's do."""
    rng = random.Random(seed)
    steps = []
    for k in range(n):
        size = rng.randint(1, 12)
        steps.append(
            (
                [rng.choice((0.0, 0.25, 1.0)) for _ in range(size)],
                [rng.gauss(5.0 + 2.0 * k, 4.0) for _ in range(size)],
            )
        )
    return steps


def test_should_normalise_by_the_last_window_steps_scores_when_running_as_numpy_does():
    norm = RewardNormalizer([TESTS, RM])
    steps = _steps(seed=0, n=8)
    for k, (tests, rm) in enumerate(steps):
        results = _step(tests, rm)
        norm.apply(results)
        window = np.concatenate([s[1] for s in steps[max(0, k - 2) : k + 1]])  # the step itself included
        mean, std = window.mean(), window.std()  # population std, as numpy's default
        z = (np.array(rm) - mean) / std
        np.testing.assert_allclose([r.normalized["rm"] for r in results], z, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(
            [r.total for r in results], 0.5 * np.array(tests) + 0.5 * z, rtol=1e-12, atol=1e-12
        )
        assert all(r.norm["rm"] == pytest.approx((mean, std), rel=1e-12) for r in results)
        assert all("unit_tests" not in r.normalized for r in results)  # raw: normalize none
        assert [r.scores["rm"] for r in results] == rm  # the raw scores stay what the entry scored


def test_should_normalise_by_the_steps_own_scores_when_batch():
    norm = RewardNormalizer([TESTS, RewardSpec("rm", 0.5, normalize="batch")])
    for tests, rm in _steps(seed=1, n=3):
        results = _step(tests, rm)
        norm.apply(results)
        z = (np.array(rm) - np.mean(rm)) / np.std(rm)
        np.testing.assert_allclose([r.normalized["rm"] for r in results], z, rtol=1e-12, atol=1e-12)
    assert norm.state_dict() == {"windows": {}}  # batch keeps nothing from step to step


def test_should_leave_every_sum_bit_identical_when_no_entry_normalises():
    specs = [RewardSpec("exact_alnum", 0.3), RewardSpec("format", 0.7, {"think_tag": "t", "answer_tag": "a"})]
    results = [score_one(specs, "42", r) for r in ("<t>x</t><a>42</a>", "42", "<a>41</a>", "")]
    before = [r.total for r in results]
    RewardNormalizer(specs).apply(results)
    assert [r.total for r in results] == before and all(not r.normalized and not r.norm for r in results)


def test_should_leave_failed_and_non_finite_scores_out_of_the_statistics_and_pay_the_mean_for_failures():
    norm = RewardNormalizer([TESTS, RM])
    results = _step([1.0, 1.0, 1.0, 0.0, 1.0], [10.0, 0.0, 30.0, 4.0, 6.0])
    results[1].failed.append("rm")  # its batch timed out: the 0 it scores is no score
    results[3] = RewardResult(0.0, False, {}, ["reward task failed: the worker died"])  # its task was lost
    results[4].scores["rm"] = math.nan  # a model that overflowed
    norm.apply(results)
    kept = np.array([10.0, 30.0])
    z = (kept - kept.mean()) / kept.std()
    assert [results[0].normalized["rm"], results[2].normalized["rm"]] == pytest.approx(z.tolist())
    # The tests' 1.0 at 0.5, and the mean's 0 for the reward model that failed.
    assert results[1].normalized["rm"] == 0.0 and results[1].total == 0.5
    assert results[3].normalized["rm"] == 0.0 and results[3].total == 0.0
    assert math.isnan(results[4].total)  # a nan score still shows as nan, but not in the next steps' window
    assert norm.state_dict()["windows"]["rm"]["steps"] == [[2, 20.0, 200.0]]


def test_should_use_and_never_update_the_window_when_validating():
    norm = RewardNormalizer([TESTS, RM])
    # Before any step (validation at start) a running entry has only the batch's own statistics ...
    results = _step([0.0, 0.0], [1.0, 3.0])
    norm.apply(results, update=False)
    assert [r.normalized["rm"] for r in results] == [-1.0, 1.0]
    assert norm.state_dict()["windows"]["rm"]["steps"] == []  # ... and keeps nothing of them
    norm.apply(_step([0.0, 0.0], [10.0, 20.0]))  # a training step: mean 15, std 5
    saved = norm.state_dict()
    results = _step([0.0, 0.0, 0.0], [15.0, 25.0, 100.0])
    norm.apply(results, update=False)
    assert [r.normalized["rm"] for r in results] == [0.0, 2.0, 17.0]  # the training window's statistics
    assert norm.state_dict() == saved


def test_should_pay_zero_and_never_divide_by_a_rounding_std_when_an_entry_is_constant():
    norm = RewardNormalizer([TESTS, RewardSpec("rm", 0.5, normalize="batch")])
    results = _step([1.0, 0.0, 0.5], [23.0, 23.0, 23.0])
    norm.apply(results)
    assert [r.normalized["rm"] for r in results] == [0.0, 0.0, 0.0]
    assert [r.total for r in results] == [0.5, 0.0, 0.25]
    # Scores that differ by float32 rounding alone (an ulp at 23 is 2e-6) are constant too, not +-1.
    results = _step([0.0, 0.0], [23.0, float(np.nextafter(np.float32(23.0), np.float32(24.0)))])
    norm.apply(results)
    assert [r.normalized["rm"] for r in results] == [0.0, 0.0]
    # A real difference is never that small: 0.01 at 23 is normalised.
    results = _step([0.0, 0.0], [23.0, 23.01])
    norm.apply(results)
    assert [r.normalized["rm"] for r in results] == pytest.approx([-1.0, 1.0])


def test_should_continue_the_same_window_when_resumed_from_the_state_dict():
    steps = _steps(seed=2, n=7)
    through = RewardNormalizer([TESTS, RM])
    for tests, rm in steps[:4]:
        through.apply(_step(tests, rm))
    state = json.loads(json.dumps(through.state_dict()))  # what a checkpoint writes and reads
    resumed = RewardNormalizer([TESTS, RM])
    assert resumed.load_state_dict(state) is None
    assert resumed.state_dict() == through.state_dict()
    for tests, rm in steps[4:]:
        a, b = _step(tests, rm), _step(tests, rm)
        through.apply(a)
        resumed.apply(b)
        assert [r.total for r in a] == [r.total for r in b]  # bit for bit
    # A shorter window keeps the newest steps; an entry the checkpoint has no window for starts empty, and says so.
    shorter = RewardNormalizer([TESTS, RewardSpec("rm", 0.5, normalize="running", window=2)])
    assert shorter.load_state_dict(state) is None
    assert shorter.state_dict()["windows"]["rm"]["steps"] == state["windows"]["rm"]["steps"][-2:]
    other = RewardNormalizer([TESTS, RewardSpec("judge", 0.5, normalize="running")])
    warning = other.load_state_dict(state)
    assert warning is not None and "\n" not in warning and "judge" in warning and "start empty" in warning
    with pytest.raises(ValueError, match="not a state_dict"):
        resumed.load_state_dict({"windows": {"rm": {"steps": [[1, 2.0]]}}})


def test_should_report_each_normalised_entrys_mean_and_std_when_a_step_ends():
    norm = RewardNormalizer([TESTS, RM])
    results = _step([0.0, 1.0], [10.0, 20.0])
    norm.apply(results)

    class _Rollout:
        def __init__(self, reward):
            self.reward = reward

    assert normalization_metrics([_Rollout(r) for r in results]) == {
        "train/reward/rm/norm_mean": 15.0,
        "train/reward/rm/norm_std": 5.0,
    }
    assert normalization_metrics([_Rollout(r) for r in _step([0.0], [1.0])]) == {}  # nothing normalised


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            {"normalize": "zscore"},
            "env.reward_functions[1].normalize='zscore' is not allowed; choose one of: none, batch, running",
        ),
        ({"normalize": "running", "window": 0}, "env.reward_functions[1].window=0 must be >= 1"),
        (
            {"normalize": "batch", "name": "exact_alnum"},
            "env.reward_functions[1]: 'exact_alnum' is also entry 0",
        ),
    ],
)
def test_should_refuse_in_one_line_naming_the_entry_when_a_normalisation_is_wrong(entry, message):
    spec = RewardSpec(**{"name": "format", **entry})
    with pytest.raises(ConfigError) as e:
        EnvConfig([RewardSpec("exact_alnum"), spec]).validate()
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    # Two entries of one name, neither normalised: accepted, as before.
    EnvConfig([RewardSpec("exact_alnum"), RewardSpec("exact_alnum", 0.5)]).validate()


def test_should_normalise_the_reward_models_entry_when_the_code_rm_preset_runs():
    from trainer import config

    specs = {s.name: s for s in config.load(["experiment=qwen2.5-coder-7b-code-rm"]).env.reward_functions}
    assert specs["reward_model"].normalize == "running" and specs["reward_model"].window >= 1
    assert specs["code_unit_tests"].normalize == "none"


def _length(ground_truth, response, **kwargs):  # a reward on its own scale: the response's length
    if response == "x":
        raise RuntimeError("reward bug")
    return float(len(response)), True


def test_should_normalise_on_the_driver_and_keep_validation_out_of_the_window_when_scoring_on_ray(ray_local):
    length = RewardSpec("tests.rewards.test_normalize:_length", 1.0, normalize="running", window=2)
    runner = RewardRunner(EnvConfig([RewardSpec("exact_alnum", 0.5), length], reward_failure_budget=0.5))
    name = length.name
    first = runner.results(runner.submit([("ab", "ab"), ("ab", "abcd"), ("ab", "x")]))  # x raises: left out
    assert [r.normalized[name] for r in first] == [-1.0, 1.0, 0.0]
    assert [r.total for r in first] == [0.5 - 1.0, 1.0, 0.0] and [r.scores[name] for r in first] == [
        2.0,
        4.0,
        0.0,
    ]
    with runner.validating():
        val = runner.results(runner.submit([("", "abc"), ("", "abcdefg")]))
    assert [r.normalized[name] for r in val] == [0.0, 4.0]  # the window's mean 3 and std 1
    second = runner.results(runner.submit([("", "abcdef")]))  # 2, 4 and 6: mean 4
    assert second[0].normalized[name] == pytest.approx(2.0 / math.sqrt(8.0 / 3.0))
    state = json.loads(json.dumps(runner.state_dict()))
    assert state["normalize"]["windows"][name]["steps"] == [[2, 3.0, 2.0], [1, 6.0, 0.0]]
    fresh = RewardRunner(EnvConfig([RewardSpec("exact_alnum", 0.5), length]))
    assert fresh.load_state_dict(state) is None and fresh.state_dict() == runner.state_dict()
