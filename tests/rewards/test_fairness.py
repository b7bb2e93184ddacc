"""The ``math`` reward is fair: an honest answer scores 1 in every format real models and evaluation
harnesses write, for every kind of answer math-verify's own tests cover (CONTRIBUTING.md: Rewards are an attack surface; issue 41).

A reward that refuses honest answers teaches the policy a format instead of the task, and skews every
evaluation figure against the peers'. Each row is one answer of one kind (numbers and their formatting,
fractions and decimals, sets, tuples, intervals and inequalities, equations, matrices, units and
percentages, LaTeX styles), written by hand in tables.py; each is tried in every response style there
and must score 1. Beside them, near misses of each kind (a wrong value in the same dress) must score 0, so that
fairness never becomes leniency; test_adversarial.py holds the games.
"""

from __future__ import annotations

import pytest

from tests.rewards.tables import HONEST, NEAR_MISSES, STYLES
from trainer import rewards

math_reward = rewards.get("math")


def _cases(rows):
    return [
        pytest.param(gt, make(answer), id=f"{kind}:{answer}:{style}")
        for kind, gt, answer in rows
        for style, make in STYLES.items()
    ]


@pytest.mark.parametrize(("gt", "response"), _cases(HONEST))
def test_should_score_one_when_an_honest_answer_is_written_in_any_style(gt, response):
    score = math_reward(gt, response)
    assert score == (1.0, True), (response, score)


@pytest.mark.parametrize(("gt", "response"), _cases(NEAR_MISSES))
def test_should_score_zero_when_a_near_miss_is_dressed_as_an_honest_answer(gt, response):
    score = math_reward(gt, response)
    assert score == (0.0, False), (response, score)


def test_should_cover_every_kind_of_answer_in_at_least_three_styles():
    kinds = {
        "numbers",
        "fractions and decimals",
        "sets",
        "tuples",
        "intervals and inequalities",
        "equations",
        "matrices",
        "units and percentages",
        "LaTeX styles",
    }
    assert {kind for kind, _, _ in HONEST} == kinds and {kind for kind, _, _ in NEAR_MISSES} == kinds
    assert {"boxed", "the final answer is", "Minerva"} <= set(STYLES)
