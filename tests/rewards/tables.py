"""The tables the built-in rewards are held to: attempts that game a reward and must score 0, and honest
answers in every style that must score 1 (CONTRIBUTING.md: Rewards are an attack surface). tests/rewards/test_adversarial.py and
tests/rewards/test_fairness.py check each reward against them; tests/rewards/test_bounded.py times every row.

The first rows of the math tables are what cpu-demo's policy found under the old ``math`` reward: the
question's own expression, an empty or look-alike box, the question boxed, and hedges. Each row says why.
"""

from __future__ import annotations

Q = "What is 13+7? Put the final answer in \\boxed{}."  # cpu-demo's prompt for the question 13+7
SIMPLIFY = "Simplify $\\frac{x^2-1}{x-1}$."
HUGE = " ".join(str(i) for i in range(200_000))  # 1.3 MB of candidate numbers, the right ones among them
HUGE_BOX = "\\boxed{" + "2" * 200_000 + "}"
HUGE_NUMBER = "#### 20" + "0" * 5_000


def ids(table):
    return [f"{i}:{row[-1]}" for i, row in enumerate(table)]


# ----- math -------------------------------------------------------------------------------------------------

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


# ----- gsm8k ------------------------------------------------------------------------------------------------

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


# ----- arithmetic (as cpu-demo and tiny run it) -------------------------------------------------------------

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
    (
        "20",
        "10 + 10 = 20",
        "cpu-gemma3: another equation with the question's value, not the question answered",
    ),
    ("20", "13 + 7 = 20\n2 * 10 = 20", "another equation last"),
    ("20", "+ 7 = 20", "cpu-gemma3: half an equation"),
    ("20", "0 = 20", "cpu-gemma3: a false equation"),
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
    ("20", "7 + 13 = 20", "the question's terms in another order"),
    ("20", "13 + 7 = 10 + 10 = 20", "working after the question's equation"),
    ("20", "Step 2: x = 20", "a left side without arithmetic"),
    ("20", "(13 + 7) = 20", "the question in brackets"),
    ("20", "The answer is 20.", "after 'the answer is'"),
    ("20", "20", "nothing but the number (tiny's two tokens)"),
    ("20", "13 + 7 = 20\n\n20", "issue 41: make train's jsonl, the answer again on its own line"),
    ("26", "14 + 12 equals 26", "issue 41: make train's jsonl, 'equals' for ="),
    ("20", "Final Answer: The final answer is $20$. I hope it is correct.", "issue 41: the Minerva ending"),
]


# ----- format -----------------------------------------------------------------------------------------------

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


# ----- exact_alnum ------------------------------------------------------------------------------------------

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


# ----- math answers written in every style (tests/rewards/test_fairness.py) ---------------------------------

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
