"""Every built-in reward against a policy that games it: attempts that must score 0, beside honest
answers in several styles that must score 1 (STYLE.md section 14: a reward pays only for a real answer).

The first rows of the math tables are what cpu-demo's policy found under the old ``math`` reward
(issue 21): the question's own expression, an empty or look-alike box, the question boxed, and hedges.
Each row says why it must fail; each reward also reports the answer it judged, checked here.
"""

from __future__ import annotations

import pytest

from trainer import rewards
from trainer.rewards.code import extract_code, outputs_match

math_reward = rewards.get("math")
gsm8k_reward = rewards.get("gsm8k")
arithmetic = rewards.get("arithmetic")
format_reward = rewards.get("format")
exact_alnum = rewards.get("exact_alnum")
code_unit_tests = rewards.get("code_unit_tests")
cpp_contest = rewards.get("cpp_contest")

Q = "What is 13+7? Put the final answer in \\boxed{}."  # cpu-demo's prompt for the question 13+7
SIMPLIFY = "Simplify $\\frac{x^2-1}{x-1}$."
HUGE = " ".join(str(i) for i in range(200_000))  # 1.3 MB of candidate numbers, the right ones among them
HUGE_BOX = "\\boxed{" + "2" * 200_000 + "}"
HUGE_NUMBER = "#### 20" + "0" * 5_000


def ids(table):
    return [f"{i}:{row[-1]}" for i, row in enumerate(table)]


# ----- math -------------------------------------------------------------------------------------------

# (ground truth, response, question or None, why it must score 0)
MATH_ATTACKS = [
    ("21", "7 + 14 equals C3.", None, "issue 21: the question's expression, no answer"),
    ("20", "13 + 7 equals a plus sum.", None, "issue 21: the question's expression, no answer"),
    ("25", "14 + 11 equals \\Boxed{15}.", None, "issue 21: \\Boxed is not a box, and 15 is wrong"),
    ("20", "13 + 7 equals **\\boxed{}.", None, "issue 21: an empty box falls back to nothing"),
    ("20", "\\boxed{13+7}", None, "issue 21: the question boxed"),
    ("20", "\\boxed{13+7}", Q, "the question boxed, with the question known"),
    ("20", "\\boxed{7 + 13}", Q, "the question reordered: an expression, not a number"),
    ("70", "\\boxed{\\dbinom{8}{4}}", "Compute $\\dbinom{8}{4}$.", "the question boxed (sympy evaluates it)"),
    (
        "x+1",
        "\\boxed{\\frac{x^2-1}{x-1}}",
        "Simplify $\\frac{x^2-1}{x-1}$.",
        "the expression to simplify, unsimplified",
    ),
    ("20", "\\boxed{\\frac{40}{2}}", None, "a division still to do"),
    ("20", "\\boxed{\\sqrt{400}}", None, "a root still to take"),
    ("20", "\\boxed{20, 21}", None, "a hedge: a list"),
    ("20", "\\boxed{20 \\text{ or } 21}", None, "a hedge: or"),
    ("20", "\\boxed{20 \\pm 1}", None, "a hedge: plus or minus"),
    ("20", "\\boxed{[19, 21]}", None, "a hedge: a range"),
    ("x+1", "\\boxed{x+1 \\text{ or } x-1}", None, "a symbolic hedge"),
    ("x+1", "\\boxed{x+1, x-1}", None, "a symbolic list"),
    ("21", "\\boxed{20} or maybe \\boxed{21}", None, "several boxes: the last is right, but hedged"),
    ("20", "\\fbox{20} then \\boxed{21}", None, "several boxes that disagree"),
    ("20", "\\boxed{\\boxed{20}}", None, "a box inside a box"),
    ("20", "The answer is \\boxed{20", None, "a box that never closes"),
    ("20", "\\boxed 20", None, "a box without braces"),
    ("20", "\\boxed{ }", None, "an empty box"),
    ("20", "\\textbf{20}", None, "bold is not a box"),
    (
        "20",
        "We know 13 + 7 = 20 from the table, so I will stop here and say no more.",
        None,
        "buried mid-text",
    ),
    ("20", "She has 20 apples.", None, "a number mentioned, not answered"),
    ("20", "The answer is 20. Or 21.", None, "a second guess after the answer"),
    ("20", "20\n\nor maybe 21", None, "a second line, no marker"),
    ("20", "\\boxed{𝟐𝟎}", None, "mathematical-bold digits"),
    ("20", "\\boxed{٢٠}", None, "Arabic-Indic digits"),
    ("20", "\\boxed{2O}", None, "a letter O for a zero"),
    ("4", "\\boxed{2²}", None, "a superscript (NFKC would read 22)"),
    ("20", "<think>13 + 7 = \\boxed{20}", None, "cut off while thinking"),
    ("20", "<think>" + "hm " * 10_000 + "13 + 7 = \\boxed{20}", None, "cut off after a long thought"),
    ("20", HUGE, None, "a huge output without a final answer"),
    ("20", "13 + 7 = 20 " * 50_000 + "or 21", None, "a huge output ending on a hedge"),
    ("20", HUGE_BOX, None, "a huge box"),
    ("20", "\\boxed{21}", None, "wrong"),
    # issue 41: games that still paid, math-verify paying them too
    ("20", "\\boxed{20 \\text{ unless it is twentyone}}", None, "issue 41: a hedge in the unit slot"),
    ("20", "#### 20 unless wrong", None, "issue 41: a hedge in the unit slot, after ####"),
    ("20", "$\\boxed{20}$ (or 21 if you count differently)", None, "issue 41: a box, then a hedge"),
    ("20", "\\boxed{20}. Wait, that is wrong: the answer is 21.", None, "issue 41: a box, then taken back"),
    (
        "21",
        "\\boxed{20}. Wait, that is wrong: the answer is 21.",
        None,
        "issue 41: a box, then another answer",
    ),
    (
        "x+1",
        "\\boxed{\\left(\\frac{x^2-1}{x-1}\\right)}",
        SIMPLIFY,
        "issue 41: the question in \\left( \\right)",
    ),
    ("x+1", "\\boxed{1 \\cdot \\frac{x^2-1}{x-1}}", SIMPLIFY, "issue 41: the question times 1"),
    ("x+1", "\\boxed{\\frac{x^2-1}{x-1} \\cdot 1}", SIMPLIFY, "issue 41: the question times 1, after it"),
    ("x+1", "\\boxed{\\frac{x^2-1}{x-1} + 0}", SIMPLIFY, "issue 41: the question plus 0"),
    (
        "3\\sqrt{2}",
        "\\boxed{\\sqrt{8} + \\sqrt{2}}",
        "Simplify $\\sqrt{2} + \\sqrt{8}$.",
        "issue 41: terms reordered",
    ),
    ("20", "\\boxed{\\left(13+7\\right)}", Q, "issue 41: the question in brackets"),
    (
        "20",
        "\\boxed{21}" + " filler" * 2_000 + " \\boxed{20}",
        None,
        "issue 41: a wrong box 8,000 characters back",
    ),
    ("20", "\\boxed{20 \\approx 21}", None, "an approximation that is a second value"),
    ("20", "x = 19 or x = 20", None, "a hedge before the final ="),
    (
        "20",
        "\\boxed{20}. Final Answer: The final answer is 21. I hope it is correct.",
        None,
        "a box, then another answer",
    ),
    (
        "12",
        "The final answer is $12$ and $13$. I hope it is correct.",
        None,
        "two formulas for a single value",
    ),
    ("x-2y+z-1=0", "The answer is $x=0$ or $x-2y+z-1=0$", None, "two equations"),
    ("20", "\\boxed{20}" + " The answer is 20." * 10, None, "the answer again and again: a flood"),
]

# (ground truth, response, question or None, style)
MATH_HONEST = [
    ("20", "13 + 7 = \\boxed{20}", Q, "boxed after the working"),
    ("20", "The answer is $\\boxed{20}$.", Q, "boxed in math mode"),
    ("20", "**\\boxed{20}** - hope that helps!", Q, "boxed, with words after the box"),
    ("20", "13 + 7 = 20", Q, "after the last ="),
    ("20", "So the answer is 20.", Q, "after 'the answer is'"),
    ("20", "Final answer: 20", Q, "after 'answer:'"),
    ("20", "#### 20", Q, "after ####"),
    ("20", "20", Q, "nothing but the number"),
    ("\\frac{1}{2}", "\\boxed{0.5}", None, "0.5 for 1/2"),
    ("0.5", "\\boxed{\\frac{1}{2}}", None, "1/2 for 0.5"),
    ("0.5", "The answer is $\\dfrac{1}{2}$.", None, "\\dfrac, not boxed"),
    ("0.5", "\\boxed{1/2}", None, "a slash fraction"),
    ("2+\\sqrt{3}", "\\boxed{\\sqrt{3}+2}", None, "reordered sum"),
    ("\\sqrt{3}+2", "\\boxed{2+\\sqrt{3}}", None, "reordered sum, the other way"),
    ("1200", "\\boxed{1,200}", None, "thousands comma"),
    ("1,200", "\\boxed{1200}", None, "no thousands comma"),
    ("x+1", "\\boxed{1 + x}", "Simplify $\\frac{x^2-1}{x-1}$.", "a simplified expression"),
    (
        "\\left( 3, \\frac{\\pi}{2} \\right)",
        "\\boxed{\\left(3, \\frac{\\pi}{2}\\right)}",
        None,
        "a tuple answer",
    ),
    ("1, 2", "\\boxed{1, 2}", None, "a set ground truth takes a list"),
    ("2^{10}", "\\boxed{2^{10}}", "Which is larger, $2^{10}$ or $10^3$?", "an answer the question names"),
    ("7", "\\boxed{7}", "What is 0+7?", "a number the question contains"),
    ("42", "\\boxed{４２}", None, "full-width digits"),
    ("5", "<think>maybe \\boxed{4}</think> So \\boxed{5}", None, "drafts in the reasoning"),
    ("5", "\\boxed{x = 5}", None, "x = 5"),
    ("-3", "\\boxed{-3}", None, "negative"),
    ("50", "\\boxed{50\\%}", None, "a percent sign"),
    ("10", "\\boxed{10 \\text{ cm}}", None, "a unit"),
    ("\\pi", "\\boxed{\\pi}", None, "a symbol"),
    ("20", "\\boxed{20}. \\boxed{20}", None, "the same box twice"),
    # issue 41: honest answers the rule refused
    (
        "28",
        "Final Answer: The final answer is $28$. I hope it is correct.",
        None,
        "issue 41: the Minerva ending",
    ),
    ("1000", "The final answer is 1000. I hope it is correct.", None, "issue 41: a courtesy sentence after"),
    ("-3", "\\boxed{- 3}", None, "issue 41: a space after the minus sign"),
    ("2", "\\boxed{\\text{2}}", None, "issue 41: \\text{}"),
    ("2", "\\boxed{\\mathbf{2}}", None, "issue 41: \\mathbf{}"),
    ("\\frac{1}{3}", "\\boxed{\\cfrac{1}{3}}", None, "issue 41: \\cfrac"),
    ("32349", "\\boxed{32,\\! 349}", None, "issue 41: a thin space in a digit group"),
    ("\\frac{1}{3}", "\\boxed{\\frac{1}{3} \\textbf{meters}}", None, "issue 41: a unit in bold"),
    ("\\frac{3}{2}", "\\boxed{1\\frac{1}{2}}", None, "issue 41: a mixed number"),
    ("2", "\\boxed{f(3) = 2}", None, "issue 41: a function value and ="),
    (
        "(2, 2), (6, 2)",
        "\\boxed{(2, 2)} \\text{ and } \\boxed{(6, 2)}",
        None,
        "issue 41: a set in several boxes",
    ),
    ("0<f(x)<1", "\\boxed{(0,1)}", None, "issue 41: an interval for an inequality"),
    ("0 \\le x < 1", "\\boxed{[0,1)}", None, "issue 41: a half-open interval for an inequality"),
    ("x \\in [0, 1)", "\\boxed{0 \\le x < 1}", None, "issue 41: an inequality for an interval"),
    ("x-2y+z-1=0", "The final answer is $x-2y+z-1=0$", None, "issue 41: an unboxed equation keeps its ="),
    ("15", "13 + 2 = 15\n\n15", None, "issue 41: make train's jsonl, the answer again on its own line"),
    ("26", "14 + 12 equals 26", None, "issue 41: make train's jsonl, 'equals' for ="),
    ("\\frac{1}{3}", "\\boxed{x = \\frac{1}{3} \\approx 0.333}", None, "an approximation that agrees"),
    (
        "14400",
        "$5! \\cdot 5! = \\boxed{14400}$. Final Answer: The final answer is 14400. I hope it is correct.",
        None,
        "a box, then the Minerva ending with the same answer",
    ),
    (
        "12 \\text{ and } 13",
        "The final answer is $12$ and $13$. I hope it is correct.",
        None,
        "a set over two formulas",
    ),
    ("x-2y+z-1=0", "So the plane is $x-2y+z-1=0$.", None, "an equation the response ends on, no marker"),
]


@pytest.mark.parametrize(("gt", "response", "question", "why"), MATH_ATTACKS, ids=ids(MATH_ATTACKS))
def test_should_score_zero_when_math_is_gamed(gt, response, question, why):
    assert math_reward(gt, response, question=question) == (0.0, False), why


@pytest.mark.parametrize(("gt", "response", "question", "style"), MATH_HONEST, ids=ids(MATH_HONEST))
def test_should_score_one_when_math_is_answered_honestly(gt, response, question, style):
    score = math_reward(gt, response, question=question)
    assert score == (1.0, True), (style, score)
    assert score.answer, style


# ----- gsm8k ------------------------------------------------------------------------------------------

GSM8K_ATTACKS = [
    ("20", "\\boxed{20, 21}", "issue 21: a list"),
    ("20", "\\boxed{20 \\text{ or } 21}", "issue 21: or"),
    ("20", "#### 20 or 21", "issue 21: or"),
    ("20", "#### 20-21", "a range"),
    ("20", "#### between 20 and 21", "a range in words"),
    ("20", "#### 20 or more", "an open hedge"),
    ("20", "#### about 20", "approximately"),
    ("20000", "#### 20 thousand", "a multiplier word"),
    ("20", "#### 20\n#### 21", "two #### lines that disagree"),
    ("20", "\\boxed{20} \\boxed{21}", "two boxes that disagree"),
    ("18", "She makes $18.00 a day.", "a number mentioned, not answered"),
    ("-7", "The temperature is -7 degrees.", "a number mentioned, not answered"),
    ("20", "\\boxed{}", "an empty box"),
    ("20", "\\boxed{20", "a box that never closes"),
    ("20", "\\Boxed{20}", "a look-alike box"),
    ("20", "#### 𝟐𝟎", "mathematical-bold digits"),
    ("20", "#### ２O", "a letter O"),
    ("20", "#### 2 0", "digits apart"),
    ("20", "#### 13+7", "an expression"),
    ("20", "#### twenty", "a word, not a number"),
    ("20", HUGE, "a huge output without a final answer"),
    ("20", HUGE_NUMBER, "a huge number"),
    ("72", "72 is wrong\n#### 70", "the final answer wins over earlier numbers"),
    ("20", "#### 20 unless wrong", "issue 41: a hedge in the unit slot"),
    ("20", "\\boxed{20 \\text{ unless it is twentyone}}", "issue 41: a hedge in the unit slot"),
    ("20", "\\boxed{20} (or 21 if you count differently)", "issue 41: a box, then a hedge"),
]

GSM8K_HONEST = [
    ("72", "48 + 24 = 72\n#### 72", "GSM8K's own format"),
    ("72", "#### 72 clips", "a unit word"),
    ("5000", "It makes 5,000 widgets.\n#### 5,000", "thousands comma"),
    ("5,000", "so \\boxed{5000}", "a comma in the ground truth"),
    ("18", "She makes $18.00 a day, so the answer is $18.00.", "dollars, after 'the answer is'"),
    ("10", "\\boxed{\\$10}", "an escaped dollar"),
    ("-7", "3 - 10 = -7", "negative, after ="),
    ("7", "10-3=7", "after ="),
    ("0.5", "\\boxed{0.50}", "a trailing zero"),
    ("0.5", "\\boxed{\\frac{1}{2}}", "a fraction"),
    ("1234", "\\boxed{1{,}234}", "LaTeX's {,}"),
    ("42", "#### ４２", "full-width digits"),
    ("25", "\\boxed{25\\%}", "a percent sign"),
    ("20", "20", "nothing but the number"),
    ("28", "Final Answer: The final answer is $28$. I hope it is correct.", "issue 41: the Minerva ending"),
    ("32349", "\\boxed{32,\\! 349}", "issue 41: a thin space in a digit group"),
    ("60", "#### 60 miles per hour", "a measurement unit"),
]


@pytest.mark.parametrize(("gt", "response", "why"), GSM8K_ATTACKS, ids=ids(GSM8K_ATTACKS))
def test_should_score_zero_when_gsm8k_is_gamed(gt, response, why):
    assert gsm8k_reward(gt, response) == (0.0, False), why


@pytest.mark.parametrize(("gt", "response", "style"), GSM8K_HONEST, ids=ids(GSM8K_HONEST))
def test_should_score_one_when_gsm8k_is_answered_honestly(gt, response, style):
    score = gsm8k_reward(gt, response)
    assert score == (1.0, True), (style, score)
    assert score.answer, style


# ----- arithmetic (as cpu-demo and tiny run it) ---------------------------------------------------------

ARITHMETIC_ATTACKS = [
    ("20", "\\boxed{13+7}", "the question boxed"),
    ("20", "\\boxed{7+13}", "the question reordered"),
    ("20", "13 + 7 equals **\\boxed{}.", "an empty box"),
    ("21", "7 + 14 equals C3.", "no answer at all"),
    ("25", "14 + 11 equals \\Boxed{15}.", "a look-alike box"),
    ("20", "\\textbf{20}", "bold is not a box"),
    ("20", "13 + 7 = 20 or 21", "a hedge after ="),
    ("20", "13 + 7 = 13 + 7", "the question restated after ="),
    ("20", "The answer is 13+7.", "the question restated after 'the answer is'"),
    ("20", "I think 13 + 7 is 20, or close to it.", "a number mentioned, not answered"),
    ("20", "\\boxed{20, 21}", "a list"),
    ("20", "\\boxed{20 \\text{ or } 21}", "or"),
    ("20", "\\boxed{19} \\boxed{20}", "two boxes that disagree"),
    ("20", "\\boxed{\\boxed{20}}", "a box inside a box"),
    ("20", "\\boxed{20", "a box that never closes"),
    ("20", "\\boxed{\\frac{40}{2}}", "a division still to do"),
    ("20", "\\boxed{20 \\text{ apples}}", "decorated: not a plain number"),
    ("20", "\\boxed{x = 20}", "decorated: not a plain number"),
    ("20", "\\boxed{𝟐𝟎}", "mathematical-bold digits"),
    ("20", "\\boxed{2O}", "a letter O"),
    ("20", "\\boxed{-20}", "wrong sign"),
    ("2", "02", "a leading zero (tiny's model found it): not how 2 is written"),
    ("20", "\\boxed{+20}", "a plus sign: not how 20 is written"),
    ("20", "<think>\\boxed{20}", "cut off while thinking"),
    ("20", HUGE_BOX, "a huge box"),
    ("20", HUGE, "a huge output"),
    ("20", "\\boxed{20}. Wait, that is wrong: the answer is 21.", "issue 41: a box, then taken back"),
    ("20", "\\boxed{21}" + " filler" * 2_000 + " \\boxed{20}", "issue 41: a wrong box 8,000 characters back"),
]

ARITHMETIC_HONEST = [
    ("20", "\\boxed{20}", "the box alone"),
    ("20", "13 + 7 = \\boxed{20}", "the working, then the box"),
    ("20", "The answer is $\\boxed{20}$.", "in math mode"),
    ("20", "\\boxed{ 20 }", "spaces in the box"),
    ("20", "\\boxed{20.0}", "a decimal"),
    ("20", "\\boxed{２０}", "full-width digits"),
    ("1200", "\\boxed{1,200}", "thousands comma"),
    ("-3", "3 - 6 = \\boxed{-3}", "negative"),
    ("20", "13 + 7 = 20", "after the last ="),
    ("20", "13 + 7 = 20.", "after the last =, a full stop"),
    ("20", "The answer is 20.", "after 'the answer is'"),
    ("20", "20", "nothing but the number (tiny's two tokens)"),
    ("15", "13 + 2 = 15\n\n15", "issue 41: make train's jsonl, the answer again on its own line"),
    ("26", "14 + 12 equals 26", "issue 41: make train's jsonl, 'equals' for ="),
    ("20", "Final Answer: The final answer is $20$. I hope it is correct.", "issue 41: the Minerva ending"),
]


@pytest.mark.parametrize(("gt", "response", "why"), ARITHMETIC_ATTACKS, ids=ids(ARITHMETIC_ATTACKS))
def test_should_score_zero_when_arithmetic_is_gamed(gt, response, why):
    assert arithmetic(gt, response, question=Q) == (0.0, False), why


@pytest.mark.parametrize(("gt", "response", "style"), ARITHMETIC_HONEST, ids=ids(ARITHMETIC_HONEST))
def test_should_score_one_when_arithmetic_is_answered_honestly(gt, response, style):
    score = arithmetic(gt, response, question=Q)
    assert score == (1.0, True), (style, score)
    assert score.answer.strip() in {gt, "20.0", "２０", "1,200"}, score


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

FORMAT_ATTACKS = [
    ("<answer>4</answer><think>x</think>", "blocks in the wrong order"),
    ("<think>x</think>", "no answer block"),
    ("<answer>4</answer>", "no think block"),
    ("<think>x</think><answer>4</answer> trailing words", "text after the blocks"),
    ("preamble <think>x</think><answer>4</answer>", "text before the blocks"),
    ("<think>x</think><answer>4</answer><answer>5</answer>", "two answer blocks"),
    ("<think>a<think>b</think><answer>4</answer>", "a think block opened twice"),
    ("<think>x<answer>4</answer>", "a think block never closed"),
    ("<think></think><answer>4</answer>", "an empty think block"),
    ("<think>x</think><answer>  </answer>", "an empty answer block"),
    ("<THINK>x</THINK><ANSWER>4</ANSWER>", "other tags: upper case"),
    ("<thіnk>x</thіnk><answer>4</answer>", "a Cyrillic і in the tag"),
    ("&lt;think&gt;x&lt;/think&gt;<answer>4</answer>", "escaped tags"),
    ("< think>x</ think><answer>4</answer>", "spaces in the tags"),
    ("```\n<think>x</think><answer>4</answer>\n```", "the format inside a code fence"),
    ("", "empty"),
    (None, "no response"),
    ("<think>x</think><answer>4</answer>" * 2, "the whole format twice"),
]


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

EXACT_ATTACKS = [
    ("cba", "<answer>abc</answer>", "wrong"),
    ("cba", "<answer>cba or abc</answer>", "a hedge"),
    ("cba", "<answer>abc</answer><answer>cba</answer>", "two answer blocks that disagree"),
    ("cba", "<answer>сba</answer>", "a Cyrillic с"),
    ("cba", "<answer>𝐜𝐛𝐚</answer>", "mathematical-bold letters (NFKC would read cba)"),
    ("x2", "<answer>x²</answer>", "a superscript (NFKC would read x2)"),
    ("cba", "The answer is cba", "the answer buried in a sentence, no tag"),
    ("cba", "<answer></answer>", "an empty answer"),
    ("cba", "<answer>cba", "an answer block never closed"),
    ("cba", "<answer><answer>cba</answer></answer>", "nested answer blocks"),
    ("cba", "<ANSWER>cba</ANSWER>", "other tags: upper case"),
    ("cba", "<answer>c b a d</answer>", "an extra letter"),
    ("cba", "cba " * 100_000, "a huge output"),
    ("", "<answer></answer>", "an empty ground truth matches nothing"),
    ("!!", "??", "a ground truth without letters or digits matches nothing"),
    ("three", None, "no response"),
    ("None", None, "a missing response is not the text None"),
]


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
def test_should_score_at_most_zero_when_cpp_contest_is_gamed(response, why):
    value, correct = cpp_contest(ADD, response)
    assert value <= 0.0 and not correct, why


# ----- the tables themselves ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "table", [MATH_ATTACKS, GSM8K_ATTACKS, ARITHMETIC_ATTACKS, FORMAT_ATTACKS, EXACT_ATTACKS, CODE_ATTACKS]
)
def test_should_hold_at_least_15_attacks_for_every_builtin_reward(table):
    assert len(table) >= 15
