"""Every built-in reward against a policy that games it: attempts that must score 0, beside honest
answers in several styles that must score 1 (CONTRIBUTING.md: Rewards are an attack surface; a reward pays only for a real answer).

The tables are in tables.py (test_bounded.py times every row of them); the first rows of the math tables
are what cpu-demo's policy found under the old ``math`` reward (issue 21): the question's own expression,
an empty or look-alike box, the question boxed, and hedges. Each row says why it must fail; each reward
also reports the answer it judged, checked here.
"""

from __future__ import annotations

import pytest

from tests.rewards.tables import (
    ARITHMETIC_ATTACKS,
    ARITHMETIC_HONEST,
    EXACT_ATTACKS,
    FORMAT_ATTACKS,
    GSM8K_ATTACKS,
    GSM8K_HONEST,
    MATH_ATTACKS,
    MATH_HONEST,
    Q,
    ids,
)
from trainer import rewards
from trainer.rewards.code import extract_code, outputs_match

math_reward = rewards.get("math")
gsm8k_reward = rewards.get("gsm8k")
arithmetic = rewards.get("arithmetic")
format_reward = rewards.get("format")
exact_alnum = rewards.get("exact_alnum")
code_unit_tests = rewards.get("code_unit_tests")
cpp_contest = rewards.get("cpp_contest")


# ----- math -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("gt", "response", "question", "why"), MATH_ATTACKS, ids=ids(MATH_ATTACKS))
def test_should_score_zero_when_math_is_gamed(gt, response, question, why):
    assert math_reward(gt, response, question=question) == (0.0, False), why


@pytest.mark.parametrize(("gt", "response", "question", "style"), MATH_HONEST, ids=ids(MATH_HONEST))
def test_should_score_one_when_math_is_answered_honestly(gt, response, question, style):
    score = math_reward(gt, response, question=question)
    assert score == (1.0, True), (style, score)
    assert score.answer, style


# ----- gsm8k ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("gt", "response", "why"), GSM8K_ATTACKS, ids=ids(GSM8K_ATTACKS))
def test_should_score_zero_when_gsm8k_is_gamed(gt, response, why):
    assert gsm8k_reward(gt, response) == (0.0, False), why


@pytest.mark.parametrize(("gt", "response", "style"), GSM8K_HONEST, ids=ids(GSM8K_HONEST))
def test_should_score_one_when_gsm8k_is_answered_honestly(gt, response, style):
    score = gsm8k_reward(gt, response)
    assert score == (1.0, True), (style, score)
    assert score.answer, style


# ----- arithmetic (as cpu-demo and tiny run it) ---------------------------------------------------------


@pytest.mark.parametrize(("gt", "response", "why"), ARITHMETIC_ATTACKS, ids=ids(ARITHMETIC_ATTACKS))
def test_should_score_zero_when_arithmetic_is_gamed(gt, response, why):
    assert arithmetic(gt, response, question=Q) == (0.0, False), why


@pytest.mark.parametrize(("gt", "response", "style"), ARITHMETIC_HONEST, ids=ids(ARITHMETIC_HONEST))
def test_should_score_one_when_arithmetic_is_answered_honestly(gt, response, style):
    score = arithmetic(gt, response, question=Q)
    assert score == (1.0, True), (style, score)
    assert score.answer.strip() in {gt, "20.0", "２０", "1,200"}, score


@pytest.mark.parametrize(
    "question",
    [
        "5 + 1 = 6\n2 + 6 = 8\n13 + 7 =",  # worked sums, then the question
        "13 + 7 = ?\n5 + 1 = 6\n2 + 6 = 8",  # the question, then worked sums (cpu-gemma3's prompt)
        "Worked: 5 + 1 = 6. What is 13 + 7? Another worked one: 2+6=8.",
    ],
    ids=["examples-first", "question-first", "examples-around"],
)
def test_should_take_the_sum_a_prompt_leaves_open_as_its_question_not_a_worked_example(question):
    # Failed before: the prompt's last expression was taken as the question, so with worked sums after it
    # ``13 + 7 = 20`` was "not the question's '2 + 6'" and scored 0 (and ``2 + 6 = 20``'s left side passed).
    assert arithmetic("20", "13 + 7 = 20", question=question) == (1.0, True)
    assert arithmetic("20", "7+13 = 20", question=question) == (1.0, True)
    for other in ("2 + 6 = 20", "5 + 1 = 20", "10 + 10 = 20"):
        assert arithmetic("20", other, question=question) == (0.0, False), other


@pytest.mark.parametrize(
    ("response", "unboxed_score", "expected"),
    [
        ("13 + 7 = 20", 0.0, (0.0, False)),  # only a boxed answer counts
        ("13 + 7 = 20", 0.5, (0.5, False)),  # half credit is not correct
        ("13 + 7 = \\boxed{20}", 0.0, (1.0, True)),
        ("13 + 7 = 21", 0.5, (0.0, False)),  # a wrong number earns nothing, boxed or not
        ("13+7", 0.5, (0.0, False)),
    ],
)
def test_should_pay_unboxed_score_when_a_right_answer_is_outside_the_box(response, unboxed_score, expected):
    score = arithmetic("20", response, unboxed_score=unboxed_score, question=Q)
    assert score == expected, score


# ----- format -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("response", "why"), FORMAT_ATTACKS, ids=ids(FORMAT_ATTACKS))
def test_should_score_zero_when_format_is_gamed(response, why):
    assert format_reward(None, response) == (0.0, False), why


@pytest.mark.parametrize(
    "response",
    [
        "<think>2+2 is 4</think><answer>4</answer>",
        "  <think>\nmulti\nline\n</think>\n\n<answer> 4 </answer>\n",
        "<think>" + "x" * 1_000_000 + "</think><answer>4</answer>",
    ],
)
def test_should_score_one_and_report_the_answer_when_the_format_is_right(response):
    score = format_reward(None, response)
    assert score == (1.0, True) and score.answer == "4"


# ----- exact_alnum ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("gt", "response", "why"), EXACT_ATTACKS, ids=ids(EXACT_ATTACKS))
def test_should_score_zero_when_exact_alnum_is_gamed(gt, response, why):
    assert exact_alnum(gt, response) == (0.0, False), why


@pytest.mark.parametrize(
    ("gt", "response"),
    [
        ("cba", "<think>reverse</think><answer>CBA</answer>"),
        ("New York", "new-york!"),
        ("cba", "<answer>ＣＢＡ</answer>"),  # full-width letters fold
        ("three", "<answer> Three. </answer>"),
        ("Café", "<answer>CAFÉ</answer>"),
        ("cba", "<answer>cba</answer> checked: <answer>CBA</answer>"),  # two blocks that agree
    ],
)
def test_should_score_one_when_exact_alnum_is_answered_honestly(gt, response):
    assert exact_alnum(gt, response) == (1.0, True)


# ----- code: extraction and output handling ------------------------------------------------------------

ADD = {"inputs": ["1 2\n", "3 4\n", "10 20\n"], "outputs": ["3\n", "7\n", "30\n"], "time_limit_s": 1.0}
PY_ADD = "a, b = map(int, input().split())\nprint(a + b)"


def fence(lang: str, code: str) -> str:
    return f"```{lang}\n{code}\n```"


def py(line: str) -> str:
    return fence("python", "a, b = map(int, input().split())\n" + line)


# Each program sees the input but never the expected output; each must score 0.
CODE_ATTACKS = [
    ("I don't know.", "no code"),
    ("The program is: print(a + b)", "code outside a fence"),
    (fence("cpp", "int main(){}"), "the wrong language only"),
    ("<think>" + fence("python", PY_ADD), "cut off while thinking"),
    (fence("python", "   "), "an empty fence"),
    ("```python\n" + PY_ADD, "a fence never closed"),
    (py("print(a + b)\nprint(a + b)"), "the answer twice"),
    (py("print(a + b, 'or', a + b + 1)"), "a hedge"),
    (py("print(a + b, a + b + 1)"), "two candidates"),
    (py("pass"), "prints nothing"),
    (py("print(a + b)\nraise SystemExit(1)"), "the answer, then a crash"),
    (py("import sys\nprint(a + b, file=sys.stderr)"), "the answer on stderr"),
    (py("print(str(a + b).translate({i: 0xFF10 + i - 48 for i in range(48, 58)}))"), "full-width digits"),
    (py("print(float(a + b))"), "a decimal where an integer is expected"),
    (py("print('nan')"), "not a number"),
    (py("print(a + b)\nwhile True: print(a + b)"), "a flood of output"),
    (py("import time\nprint(a + b, flush=True)\ntime.sleep(30)"), "the answer, then past the time limit"),
    (fence("python", "print(3)\nprint(7)\nprint(30)"), "every expected answer at once"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("response", "why"), CODE_ATTACKS, ids=ids(CODE_ATTACKS))
@pytest.mark.integration  # runs the program in the sandbox
def test_should_score_zero_when_code_unit_tests_is_gamed(response, why):
    assert code_unit_tests(ADD, response, output_limit_mb=1) == (0.0, False), why


@pytest.mark.parametrize(
    "response",
    [
        fence("python", PY_ADD),
        fence("py", PY_ADD),
        fence("", PY_ADD),
        "<think>hm</think>\nHere:\n" + fence("python3", PY_ADD) + "\nIt reads two numbers.",
        fence(
            "python", "import sys\na, b = map(int, sys.stdin.read().split())\nsys.stdout.write(f'{a+b}\\n')"
        ),
    ],
)
@pytest.mark.integration  # runs the program in the sandbox
def test_should_score_one_and_report_the_program_when_code_is_honest(response):
    score = code_unit_tests(ADD, response)
    assert score == (1.0, True), score
    assert score.answer in response and score.note == "3/3 tests passed"


@pytest.mark.parametrize(
    ("got", "expected"),
    [
        ("3 or 4", "3"),
        ("3\n3", "3"),
        ("３", "3"),
        ("3.0", "3"),
        ("nan", "3.0"),
        ("inf", "1e308"),
        ("", "3"),
        ("+3", "3"),
        ("0x3", "3"),
        ("3.00001", "3.0"),
        ("YES", "yes"),
        ("3,000", "3000"),
    ],
)
def test_should_not_match_when_an_output_only_resembles_the_expected_one(got, expected):
    assert not outputs_match(got, expected)


def test_should_find_no_code_when_the_fence_is_only_in_the_reasoning_or_never_closes():
    assert extract_code("<think>" + fence("python", PY_ADD) + "</think> no code", ("python",)) is None
    assert extract_code("```python\nprint(1)", ("python",)) is None


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("response", "why"),
    [
        (fence("python", PY_ADD), "the wrong language"),
        ("<think>" + fence("cpp", "int main(){}"), "cut off while thinking"),
        (
            fence(
                "cpp",
                '#include <cstdio>\nint main(){int a,b;scanf("%d %d",&a,&b);printf("%d or %d\\n",a+b,a+b+1);}',
            ),
            "a hedge",
        ),
        (
            fence(
                "cpp",
                '#include <cstdio>\nint main(){int a,b;scanf("%d %d",&a,&b);printf("%d\\n",a+b);return 1;}',
            ),
            "the answer, then a failing exit",
        ),
    ],
)
@pytest.mark.integration  # runs the program in the sandbox
def test_should_score_at_most_zero_when_cpp_contest_is_gamed(response, why):
    value, correct = cpp_contest(ADD, response)
    assert value <= 0.0 and not correct, why


# ----- the tables themselves ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "table", [MATH_ATTACKS, GSM8K_ATTACKS, ARITHMETIC_ATTACKS, FORMAT_ATTACKS, EXACT_ATTACKS, CODE_ATTACKS]
)
def test_should_hold_at_least_15_attacks_for_every_builtin_reward(table):
    assert len(table) >= 15
