"""``math`` (and ``gsm8k``, ``arithmetic`` where they apply) against reasoning-gym's own scorers on its
numeric tasks: honest answers paid in all three response styles, wrong answers and near misses never
(CONTRIBUTING.md: Rewards are an attack surface; issue 47). A few problems of every task here, with seeds of the test's own; the
bench (``make bench-rewards``, ``bench/bench_reward_crosscheck.py``) runs 36 a task and prints the table.
"""

from __future__ import annotations

import pytest

from tests import tiers
from tests.rewards import rg_corpus

pytest.importorskip("reasoning_gym")

N, SEED = 3, 2047


@pytest.fixture(scope="module")
@tiers.starts("scores in processes of its own")
def crosscheck():
    cases, dropped = rg_corpus.crosscheck_cases(rg_corpus.NUMERIC_TASKS, N, SEED)
    results = rg_corpus.timed_calls([(c.reward, c.ground_truth, c.response, None) for c in cases])
    assert len(results) == len(cases), f"{len(cases) - len(results)} calls never ran"
    return cases, sorted(results, key=lambda r: r.index), dropped


def test_should_pay_honest_answers_and_never_wrong_ones_as_reasoning_gym_scores_them(crosscheck):
    cases, results, _ = crosscheck
    rows, failures = rg_corpus.table(cases, results, limit_s=1.0)
    assert not failures, failures[:20]
    # every honest answer, not just 99 % of them, on this small sample: a miss here is a defect to look at
    unpaid = [
        (c.task, c.reward, c.response)
        for c, r in zip(cases, results)
        if c.kind == "honest" and r.value != 1.0
    ]
    assert not unpaid, unpaid[:20]
    assert {row["task"] for row in rows} == set(rg_corpus.NUMERIC_TASKS)


def test_should_hold_wrong_answers_and_near_misses_for_every_task(crosscheck):
    cases, _, dropped = crosscheck
    for task in rg_corpus.NUMERIC_TASKS:
        kinds = {c.kind for c in cases if c.task == task}
        assert kinds == {"honest", "wrong", "near miss"}, (task, kinds, dropped[task])


def test_should_say_why_each_excluded_task_is_left_out():
    import reasoning_gym.factory

    assert not set(rg_corpus.EXCLUDED) & set(rg_corpus.NUMERIC_TASKS)
    assert set(rg_corpus.EXCLUDED) | set(rg_corpus.NUMERIC_TASKS) <= set(reasoning_gym.factory.DATASETS)
    assert all(len(why) > 20 for why in rg_corpus.EXCLUDED.values())
