"""The ``math`` reward is fair: an honest answer scores 1 in every format real models and evaluation
harnesses write, for every kind of answer math-verify's own tests cover (STYLE.md section 14; issue 41).

A reward that refuses honest answers teaches the policy a format instead of the task, and skews every
evaluation figure against the peers'. Each row is one answer of one kind (numbers and their formatting,
fractions and decimals, sets, tuples, intervals and inequalities, equations, matrices, units and
percentages, LaTeX styles), written here by hand; each is tried in every response style below and must
score 1. Beside them, near misses of each kind (a wrong value in the same dress) must score 0, so that
fairness never becomes leniency; test_adversarial.py holds the games.
"""

from __future__ import annotations

import pytest

from trainer import rewards

math_reward = rewards.get("math")

# How the answer is given: the styles models and harnesses write.
STYLES = {
    "boxed": lambda a: f"Putting the pieces together, the answer is $\\boxed{{{a}}}$.",
    "boxed, display": lambda a: f"Therefore\n\\[\n\\boxed{{{a}}}\n\\]",
    "the final answer is": lambda a: f"So the final answer is ${a}$.",
    "the final answer is, no math mode": lambda a: f"The final answer is {a}",
    "Minerva": lambda a: f"Final Answer: The final answer is ${a}$. I hope it is correct.",
    "after reasoning": lambda a: f"<think>Let me work it out.</think>\nThe answer is $\\boxed{{{a}}}$",
}

# (kind, ground truth, an honest answer)
HONEST = [
    ("numbers", "42", "42"),
    ("numbers", "-7", "-7"),
    ("numbers", "1200", "1,200"),
    ("numbers", "1200", "1\\,200"),
    ("numbers", "1000000", "1{,}000{,}000"),
    ("numbers", "0.5", ".5"),
    ("numbers", "3", "3.0"),
    ("numbers", "-3", "- 3"),
    ("numbers", "42", "４２"),
    ("fractions and decimals", "\\frac{1}{2}", "0.5"),
    ("fractions and decimals", "0.75", "\\frac{3}{4}"),
    ("fractions and decimals", "\\frac{1}{3}", "\\dfrac{1}{3}"),
    ("fractions and decimals", "\\frac{1}{3}", "1/3"),
    ("fractions and decimals", "\\frac{1}{3}", "\\tfrac13"),
    ("fractions and decimals", "-\\frac{10}{9}", "-\\frac{10}{9}"),
    ("fractions and decimals", "\\frac{3}{2}", "1\\frac{1}{2}"),
    ("fractions and decimals", "\\frac{1}{12}", "0.0833333"),
    ("fractions and decimals", "\\frac{1}{3}", "\\frac{1}{3} \\approx 0.333"),
    ("fractions and decimals", "\\frac{9}{4}\\pi", "\\frac94\\pi"),
    ("sets", "\\{1, 2\\}", "\\{2, 1\\}"),
    ("sets", "-2, 1", "1, -2"),
    ("sets", "1 \\pm \\sqrt{19}", "1 \\pm \\sqrt{19}"),
    ("sets", "\\{1\\pm\\sqrt{5},-2\\}", "\\{-2, 1\\pm\\sqrt{5}\\}"),
    ("tuples", "(3, \\frac{\\pi}{2})", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("tuples", "(6,31,-1)", "(6, 31, -1)"),
    ("tuples", "(1,\\frac{9}{2})", "(1, 4.5)"),
    ("tuples", "(2, 2), (6, 2)", "(6, 2), (2, 2)"),
    ("intervals and inequalities", "[0,1)", "[0, 1)"),
    ("intervals and inequalities", "0<f(x)<1", "(0,1)"),
    ("intervals and inequalities", "0 \\le x < 1", "[0,1)"),
    ("intervals and inequalities", "x \\in [-2,7]", "-2 \\le x \\le 7"),
    ("intervals and inequalities", "x \\geq 5", "x \\ge 5"),
    ("intervals and inequalities", "x \\leq 5", "5 \\geq x"),
    ("intervals and inequalities", "(-\\infty, 3]", "x \\le 3"),
    ("intervals and inequalities", "[-1, -\\frac{1}{2}) \\cup (0, 1)", "[-1, -\\tfrac12) \\cup (0, 1)"),
    ("equations", "x-2y+z-1=0", "x-2y+z-1=0"),
    ("equations", "y = 2x+3", "y=3+2x"),
    ("equations", "2x+4y-3=0", "y=-\\frac{1}{2}x+\\frac{3}{4}"),
    ("equations", "\\frac{x^2}{4} + \\frac{y^2}{3} = 1", "x^2/4+y^2/3=1"),
    ("equations", "5", "x = 5"),
    ("equations", "11", "k=11"),
    (
        "matrices",
        "\\begin{pmatrix}1 & 0 \\\\ 0 & 1\\end{pmatrix}",
        "\\begin{pmatrix}1 & 0 \\\\ 0 & 1\\end{pmatrix}",
    ),
    (
        "matrices",
        "\\begin{pmatrix}1 & 2 \\\\ 3 & 4\\end{pmatrix}",
        "\\begin{bmatrix}1 & 2 \\\\ 3 & 4\\end{bmatrix}",
    ),
    ("matrices", "\\begin{pmatrix} 3 \\\\ -1 \\end{pmatrix}", "\\begin{pmatrix}3\\\\-1\\end{pmatrix}"),
    (
        "matrices",
        "\\begin{pmatrix}\\frac{1}{2} & 0 \\\\ 0 & 2\\end{pmatrix}",
        "\\begin{pmatrix}0.5 & 0 \\\\ 0 & 2\\end{pmatrix}",
    ),
    ("units and percentages", "15", "15\\mbox{ cm}^2"),
    ("units and percentages", "125", "125\\textnormal{ miles}"),
    ("units and percentages", "60", "60 \\text{ km/h}"),
    ("units and percentages", "5", "5 \\text{ square meters}"),
    ("units and percentages", "3", "3\\text{ hours}"),
    ("units and percentages", "72", "72 \\text{ clips}"),
    ("units and percentages", "28\\%", "28\\%"),
    ("units and percentages", "28", "28 \\%"),
    ("units and percentages", "30", "30^\\circ"),
    ("units and percentages", "90^\\circ", "90^{\\circ}"),
    ("units and percentages", "10", "\\$10"),
    ("units and percentages", "16386.20", "\\$16,\\!386.20"),
    ("LaTeX styles", "2", "\\text{2}"),
    ("LaTeX styles", "2", "\\mathbf{2}"),
    ("LaTeX styles", "\\frac{1}{3}", "\\cfrac{1}{3}"),
    ("LaTeX styles", "32349", "32,\\! 349"),
    ("LaTeX styles", "\\frac{1}{3}", "\\frac{1}{3} \\textbf{meters}"),
    ("LaTeX styles", "\\sqrt{3}", "\\sqrt3"),
    ("LaTeX styles", "\\sqrt{2}+\\sqrt{5}", "\\sqrt 2+\\sqrt 5"),
    ("LaTeX styles", "2", "f(3) = 2"),
    ("LaTeX styles", "\\frac{1}{3}", "\\left( \\frac{1}{3} \\right)"),
    ("LaTeX styles", "\\frac{14}{3}", "\\displaystyle\\frac{14}{3}"),
    ("LaTeX styles", "\\text{Evelyn}", "\\text{Evelyn}"),
    ("LaTeX styles", "204_5", "204_5"),
    ("LaTeX styles", "3\\sqrt{13}", "3\\sqrt{13}"),
    ("LaTeX styles", "2 \\sin b \\cos a", "2 \\cos a \\sin b"),
]

# (kind, ground truth, a near miss: the same dress, another value)
NEAR_MISSES = [
    ("numbers", "42", "41"),
    ("numbers", "1200", "1,2000"),
    ("numbers", "-3", "3"),
    ("fractions and decimals", "\\frac{1}{3}", "0.33"),
    ("fractions and decimals", "\\frac{1}{2}", "\\frac{2}{4}"),
    ("fractions and decimals", "\\frac{3}{2}", "1\\frac{1}{3}"),
    ("fractions and decimals", "\\frac{1}{3}", "\\frac{1}{3} \\approx 1.3"),
    ("sets", "\\{1, 2\\}", "\\{1, 3\\}"),
    ("sets", "1", "1, 2"),
    ("tuples", "(6,31,-1)", "(6, -1, 31)"),
    ("intervals and inequalities", "[0,1)", "[0, 1]"),
    ("intervals and inequalities", "x \\geq 5", "x \\le 5"),
    ("equations", "x-2y+z-1=0", "x-2y+z+1=0"),
    (
        "matrices",
        "\\begin{pmatrix}1 & 2 \\\\ 3 & 4\\end{pmatrix}",
        "\\begin{pmatrix}1 & 2 \\\\ 3 & 5\\end{pmatrix}",
    ),
    ("units and percentages", "28\\%", "27\\%"),
    ("units and percentages", "20", "20 \\text{ or more}"),
    ("units and percentages", "20", "20 \\text{ unless it is 21}"),
    ("LaTeX styles", "2", "\\text{3}"),
    ("LaTeX styles", "2", "f(2) = 3"),
]


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
