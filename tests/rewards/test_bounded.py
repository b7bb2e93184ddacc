"""Every built-in reward returns, and soon, whatever the response holds (CONTRIBUTING.md: Rewards are an attack surface; issue 47).

The three defects reasoning-gym's data found first (a fraction answer that looped forever, hexadecimal
read as 0, Python's ``**`` read as a second value), then answers built to be expensive (huge exponents,
towers, factorials, deep nesting, floods of digits, boxes, wrappers and markers), then every built-in
non-code reward over a corpus: the adversarial and fairness tables, the answers above and reasoning-gym's
numeric tasks. Each call runs in a child process (:func:`tests.rewards.rg_corpus.timed_calls`); a call
that has not returned within 20 s is killed and fails the test, and each call's CPU time must stay
within :data:`LIMIT_S` (CPU, not wall time: a busy machine slows every call alike).
"""

from __future__ import annotations

import pytest

from tests.rewards import rg_corpus, tables
from trainer import rewards

math_reward = rewards.get("math")
gsm8k_reward = rewards.get("gsm8k")

LIMIT_S = 1.0
INTEGRAL = "-x**9 + 7*x**7 + C"  # simple_integration's own answer format (sympy's str)


# -- the three defects -------------------------------------------------------------------------------


@pytest.mark.integration  # scores in processes of its own
def test_should_score_zero_promptly_when_a_fraction_answers_another_fraction():
    # looped forever: (10**places) % 7 never reaches 0
    calls = [
        ("math", "1/3", "The answer is 2/7.", None),
        ("math", "\\frac{5}{6}", "\\boxed{\\frac{1}{7}}", None),
        ("gsm8k", "35/99", "The final answer is 593/1368.", None),
    ]
    results = rg_corpus.timed_calls(calls)
    assert len(results) == len(calls), results
    for got in results:
        assert got.cpu_s is not None and got.cpu_s <= LIMIT_S and got.value == 0.0, (calls[got.index], got)


@pytest.mark.parametrize(
    ("gt", "response", "value"),
    [
        ("0x1f", "The final answer is 0x2a.", 0.0),  # math-verify reads both as 0
        ("0x1f", "The final answer is 0x0.", 0.0),
        ("0x1f", "The final answer is 0.", 0.0),
        ("0x1f", "The final answer is 0x1f.", 1.0),
        ("0x1f", "\\boxed{0X1F}", 1.0),
        ("0x1f", "\\boxed{31}", 1.0),
        ("31", "\\boxed{0x1f}", 1.0),
        ("-0x3a", "Final Answer: The final answer is $-0x3a$. I hope it is correct.", 1.0),
        ("-0x3a", "\\boxed{0x3a}", 0.0),
        ("0b101", "\\boxed{0b101}", 1.0),
        ("0b101", "\\boxed{0b100}", 0.0),
        ("0o17", "\\boxed{15}", 1.0),
    ],
)
def test_should_compare_base_prefixed_integers_as_the_integers_they_are(gt, response, value):
    assert math_reward(gt, response).value == value
    assert gsm8k_reward(gt, response).value == value


@pytest.mark.parametrize(
    "response",
    [
        f"The final answer is {INTEGRAL}.",
        f"Final Answer: The final answer is ${INTEGRAL}$. I hope it is correct.",
        f"So the integral is $\\boxed{{{INTEGRAL}}}$.",
        "The final answer is $-x^{9} + 7x^{7} + C$.",
        "The final answer is 7*x**7 - x**9 + C.",
    ],
)
def test_should_pay_an_answer_with_python_exponents(response):
    assert math_reward(INTEGRAL, response) == (1.0, True), math_reward(INTEGRAL, response)


@pytest.mark.parametrize(
    "response",
    [
        "The final answer is -x**9 + 7*x**6 + C.",
        "The final answer is -x**9 + 7*x**7 + C. Or x**8.",
        "\\boxed{-x**9}",
    ],
)
def test_should_score_zero_when_python_exponents_give_another_value(response):
    assert math_reward(INTEGRAL, response) == (0.0, False)


# -- answers built to be expensive ---------------------------------------------------------------------

# (ground truth, response, why it might not return): each must score 0 within the limit
BOMBS = [
    ("x+1", "\\boxed{10^{10^{10}}}", "a tower of powers: 10^10 digits"),
    ("x+1", "\\boxed{10**10**10}", "Python's right-associative tower"),
    ("x+1", "\\boxed{2^{2^{2^{2^{2^{2}}}}}}", "a taller tower"),
    ("x+1", "\\boxed{x^{10^{10}}}", "a tower in a symbolic power"),
    ("x+1", "\\boxed{\\left(10^{9999}\\right)^{9999}}", "a power of a power: the exponents multiply"),
    ("x+1", "\\boxed{9^{999999}}", "an exponent of a million"),
    ("x+1", "\\boxed{(x+1)^{100000}}", "a symbolic power to expand"),
    ("x+1", "\\boxed{(a+b+c+d+e+f+g+h)^{12}}", "a multinomial to expand (the CPU timer stops it)"),
    ("5", "\\boxed{1e999999}", "a float with a six-digit exponent"),
    ("x+1", "\\boxed{1e999999}", "a float with a six-digit exponent, to sympy"),
    ("x+1", "\\boxed{(100000)!}", "a factorial of a large number"),
    ("x+1", "\\boxed{\\binom{1000000}{500000}}", "a binomial of large numbers"),
    ("x+1", "\\boxed{\\prod_{k=1}^{1000000} k}", "a product over a million terms"),
    ("x+1", "\\boxed{" + "(" * 300 + "x" + ")" * 300 + "}", "deep parentheses"),
    ("x+1", "\\boxed{" + "{" * 300 + "x" + "}" * 300 + "}", "deep braces"),
    ("x+1", "\\boxed{" + "\\frac{1}{" * 60 + "x" + "}" * 60 + "}", "a deep continued fraction"),
    ("x+1", "\\boxed{" + "\\sqrt{" * 100 + "2" + "}" * 100 + "}", "deep roots"),
    ("20", "#### " + "9" * 100_000, "a number of 100,000 digits"),
    ("0x1f", "\\boxed{0x" + "f" * 90_000 + "}", "a hexadecimal number of 90,000 digits"),
    ("1/3", "The answer is " + "1" * 50 + "/" + "7" * 50 + ".", "a fraction of 50-digit numbers"),
    ("2/7", "The answer is 0." + "3" * 59 + ".", "a long decimal for another fraction"),
    ("20", "".join(f"\\boxed{{{i}}}" for i in range(9_000)), "9,000 boxes that disagree"),
    ("20", "\\boxed{21}" * 9_000, "9,000 boxes that agree, on a wrong answer"),
    ("20", "\\boxed{" * 14_000, "14,000 boxes that never close"),
    ("20", "The answer is " + "\\(" * 45_000, "a flood of math-mode openers"),
    ("20", "#### " + "\\(" * 45_000, "a flood of math-mode openers after ####"),
    ("20", "#### 21\n" * 9_000, "9,000 '####' lines"),
    ("20", "The answer is $" + "$ and $".join(["20"] * 12_000) + "$", "a list over 12,000 formulas"),
    ("20", "1 = " * 24_000 + "21", "24,000 '=' markers"),
    ("20", "The answer is 21. " * 5_000, "an answer restated 5,000 times"),
    ("20", "21 is 21 " * 10_000, "10,000 'is' markers"),
    ("20", "a" * 99_999, "one word of 99,999 letters"),
    ("20", " " * 99_999 + "20", "spaces, then the answer"),
    ("20", "1" + " " * 99_990 + "is 21", "a number, spaces, then 'is'"),
    ("x+1", "\\boxed{" + "x+" * 190 + "1}", "a sum of the answer's full length"),
    ("20", "<answer>" * 12_000, "12,000 answer tags that never close (exact_alnum, format)"),
    ("20", "<think>" * 12_000 + "</think><answer>" * 3_000, "think tags that never close, answer tags"),
    ("x+1", "\\boxed{" + "x\\cdot " * 60 + "1}", "a long product"),
]


@pytest.mark.parametrize(("gt", "response", "why"), BOMBS, ids=tables.ids(BOMBS))
def test_should_score_zero_when_an_answer_is_built_to_be_expensive(gt, response, why):
    assert math_reward(gt, response) == (0.0, False)


# -- every built-in reward over the corpus, under the limit -------------------------------------------


def _builtin_non_code() -> list[str]:
    return [n for n in rewards.names() if n not in {"code_unit_tests", "cpp_contest"}]


def _table_calls(names: list[str]) -> list[tuple[str, object, str, str | None]]:
    rows: list[tuple[object, str, str | None]] = []
    for table in (tables.MATH_ATTACKS, tables.MATH_HONEST):
        rows += [(gt, response, question) for gt, response, question, _ in table]
    for table in (
        tables.GSM8K_ATTACKS,
        tables.GSM8K_HONEST,
        tables.ARITHMETIC_ATTACKS,
        tables.ARITHMETIC_HONEST,
        tables.EXACT_ATTACKS,
        BOMBS,
    ):
        rows += [(row[0], row[1], None) for row in table]
    rows += [("", row[0], None) for row in tables.FORMAT_ATTACKS]
    for _, gt, answer in tables.HONEST + tables.NEAR_MISSES:
        rows += [(gt, make(answer), None) for make in tables.STYLES.values()]
    return [(name, gt, response, question) for gt, response, question in rows for name in names]


def _corpus_calls(names: list[str]) -> list[tuple[str, object, str, str | None]]:
    pytest.importorskip("reasoning_gym")
    # one problem in three of each numeric task, three seeds of its own; the bench runs 36 a task
    cases, _ = rg_corpus.crosscheck_cases(rg_corpus.NUMERIC_TASKS, n=2, seed=1047)
    responses = list(dict.fromkeys((c.ground_truth, c.response) for c in cases))
    return [(name, gt, response, None) for gt, response in responses for name in names]


@pytest.mark.integration  # scores in processes of its own
def test_should_return_within_the_limit_for_every_builtin_reward_over_the_corpus():
    names = _builtin_non_code()
    calls = _table_calls(names) + _corpus_calls(names)
    got = rg_corpus.timed_calls(calls)
    assert len(got) == len(calls), f"{len(calls) - len(got)} calls never ran"
    slow = [
        (calls[g.index][0], str(calls[g.index][2])[:60], g.cpu_s, g.note)
        for g in got
        if g.cpu_s is None or g.cpu_s > LIMIT_S
    ]
    assert not slow, slow
