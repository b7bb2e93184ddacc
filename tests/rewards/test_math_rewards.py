"""Math and format rewards on hand-written responses: right, wrong, malformed, unicode, empty, huge; the
final-answer rule they share; and the Score they report. test_adversarial.py holds the attack tables."""

from __future__ import annotations

import threading
import time

import pytest

from trainer import rewards
from trainer.rewards.answer import final_answer, parse_number, restates, several_values
from trainer.rewards.math_rewards import last_boxed
from trainer.rewards.registry import Score, as_score

math_reward = rewards.get("math")
gsm8k_reward = rewards.get("gsm8k")
format_reward = rewards.get("format")
exact_alnum = rewards.get("exact_alnum")

HUGE = "blah 7 " * 200_000  # 1.4 MB


def test_registered():
    assert {"math", "gsm8k", "arithmetic", "format", "exact_alnum"} <= set(rewards.names())


# -- helpers -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("\\boxed{42}", "42"),
        ("a \\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\left\\{ x^{2} \\right\\}}", "\\left\\{ x^{2} \\right\\}"),
        ("\\fbox{7}", "7"),
        ("\\boxed{\\frac{1}{2", None),  # cut off inside the box
        ("\\boxed{\\{1\\}", None),  # an escaped brace does not close the box
        ("\\boxed{1} \\Boxed{2} \\textbf{3}", "1"),  # look-alikes are not boxes
        ("\\boxed {7}", "7"),
        ("no box", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


# -- the final answer --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "answer", "source"),
    [
        ("13 + 7 = \\boxed{20}.", "20", "\\boxed{}"),
        ("$\\boxed{ \\frac{1}{2} }$", "\\frac{1}{2}", "\\boxed{}"),
        ("13 + 7 = 20.", "20", "after '='"),
        ("$13+7=20$", "20", "after '='"),
        ("x <= 5 so x = 5", "5", "after '='"),
        ("The final answer is **20**!", "20", "after 'answer is'"),
        ("Answer: 20", "20", "after 'Answer:'"),
        ("#### 72", "72", "after '####'"),
        ("#### 72\n#### 72", "72", "after '####'"),  # the same answer twice is no hedge
        ("<think>\\boxed{3}</think>20", "20", "the whole response"),
        ("20", "20", "the whole response"),
        ("", None, "empty response"),
        (None, None, "empty response"),
        ("<think>13 + 7 = \\boxed{20}", None, "cut off while thinking (no </think>)"),
        ("\\boxed{}", None, "empty \\boxed{}"),
        ("\\boxed{20", None, "a \\boxed{ that never closes"),
        ("\\boxed 20", None, "a \\boxed without braces"),
        ("\\boxed{\\boxed{20}}", None, "a box inside a box"),
        ("\\boxed{20} \\boxed{21}", None, "several boxes: '20' before '21'"),
        ("#### 20\n#### 21", None, "several '####' answers: '20', '21'"),
        ("13 + 7 =", None, "nothing after '='"),
        (
            "She has 20 apples, and that is all I can say about it.",
            None,
            "no \\boxed{} and no final answer ('####', 'the answer is', '=', 'is ...')",
        ),
    ],
)
def test_should_take_the_answer_from_one_place_only_when_reading_a_response(response, answer, source):
    final = final_answer(response)
    assert (final.answer, final.source) == (answer, source)


@pytest.mark.parametrize(
    ("response", "answer", "source"),
    [
        ("The final answer is $x-2y+z-1=0$", "x-2y+z-1=0", "after 'answer is'"),
        ("So the plane is $x-2y+z-1=0$. I hope it is correct.", "x-2y+z-1=0", "the formula it ends on"),
        ("so $y = 2x + 3$", "y = 2x + 3", "the formula it ends on"),
        ("y = 2x + 3", None, "no \\boxed{} and no final answer ('####', 'the answer is', 'is ...')"),
        ("So $y = 2x$. Or $y = 3x$.", None, "several candidate values: 'Or' before the formula it ends on"),
    ],
)
def test_should_keep_the_equals_sign_when_the_ground_truth_is_an_equation(response, answer, source):
    final = final_answer(response, equation=True)
    assert (final.answer, final.source) == (answer, source)


@pytest.mark.parametrize(
    ("response", "answer", "source"),
    [
        ("\\boxed{(2, 2)} \\text{ and } \\boxed{(6, 2)}", "(2, 2), (6, 2)", "2 \\boxed{} joined"),
        ("\\boxed{1} \\boxed{2} \\boxed{1}", "1, 2", "2 \\boxed{} joined"),
        (
            "So we find that the roots are $1$ and $2$.",
            None,
            "no \\boxed{} and no final answer ('####', 'the answer is', '=', 'is ...')",
        ),
        ("The answer is $1$, $2$ and $3$.", "1, 2, 3", "after 'answer is'"),
    ],
)
def test_should_join_several_boxes_or_formulas_into_one_list_when_the_ground_truth_is_a_set(
    response, answer, source
):
    final = final_answer(response, join_boxes=True)
    assert (final.answer, final.source) == (answer, source)
    assert final_answer(response).answer is None  # for a single-valued ground truth, a hedge


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("20", 20),
        ("-3", -3),
        ("(-3)", -3),
        ("1,200", 1200),
        ("1{,}200", 1200),
        ("0.50", 0.5),
        (".5", 0.5),
        ("\\frac{1}{2}", 0.5),
        ("\\dfrac12", 0.5),
        ("-\\frac{3}{4}", -0.75),
        ("3/4", 0.75),
        ("\\$18.00", 18),
        ("50\\%", 50),
        ("30^\\circ", 30),
        ("10 \\text{ cm}", 10),
        ("72 clips", 72),
        ("x = 5", 5),
        ("４２", 42),
        ("20,21", None),
        ("1,20", None),
        ("13+7", None),
        ("\\frac{2}{4}", None),
        ("\\frac{40}{2}", None),
        ("\\sqrt{4}", None),
        ("20 or 21", None),
        ("20 or more", None),
        ("20 thousand", None),
        ("about 20", None),
        ("4²", None),
        ("𝟐𝟎", None),
        ("٢٠", None),
        ("2O", None),
        ("2 0", None),
        ("1e5", None),
        ("twenty", None),
        ("9" * 61, None),
    ],
)
def test_should_read_a_single_number_only_when_the_answer_is_one(text, value):
    got = parse_number(text)
    assert (got if got is None else float(got)) == value


def test_should_read_a_plain_number_only_when_decorations_and_fractions_are_off():
    assert parse_number("20", fractions=False, decorations=False) == 20
    for text in ("1/2", "\\frac{1}{2}", "x = 20", "20 apples", "\\$20", "20\\%"):
        assert parse_number(text, fractions=False, decorations=False) is None, text


def test_should_see_several_values_when_an_answer_lists_or_hedges():
    for text in ("20, 21", "20 \\text{ or } 21", "20 or 21", "20 \\pm 1", "1; 2", "x \\lor y"):
        assert several_values(text), text
    for text in ("1,200", "x+1", "\\frac{1}{2}", "2+\\sqrt{3}"):
        assert not several_values(text), text


def test_should_see_a_restatement_when_the_answer_is_copied_from_the_question():
    q = "What is 13 + 7? Put the final answer in \\boxed{}."
    assert restates("13+7", q, "20") and restates("13 +7", q, "20")
    assert not restates("20", q, "20") and not restates("7", q, "20")  # a plain number never is
    assert restates("\\dbinom{8}{4}", "Compute $\\binom{8}{4}$.", "70")
    assert not restates(
        "2^{10}", "Which is larger, $2^{10}$ or $10^3$?", "2^{10}"
    )  # the ground truth's own form


# -- the Score a reward returns ------------------------------------------------------------------------


def test_should_unpack_and_compare_as_the_pair_when_a_reward_returns_a_score():
    import pickle

    score = Score(1, 1, "20", "\\boxed{}")
    value, correct = score
    assert (value, correct) == (1.0, True) and score == (1.0, True)
    assert (score.value, score.correct, score.answer, score.note) == (1.0, True, "20", "\\boxed{}")
    again = pickle.loads(pickle.dumps(score))  # Ray ships it between processes
    assert again == score and (again.answer, again.note) == ("20", "\\boxed{}")


@pytest.mark.parametrize(
    ("returned", "expected"),
    [
        (1, (1.0, True, None, "")),
        (0.5, (0.5, False, None, "")),  # a plain number is correct only at full marks
        (True, (1.0, True, None, "")),
        ((0.5, True), (0.5, True, None, "")),
        ((1.0, False, 42), (1.0, False, "42", "")),
        ([0.0, False, None, "why"], (0.0, False, None, "why")),
    ],
)
def test_should_take_a_number_or_a_tuple_when_a_user_reward_returns_one(returned, expected):
    s = as_score(returned)
    assert (s.value, s.correct, s.answer, s.note) == expected


def test_should_say_what_a_reward_returned_when_it_is_not_a_score():
    with pytest.raises(TypeError, match="a reward returned str"):
        as_score("1.0")


# -- math ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gt", "response"),
    [
        ("42", "The answer is \\boxed{42}."),
        ("42", "so the answer is 42"),
        ("\\frac{1}{2}", "Therefore $\\boxed{0.5}$"),
        ("\\frac{1}{2}", "\\boxed{\\dfrac{1}{2}}"),
        ("26000", "\\boxed{26,000}"),
        ("x+1", "\\boxed{1 + x}"),
        ("2\\sqrt{2}", "\\boxed{\\sqrt{8}}"),  # a symbolic ground truth: math-verify's equality
        ("\\left( 3, \\frac{\\pi}{2} \\right)", "\\boxed{\\left(3, \\frac{\\pi}{2}\\right)}"),
        ("$\\frac{3}{4}$", "\\boxed{\\frac{3}{4}}"),
        ("\\boxed{5}", "final: \\boxed{5}"),
        ("5", "7 is wrong; \\boxed{5}"),  # the box wins over other numbers
        ("3", "答案是 \\boxed{3}"),
        ("42", "\\boxed{４２}"),  # full-width digits
        (42, "\\boxed{42}"),  # a non-string ground truth
        (
            "\\(\\boxed{1}\\) and \\(\\boxed{-2}\\).",
            "\\boxed{-2, 1}",
        ),  # a ground truth's boxes joined by "and"
        ("$$\\boxed{2}, \\boxed{3}, \\boxed{5}$$", "\\boxed{\\{2, 3, 5\\}}"),
        ("1,22", "\\boxed{1.22}"),  # a dataset's decimal comma, outside math mode
        ("$-2,1$", "\\boxed{1, -2}"),  # in math mode, two roots
        (
            "The total is 5, so the answer is $28\\%$. I hope it is correct. Note: this is all.",
            "\\boxed{28\\%}",
        ),
    ],
)
def test_math_right(gt, response):
    score = math_reward(gt, response)
    assert score == (1.0, True), score


@pytest.mark.parametrize(
    ("gt", "response"),
    [
        ("42", "\\boxed{41}"),
        ("5", "\\boxed{6}, although 5 came up"),
        ("0.5", "\\boxed{\\frac{2}{4}}"),  # not in lowest terms: a division still to do
        ("2", "\\boxed{\\sqrt{4}}"),  # a number's root is not the number: evaluate it
        ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}"),
        ("42", ""),
        ("", "\\boxed{42}"),
        ("42", None),
        ("42", "\\boxed{"),
        ("42", "\\boxed{\\frac{1}{0}}"),
        ("42", "I do not know"),
        ("42", "}}}{{{\\\\$$$"),
        ("42", HUGE),
        (
            "\\boxed{1} no no no no no \\boxed{2}",
            "\\boxed{1, 2}",
        ),  # words between boxes: the last one is the answer
        ("1,22", "\\boxed{1,22}"),  # an answer's comma is never a decimal point
    ],
)
def test_math_wrong_or_malformed(gt, response):
    assert math_reward(gt, response) == (0.0, False)


def test_should_score_zero_with_a_note_when_a_response_is_over_the_length_cap():
    # the whole response is read (a window on its end would forget a hedge at its start), up to a cap
    start = time.perf_counter()
    score = math_reward("3", HUGE + " \\boxed{3}")
    assert score == (0.0, False) and score.note.startswith("a response of 1,400,010 characters"), score
    assert math_reward("3", "<think>" + HUGE + "</think> \\boxed{3}") == (
        1.0,
        True,
    )  # the reasoning is not read
    assert time.perf_counter() - start < 5


def test_math_works_off_the_main_thread():
    # math-verify's signal.alarm raises outside the main thread; the reward must turn it off there
    out = []
    t = threading.Thread(target=lambda: out.append(math_reward("2+\\sqrt{3}", "\\boxed{\\sqrt{3}+2}")))
    t.start()
    t.join(timeout=60)
    assert out == [(1.0, True)]


def test_math_times_out_in_the_main_thread():
    start = time.perf_counter()
    assert math_reward("x", "\\boxed{9^{9^{9^{9}}}}", timeout_seconds=1) == (0.0, False)
    assert time.perf_counter() - start < 10


@pytest.mark.parametrize(
    ("gt", "response", "question", "answer", "note"),
    [
        ("20", "13 + 7 = \\boxed{20}", None, "20", "\\boxed{}"),
        ("20", "13 + 7 = 21", None, "21", "after '=': 21, not 20"),
        (
            "20",
            "\\boxed{13+7}",
            "What is 13+7?",
            "13+7",
            "\\boxed{}: restates the question instead of answering it",
        ),
        ("20", "\\boxed{20, 21}", None, "20, 21", "\\boxed{}: several candidate values"),
        ("20", "13 + 7 equals **\\boxed{}.", None, None, "empty \\boxed{}"),
        ("x+1", "\\boxed{x-1}", None, "x-1", "\\boxed{}: not equal to x+1"),
        (
            "x+1",
            "\\boxed{x+1 \\text{ or } x-1}",
            None,
            "x+1 \\text{ or } x-1",
            "\\boxed{}: several candidate values",
        ),
    ],
)
def test_should_report_the_answer_it_judged_and_why_when_math_scores(gt, response, question, answer, note):
    score = math_reward(gt, response, question=question)
    assert (score.answer, score.note) == (answer, note)


# -- gsm8k -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gt", "response"),
    [
        ("72", "48 + 24 = 72\n#### 72"),
        ("72", "#### 72 clips"),
        ("5000", "It makes 5,000 widgets.\n#### 5,000"),
        ("5,000", "so \\boxed{5000}"),
        ("18", "She makes $18.00 a day.\n#### 18"),
        ("-7", "3 - 10 = -7"),
        ("7", "10-3=7"),
        ("0.5", "\\boxed{0.50}"),
        ("10", "\\boxed{\\$10}"),
        ("1234", "\\boxed{1{,}234}"),
        ("42", "#### ４２"),
    ],
)
def test_gsm8k_right(gt, response):
    assert gsm8k_reward(gt, response) == (1.0, True)


@pytest.mark.parametrize(
    ("gt", "response"),
    [
        ("72", "#### 71"),
        ("72", "72 is wrong\n#### 70"),  # the #### answer wins over earlier numbers
        ("18", "She makes $18.00 a day."),  # a number mentioned is not an answer
        ("42", "## ４２"),  # two hashes are not GSM8K's marker
        ("72", "\\boxed{70} 72"),  # so does the box
        ("72", "seventy-two"),
        ("72", ""),
        ("72", None),
        ("72", "####"),
        ("", "72"),
        ("not a number", "72"),
        ("72", HUGE),
    ],
)
def test_gsm8k_wrong_or_malformed(gt, response):
    assert gsm8k_reward(gt, response) == (0.0, False)


# -- format ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "score"),
    [
        ("<think>2+2 is 4</think><answer>4</answer>", 1.0),
        ("  <think>\nmulti\nline\n</think>\n\n<answer> 4 </answer>\n", 1.0),
        ("<think></think><answer></answer>", 0.0),  # empty blocks are no reasoning and no answer
        ("<answer>4</answer><think>x</think>", 0.0),
        ("<think>x</think>", 0.0),
        ("<answer>4</answer>", 0.0),
        ("<think>x</think><answer>4</answer> trailing words", 0.0),
        ("preamble <think>x</think><answer>4</answer>", 0.0),
        ("<think>x</think><answer>4</answer><answer>5</answer>", 0.0),
        ("<think>a<think>b</think><answer>4</answer>", 0.0),
        ("<think>x<answer>4</answer>", 0.0),
        ("", 0.0),
        (None, 0.0),
        ("<think>" + "x" * 1_000_000 + "</think><answer>4</answer>", 1.0),
    ],
)
def test_format(response, score):
    assert format_reward(None, response) == (score, score == 1.0)


def test_format_custom_tags():
    assert (
        format_reward(
            "", "<reasoning>r</reasoning><final>4</final>", think_tag="reasoning", answer_tag="final"
        )[0]
        == 1.0
    )
    assert format_reward("", "<think>r</think><answer>4</answer>", think_tag="reasoning")[0] == 0.0


# -- exact_alnum -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gt", "response", "score"),
    [
        ("cba", "<think>reverse</think><answer>CBA</answer>", 1.0),
        ("New York", "new-york!", 1.0),
        ("three", "<answer> Three. </answer>", 1.0),
        ("Café", "<answer>cafe</answer>", 0.0),
        ("Café", "<answer>CAFÉ</answer>", 1.0),
        ("42", "<answer>４２</answer>", 1.0),
        ("three", "<answer>two</answer> three", 0.0),  # the tag content is the answer when present
        ("three", "", 0.0),
        ("", "", 0.0),  # an empty ground truth matches nothing
        ("!!", "??", 0.0),
        ("three", None, 0.0),
        ("None", None, 0.0),  # a missing response is not the text "None"
    ],
)
def test_exact_alnum(gt, response, score):
    assert exact_alnum(gt, response) == (score, score == 1.0)


def test_exact_alnum_custom_tag():
    assert exact_alnum("x", "<final>X</final>", answer_tag="final") == (1.0, True)


# An interval answers its inequality and the other way round, however each is written (the fairness set's
# rule); each case in a process of its own, as the first answer a reward process checks.
INTERVALS = [
    ("x > 2", r"\boxed{(2, \infty)}"),
    ("2 < x", r"\boxed{(2, \infty)}"),
    (r"(2, \infty)", r"\boxed{2 < x}"),
    (r"x \in (2, \infty)", r"\boxed{x > 2}"),
    (r"\left(2, \infty\right)", r"\boxed{x > 2}"),
    (r"x \ge 3", r"\boxed{[3, \infty)}"),
    (r"[3,\infty)", r"\boxed{x \geq 3}"),
    ("-1 < x < 4", r"\boxed{(-1, 4)}"),
    ("(-1,4)", r"\boxed{-1<x<4}"),
    (r"-2 \leq x \leq 5", r"\boxed{[-2,5]}"),
    ("(1, 3]", r"\boxed{1 < x \le 3}"),
    ("t > 2", r"\boxed{(2, \infty)}"),
]


def _in_a_fresh_process(script: str, *args: str) -> str:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-1500:]
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.integration  # a Python interpreter of its own
def test_should_start_math_verifys_parser_outside_the_first_answers_time_limit():
    # A process's first parse builds math-verify's LaTeX parser (0.35-0.7 s of CPU on a 2-core EPYC): charged to
    # the first answer's 0.5 s, it scored an honest interval 0. Every limit must find the parser started.
    script = (
        "import contextlib\n"
        "from trainer.rewards import math_rewards as m\n"
        "seen, inner = [], m._time_limit\n"
        "@contextlib.contextmanager\n"
        "def spy(seconds):\n"
        "    seen.append(m._warmed)\n"
        "    with inner(seconds):\n"
        "        yield\n"
        "m._time_limit = spy\n"
        "print(m.math_reward('2 < x', r'\\boxed{(2, \\infty)}')[0], seen)\n"
    )
    assert _in_a_fresh_process(script) == "1.0 [True]"


@pytest.mark.integration  # a Python interpreter of its own
def test_should_pay_an_interval_for_its_inequality_and_back_when_it_is_among_the_first_answers_checked():
    import json

    script = (
        "import json, sys\n"
        "from trainer.rewards.math_rewards import math_reward\n"
        "print(json.dumps([math_reward(gt, r)[0] for gt, r in json.loads(sys.argv[1])]))\n"
    )
    paid = json.loads(_in_a_fresh_process(script, json.dumps(INTERVALS)))
    assert paid == [1.0] * len(INTERVALS), [case for case, p in zip(INTERVALS, paid) if p != 1.0]


# A union of intervals answers the same set written as inequalities joined by "or", and the other way round;
# "and" is their intersection. Pairs after math-verify's own suite (its unions of open and half-open intervals,
# a point beside an interval, an excluded point) and the forms models write ("\text{ or }", "\lor", "\quad").
# Each table in a process of its own, as the first answers a reward process checks.
UNIONS = [
    (r"(-\infty, -2) \cup (3, \infty)", r"x < -2 \text{ or } x > 3", 1.0),
    (r"x < -2 \text{ or } x > 3", r"(-\infty, -2) \cup (3, \infty)", 1.0),
    (r"x < -2 \text{ or } x > 3", r"x > 3 \text{ or } x < -2", 1.0),
    (r"x < -2 \text{ or } x > 3", r"x \in (-\infty, -2) \cup (3, \infty)", 1.0),
    (r"x < -2 \text{ or } x > 3", r"x \in (-\infty, -2) \text{ or } x \in (3, \infty)", 1.0),
    (r"(-\infty, -2) \cup (3, \infty)", r"-2 > x \text{ or } x > 3", 1.0),
    (r"(-\infty, -2) \cup (3, \infty)", r"x < -2 \lor x > 3", 1.0),
    (r"(-\infty, -2) \cup (3, \infty)", r"x<-2 \quad\text{or}\quad x>3", 1.0),
    (r"(-\infty,-2] \cup [3,\infty)", r"x \le -2 \text{ or } x \ge 3", 1.0),
    (r"x \le -2 \text{ or } x \ge 3", r"\left(-\infty,-2\right] \cup \left[3,\infty\right)", 1.0),
    (r"(2, 12) \cup (12, 102)", r"2 < x < 12 \text{ or } 12 < x < 102", 1.0),
    (r"(2, 12) \cup (12, 102)", r"2 < x < 102 \text{ and } x \neq 12", 1.0),
    (r"\{-1\} \cup [0,7)", r"x = -1 \text{ or } 0 \le x < 7", 1.0),
    (
        r"[-1, -\frac{1}{2}) \cup (-\frac{1}{2}, 0) \cup (0, 1) \cup (1, \infty)",
        r"-1 \le x < -\tfrac12 \text{ or } -\tfrac12 < x < 0 \text{ or } 0 < x < 1 \text{ or } x > 1",
        1.0,
    ),
    (r"(-\infty, -\sqrt{2}) \cup (\sqrt{2}, \infty)", r"x < -\sqrt{2} \text{ or } x > \sqrt{2}", 1.0),
    ("(-2, 3)", r"x > -2 \text{ and } x < 3", 1.0),
    # not the set: another end, a closed end for an open one, a piece missing or added, everything
    (r"(-\infty, -2) \cup (3, \infty)", r"x < -2 \text{ or } x > 4", 0.0),
    (r"x < -2 \text{ or } x > 3", r"(-\infty, -2) \cup (4, \infty)", 0.0),
    (r"(-\infty, -2) \cup (3, \infty)", r"x \le -2 \text{ or } x > 3", 0.0),
    (r"x < -2 \text{ or } x > 3", r"(-\infty, -2] \cup (3, \infty)", 0.0),
    (r"(-\infty, -2) \cup (3, \infty)", r"x < -2", 0.0),
    (r"x < -2 \text{ or } x > 3", r"(-\infty, -2)", 0.0),
    (r"x < -2 \text{ or } x > 3", r"x<-2 \text{ or } x>3 \text{ or } x = 0", 0.0),
    (r"(-\infty, -\sqrt{2}) \cup (\sqrt{2}, \infty)", r"x < -1.414 \text{ or } x > 1.414", 0.0),
    (r"(2, 12) \cup (12, 102)", r"2 < x < 102", 0.0),
    # the games: the whole line, a hedge that covers it, "and" for "or", the complement, a bare list of
    # intervals, another variable, the question's inequality unsolved, the ends alone
    (r"x < -2 \text{ or } x > 3", r"x \in \mathbb{R}", 0.0),
    (r"x < -2 \text{ or } x > 3", r"(-\infty, \infty)", 0.0),
    (r"x < -2 \text{ or } x > 3", r"x<-2 \text{ or } x>3 \text{ or } x \in \mathbb{R}", 0.0),
    ("x > 3", r"x > 3 \text{ or } x < 3", 0.0),
    (r"x < -2 \text{ or } x > 3", r"x < -2 \text{ and } x > 3", 0.0),
    (r"x < -2 \text{ or } x > 3", r"x > -2 \text{ and } x < 3", 0.0),
    (r"x < -2 \text{ or } x > 3", r"-2 \le x \le 3", 0.0),
    (r"x < -2 \text{ or } x > 3", r"(-\infty, -2), (3, \infty)", 0.0),
    (r"x < -2 \text{ or } x > 3", r"x<-2 \text{ or } x>3 \text{ and } x<5", 0.0),
    (r"(-\infty, -2) \cup (3, \infty)", r"x<-2 \text{ or } y>3", 0.0),
    (r"x < -2 \text{ or } x > 3", r"t<-2 \text{ or } t>3", 0.0),
    (r"x < -2 \text{ or } x > 3", r"(x+2)(x-3) > 0", 0.0),
    (r"x < -2 \text{ or } x > 3", r"x = -2 \text{ or } x = 3", 0.0),
]


@pytest.mark.integration  # a Python interpreter of its own
def test_should_pay_a_union_of_intervals_for_its_or_of_inequalities_and_back_exactly_when_the_sets_agree():
    import json

    from tests.rewards.tables import STYLES

    # Every honest answer in every response style of the fairness tables; the others boxed and as the final
    # answer, the styles a policy would dress a game in. An unboxed answer is read after its last "="
    # (trainer.rewards.answer), so one that names a point (x = -1 or ...) is judged boxed only.
    def styles(answer: str, paid: float) -> list[str]:
        if "=" in answer:
            return ["boxed"]
        return list(STYLES) if paid else ["boxed", "the final answer is"]

    calls = [
        (gt, STYLES[style](answer), paid) for gt, answer, paid in UNIONS for style in styles(answer, paid)
    ]
    script = (
        "import json, sys\n"
        "from trainer.rewards.math_rewards import math_reward\n"
        "print(json.dumps([math_reward(gt, r)[0] for gt, r, _ in json.loads(sys.argv[1])]))\n"
    )
    got = json.loads(_in_a_fresh_process(script, json.dumps(calls)))
    wrong = [(gt, response, p) for (gt, response, want), p in zip(calls, got) if p != want]
    assert not wrong, wrong
