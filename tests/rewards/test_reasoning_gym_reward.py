"""The ``reasoning_gym`` reward: each task's own scorer on the final answer, held to our adversarial table.

Honest answers in every style real models write must score 1 on tasks no one here wrote; hedges, the right
answer with more around it, another problem's answer and what the scorers pay in part must score 0 unless
``partial_credit`` asks for the scorer's own value; answers that would run code never reach a scorer that
evaluates them, and an answer built to explode (a tower of powers) ends at once.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

from trainer import data, rewards
from trainer.config import DataConfig

reward = rewards.get("reasoning_gym")

STYLES = [
    "Let me work it out.\n<answer>{a}</answer>",
    "<think>short</think><answer> {a} </answer>",
    "So the result is $\\boxed{{{a}}}$.",
    "The final answer is {a}.",
    "Final Answer: The final answer is ${a}$. I hope it is correct.",
]
# Tasks whose answers are numbers, words, lists and expressions; the scorers differ in what they forgive.
TASKS = {
    "chain_sum": {}, "basic_arithmetic": {}, "gcd": {}, "lcm": {}, "products": {}, "leg_counting": {},
    "count_bits": {}, "fraction_simplification": {}, "dice": {}, "bitwise_arithmetic": {}, "power_function": {},
    "prime_factorization": {}, "spell_backward": {}, "word_sorting": {}, "letter_counting": {},
    "base_conversion": {}, "caesar_cipher": {}, "time_intervals": {}, "calendar_arithmetic": {},
    "family_relationships": {}, "countdown": {}, "puzzle24": {}, "simple_equations": {}, "gsm_symbolic": {},
    "number_sorting": {}, "string_insertion": {}, "spiral_matrix": {}, "simple_integration": {},
    "polynomial_multiplication": {},
}  # fmt: skip


@pytest.fixture(scope="module")
def problems() -> dict[str, list[dict]]:
    out = {}
    for task in TASKS:
        cfg = DataConfig(name="reasoning_gym", options={"tasks": [task], "size": 8}, seed=3)
        out[task] = [ex["ground_truth"] for ex in data.get("reasoning_gym")(cfg, "train")]
    return out


def _timed(gt, response, *, bound_s: float | None = None, **kwargs):
    """The reward's score; with ``bound_s``, also that it ended within it (a loose bound: what it guards
    against never ends at all)."""
    start = time.monotonic()
    score = reward(gt, response, **kwargs)
    assert bound_s is None or time.monotonic() - start < bound_s, (gt["task"], response[:80])
    return score


@pytest.mark.parametrize("task", TASKS)
def test_should_pay_honest_answers_in_every_style_when_the_task_scorer_gives_full_marks(task, problems):
    for gt in problems[task]:
        for style in STYLES:
            if "**" in gt["answer"] and "final answer is" in style:
                continue  # a Python power after "the answer is": the final-answer rule's to read (answer.py)
            score = _timed(gt, style.format(a=gt["answer"]))
            assert score == (1.0, True), (style, gt["answer"], score)
            assert score.answer == gt["answer"].strip().strip("$") or score.answer == gt["answer"].strip()


@pytest.mark.parametrize("task", TASKS)
def test_should_pay_nothing_for_another_problems_answer_a_hedge_or_the_answer_with_more_around_it(
    task, problems
):
    gts = problems[task]
    for i, gt in enumerate(gts):
        a = gt["answer"]
        other = next((g["answer"] for g in gts[i + 1 :] + gts[:i] if g["answer"] != a), None)
        attacks = [f"<answer>{a} x</answer>", f"<answer>x {a}</answer>", f"<answer>{a}</answer> or maybe not"]
        if other is not None:
            attacks += [
                f"<answer>{other}</answer>",
                f"<answer>{a} or {other}</answer>",
                f"<answer>{a}, {other}</answer>",
                f"<answer>{a} {other}</answer>",
                f"<answer>{other}</answer> <answer>{a}</answer>",
                f"\\boxed{{{a}}} \\boxed{{{other}}}",
            ]
        for response in attacks:
            score = _timed(gt, response)
            assert score.value == 0.0 and not score.correct, (response, score)


# What the scorers pay that the strict reward does not: (task, answer the scorer is given, what it pays)
SCORERS_PAY = [
    ("chain_sum", "{a} or 5", "partial credit for containing the answer"),
    ("gsm_symbolic", "{a} 999999", "the first number anywhere"),
    ("gsm_symbolic", "x {a}", "the first number anywhere"),
    ("time_intervals", "{a}, 00:00:01", "the first duration of a list"),
    ("fraction_simplification", "{a}0", "the first fraction"),
    ("puzzle24", "4*6*1*1", "any expression worth 24"),
    ("spell_backward", "{a}s", "partial credit for containing the answer"),
]


@pytest.mark.parametrize(
    ("task", "template", "why"), SCORERS_PAY, ids=[f"{t}:{w}" for t, _, w in SCORERS_PAY]
)
def test_should_refuse_by_default_what_the_scorer_pays_and_pay_it_with_partial_credit(
    task, template, why, problems
):
    from trainer.rewards.reasoning_gym import scorer

    paid = 0
    for gt in problems[task]:
        answer = template.format(a=gt["answer"].strip("$"))
        if task == "puzzle24" and sorted(gt["metadata"]["numbers"]) == [1, 1, 4, 6]:
            continue
        raw = scorer(task)(answer, {"answer": gt["answer"], "metadata": gt["metadata"]})
        paid += raw > 0
        strict = _timed(gt, f"<answer>{answer}</answer>")
        assert strict == (0.0, False), (answer, strict)
        assert _timed(gt, f"<answer>{answer}</answer>", partial_credit=True).value == pytest.approx(raw)
    assert paid, f"the {task} scorer no longer pays {why}: the table row is stale"


def _adversarial_table():
    path = Path(__file__).with_name("test_adversarial.py")
    spec = importlib.util.spec_from_file_location("_adversarial_rows", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [row for row in module.MATH_ATTACKS if row[0].lstrip("-").isdigit()]


@pytest.mark.parametrize(
    "task", ["chain_sum", "basic_arithmetic", "gcd", "products", "gsm_symbolic", "leg_counting"]
)
def test_should_score_nothing_on_the_math_rewards_adversarial_table_with_each_numeric_scorer(task):
    for truth, response, _question, why in _adversarial_table():
        gt = {"task": task, "answer": truth, "metadata": {}}
        score = _timed(gt, response)
        assert score.value == 0.0, (why, response[:80], score)


@pytest.mark.parametrize(
    "answer",
    [
        "__import__('os').system('touch {marker}')",
        "open('{marker}', 'w')",
        "(lambda: open('{marker}', 'w'))()",
        "[c for c in open('{marker}', 'w')]",
        "x.__class__",
        "exec('1')",
    ],
)
@pytest.mark.parametrize(
    "task", ["simple_integration", "string_insertion", "spiral_matrix", "countdown", "n_queens"]
)
def test_should_never_hand_code_to_a_scorer_that_evaluates_its_answer(task, answer, tmp_path):
    marker = tmp_path / "ran"
    text = answer.format(marker=marker)
    cfg = DataConfig(name="reasoning_gym", options={"tasks": [task], "size": 1}, seed=3)
    gt = data.get("reasoning_gym")(cfg, "train")[0]["ground_truth"]
    score = _timed(gt, f"<answer>{text}</answer>")
    assert score.value == 0.0 and "not scored" in score.note, score
    assert not marker.exists()


@pytest.mark.parametrize(
    "answer",
    ["9**9**9**9", "(9**999)**999", "2**(10**10)", "2**99999999", "x**9**9 + C", "(" * 300 + "1" + ")" * 300],
)
def test_should_end_at_once_when_an_evaluated_answer_would_explode(answer, problems):
    for task in ("simple_integration", "countdown", "puzzle24"):
        gt = problems[task][0]
        assert _timed(gt, f"<answer>{answer}</answer>", bound_s=10.0).value == 0.0


def test_should_report_where_the_answer_came_from_and_why_it_scored_nothing(problems):
    gt = problems["chain_sum"][0]
    a = gt["answer"]
    assert reward(gt, f"<answer>{a}</answer>").note == "<answer>"
    assert reward(gt, f"\\boxed{{{a}}}").note == "\\boxed{}"
    score = reward(gt, f"<answer>{a} or 5</answer>")
    assert score.answer == f"{a} or 5" and "chain_sum scores" in score.note
    score = reward(gt, "<answer>1</answer><answer>2</answer>")
    assert score.answer is None and score.note == "several <answer> blocks that disagree"
    assert reward(gt, "<think>still going").note == "cut off while thinking (no </think>)"
    assert reward("7", "<answer>7</answer>").note.startswith(
        "the ground truth is not a reasoning_gym problem"
    )


def test_should_take_partial_credit_as_a_reward_kwarg_the_config_check_accepts():
    from trainer.config import RewardSpec

    rewards.check_specs([RewardSpec("reasoning_gym", 1.0, {"partial_credit": True, "timeout_seconds": 2})])
