"""The reward model's signal is real: ``experiment=tiny`` trained with the tiny Bradley-Terry model of
``tiny_rm.py`` as its only reward learns (its reward rises), and the arithmetic accuracy that
``trainer.tools.eval`` measures with the verifiable ``arithmetic`` reward, which the run never saw, rises with it;
beside the verifiable reward by weight (0.5/0.5) the run trains and reports both components.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.rewards import tiny_rm
from tests.tiny_run import LEARN_STEPS, read_scalars, train_tiny

pytestmark = pytest.mark.slow

arithmetic_rm = tiny_rm.arithmetic_rm  # the session fixture

RM_ONLY = "env.reward_functions=[{name: reward_model, weight: 1.0}]"
HALF_AND_HALF = (
    "env.reward_functions=[{name: arithmetic, weight: 0.5, kwargs: {unboxed_score: 1.0}}, "
    "{name: reward_model, weight: 0.5}]"
)
# trainer.tools.eval's prompts: the tiny problems drawn from another seed than the run's (42), greedy.
EVAL = [
    "data=arithmetic",
    "options.num_examples=64",
    "options.min_operand=0",
    "options.max_operand=2",
    "options.ops=+",
    "split=train",
    "seed=7",
    "max_new_tokens=1",
]


def _accuracy(model: str, out, capsys) -> float:
    from trainer.tools.eval import main

    assert main([f"model={model}", *EVAL, f"output={out}"]) == 0
    capsys.readouterr()
    return json.loads((out / "eval_arithmetic_result.json").read_text())["score"]


def test_should_learn_arithmetic_when_a_bradley_terry_reward_model_is_the_only_reward(
    arithmetic_rm,  # noqa: F811  (the fixture imported above)
    trainer_env,
    tmp_path,
    capsys,
):
    from trainer.tools.convert import convert

    stdout, run_dir = train_tiny(
        trainer_env,
        tmp_path,
        RM_ONLY,
        f"reward_model.name={arithmetic_rm}",
        f"checkpointing.save_period={LEARN_STEPS}",
    )
    assert re.search(r"kuberl: reward model \S+: 1 replica\(s\) of 1 CPU, reads its chat template", stdout), (
        stdout
    )
    scalars = read_scalars(run_dir)
    rewards, rm_mean = scalars["train/reward_mean"], scalars["train/rm_score_mean"]
    assert rewards == pytest.approx(scalars["train/reward/reward_model"], abs=1e-4)
    assert rewards == pytest.approx(rm_mean, abs=1e-4)  # the mean is float32 in one, float64 in the other
    assert "train/rm_length_corr" in scalars
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    with capsys.disabled():  # the figures, for a person reading the run (-s)
        print(
            f"\nreward model score: first 3 steps {first:.3f}, last 3 {last:.3f}; {[round(r, 2) for r in rewards]}"
        )
    assert last > first + 1.0, f"the reward model's score did not rise: {first:.3f} -> {last:.3f}"
    rows = [json.loads(line) for line in (run_dir / "train_data_step1.jsonl").read_text().splitlines()]
    assert all(set(r["rewards"]) == {"reward_model"} and r["rm_score"] == r["reward"] for r in rows)
    assert not any(r["correct"] for r in rows)  # nothing verifiable judged them

    convert(tmp_path / "ckpt" / "tiny" / f"step_{LEARN_STEPS}", tmp_path / "trained")
    before = _accuracy("builtin:tiny", tmp_path / "eval_before", capsys)
    after = _accuracy(str(tmp_path / "trained"), tmp_path / "eval_after", capsys)
    with capsys.disabled():
        print(
            f"\narithmetic accuracy (trainer.tools.eval, greedy, arithmetic reward): {before:.3f} -> {after:.3f}"
        )
    assert after > before + 0.3, f"the arithmetic accuracy did not rise: {before:.3f} -> {after:.3f}"


def test_should_train_on_both_when_the_reward_model_sits_beside_a_verifiable_reward(
    arithmetic_rm,  # noqa: F811  (the fixture imported above)
    trainer_env,
    tmp_path,
):
    _, run_dir = train_tiny(
        trainer_env,
        tmp_path,
        HALF_AND_HALF,
        f"reward_model.name={arithmetic_rm}",
        "grpo.max_num_steps=2",
        "checkpointing.enabled=false",
    )
    scalars = read_scalars(run_dir)
    assert len(scalars["train/reward_mean"]) == 2
    for step in range(2):
        total = (
            0.5 * scalars["train/reward/arithmetic"][step] + 0.5 * scalars["train/reward/reward_model"][step]
        )
        assert scalars["train/reward_mean"][step] == pytest.approx(total, abs=1e-4)
    rows = [json.loads(line) for line in (run_dir / "train_data_step2.jsonl").read_text().splitlines()]
    for r in rows:
        assert list(r["rewards"]) == ["arithmetic", "reward_model"]
        assert r["reward"] == pytest.approx(0.5 * r["rewards"]["arithmetic"] + 0.5 * r["rm_score"], abs=1e-5)
        assert r["correct"] == (r["rewards"]["arithmetic"] == 1.0)  # the verifiable reward alone says correct
