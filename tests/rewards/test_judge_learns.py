"""The judge's signal is real: ``experiment=tiny`` trained with the tiny judge of ``tiny_judge.py`` as its only
reward (given the reference sum, it writes "score: 1" for a response that is that sum, "score: 0" for anything
else) learns: its reward rises, and every sample's note is what the judge wrote.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.rewards import tiny_judge
from tests.rewards.tiny_judge import SUM_TEMPLATE
from tests.tiny_run import LEARN_STEPS, read_scalars, train_tiny

pytestmark = pytest.mark.slow

arithmetic_judge = tiny_judge.arithmetic_judge  # the session fixture

JUDGE_ONLY = "env.reward_functions=[{name: llm_judge, weight: 1.0}]"


def test_should_learn_arithmetic_when_an_llm_judge_is_the_only_reward(
    arithmetic_judge,
    trainer_env,
    tmp_path,
    capsys,
):
    stdout, run_dir = train_tiny(
        trainer_env,
        tmp_path,
        JUDGE_ONLY,
        f"judge.model={arithmetic_judge}",
        f"judge.template='{SUM_TEMPLATE}'",
        "judge.max_new_tokens=12",
        "judge.max_score=1",
        "checkpointing.enabled=false",
    )
    assert re.search(
        r"kuberl: judge \S+: 1 replica\(s\) of 1 CPU on the hf engine, reads its chat template", stdout
    ), stdout
    scalars = read_scalars(run_dir)
    rewards = scalars["train/reward_mean"]
    assert rewards == pytest.approx(scalars["train/reward/llm_judge"], abs=1e-4)
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    with capsys.disabled():  # the figures, for a person reading the run (-s)
        print(
            f"\njudge's reward: first 3 steps {first:.3f}, last 3 {last:.3f}; {[round(r, 2) for r in rewards]}"
        )
    assert last > first + 0.1 and last > 2 * first, (
        f"the judge's reward did not rise: {first:.3f} -> {last:.3f}"
    )
    rows = [
        json.loads(line)
        for line in (run_dir / f"train_data_step{LEARN_STEPS}.jsonl").read_text().splitlines()
    ]
    assert all(set(r["rewards"]) == {"llm_judge"} for r in rows)
    assert all(r["correct"] == (r["reward"] == 1.0) for r in rows)  # full marks say correct
    # What the judge wrote is each sample's note (the judge is the only entry): auditable, row by row.
    assert all(r["answer_note"].startswith(("judge read ", "judge output unparsed")) for r in rows), rows[0]
