"""The final answer of a response: one rule shared by the ``math``, ``gsm8k`` and ``arithmetic`` rewards.

GRPO pays for whatever a reward accepts, and a policy finds every answer a lenient extractor reads into
its text (issue 21: math-verify, given a whole response, found the question's own ``13 + 7`` in
``'13 + 7 equals C3.'`` and paid for it). So the answer is taken from one place only, and a response
that does not put an answer there has none; nothing falls back to the rest of the text.

Where the answer is (:func:`final_answer`):

1. **After the reasoning.** With ``</think>`` only the text after the last one counts; a response that
   opened ``<think>`` and never closed it was cut off while thinking and has no answer.
2. **In the box.** When the response has a ``\\boxed{...}`` (or ``\\fbox{...}``), the answer is the content
   of the last one. An empty box, a box cut off before its closing brace, a ``\\boxed`` without braces, a
   box inside a box, or an earlier box holding something else (``\\boxed{20} ... \\boxed{21}``: a hedge)
   leaves no answer. ``\\Boxed``, ``\\textbf{...}``, ``**...**`` and other look-alikes are not boxes.
3. **Without a box, at the end.** The answer is what the response ends on, after its last marker:
   ``####``, "answer is" / "answer:" ("the answer is", "the final answer is", "Final answer:"), or ``=``
   (not ``<=``, ``>=``, ``!=``, ``==``). Only ``$``, ``\\(``/``\\)``, ``\\[``/``\\]``, ``**`` and a final full
   stop may wrap it: ``'13 + 7 = 20.'`` answers ``20``, but ``'= 20. Or 21.'`` answers ``20. Or 21``,
   which no reward accepts. Several ``####`` lines that disagree leave no answer. A response with no
   marker has an answer only when it is nothing but one (a single line of at most ``MAX_BARE_CHARS``
   characters, e.g. ``'20'``); a number mentioned mid-text (``'She makes $18 a day.'``) never is.

What an answer may be is then each reward's check on that string alone:

- **a single number** (:func:`parse_number`; ``gsm8k``, ``arithmetic``, and ``math`` when the ground truth
  is a number): an integer or decimal in ASCII digits (full-width ``４２`` folds to ``42``), optionally
  signed, with thousands commas only in groups of three (``1,200``); for ``arithmetic`` written plainly
  (no ``+`` sign, no leading zeros: ``02`` is not 2); for ``math`` and ``gsm8k`` also a
  fraction in lowest terms (``\\frac{1}{2}``, ``1/2``), a leading ``x =``, a currency sign, ``%``, a degree
  sign or a unit (``\\text{ cm}``, ``72 clips``; never a word that changes or hedges the value such as
  ``or``, ``thousand``, ``about``). An expression still to evaluate (``13+7``, ``\\frac{40}{2}``,
  ``\\sqrt{400}``) is not a number: an answer must be the value, not the question restated.
- **several candidate values** (a list, ``or``/``and``, ``\\pm``, ``;``) score 0 unless the ground truth is
  itself a set, tuple or interval.
- **restating the question** scores 0: an answer (other than a plain number or the ground truth's own
  form) that appears verbatim in the prompt, e.g. ``\\boxed{\\dbinom{8}{4}}`` for "Compute
  $\\dbinom{8}{4}$", which math-verify would evaluate to the right value.
- **look-alike digits** score 0: superscripts (``²``), circled, mathematical-bold, Arabic-Indic and other
  non-ASCII digits are not read as digits (only the full-width forms fold, as the same characters at
  another width).

Every check reports what it found, so the rewards can say what they paid for (:class:`Final`).
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from fractions import Fraction
from math import gcd
from typing import Any

MAX_RESPONSE_CHARS = 8_000  # responses are judged on their last characters, where the answer is
MAX_ANSWER_CHARS = 400  # a final answer longer than this is not one (and would only feed sympy a bomb)
MAX_BARE_CHARS = 32  # a response with no box and no marker is an answer only when this short and one line
MAX_DIGITS = 60  # digits in one number; more is a flood, not an answer
BOXED = "\\boxed{}"  # Final.source of an answer taken from a box


@dataclass(frozen=True)
class Final:
    """The isolated final answer (``answer``, None when there is none) and where it came from or why
    there is none (``source``: ``\\boxed{}``, ``after '####'``, ... or ``empty \\boxed{}``, ...)."""

    answer: str | None
    source: str


# -- text ---------------------------------------------------------------------------------------------

_FOLD = {cp: cp - 0xFEE0 for cp in range(0xFF01, 0xFF5F)}  # full-width ASCII forms -> ASCII
_FOLD.update({0x3000: 0x20, 0x00A0: 0x20, 0x2212: ord("-")})  # ideographic and no-break space, minus sign


def fold(text: Any) -> str:
    """``text`` as a string with full-width ASCII forms, no-break spaces and the minus sign folded to
    ASCII. Nothing else is normalised: NFKC would also read ``4²`` as ``42`` and ``𝟐𝟏`` as ``21``."""
    return unicodedata.normalize("NFC", "" if text is None else str(text)).translate(_FOLD)


def tail(text: Any) -> str:
    """The end of a response, folded."""
    text = "" if text is None else str(text)
    return fold(text[-MAX_RESPONSE_CHARS:])


def after_reasoning(text: str) -> str | None:
    """The text after the last ``</think>``; the whole text without reasoning tags; None when the
    response opened ``<think>`` and was cut off before closing it (no answer yet)."""
    if "</think>" in text:
        return text.rsplit("</think>", 1)[1]
    if "<think>" in text:
        return None
    return text


def lookalike_digits(text: str) -> str:
    """The characters of ``text`` that are numerals but not ASCII digits (``²``, ``①``, ``𝟐``, ``٢``)."""
    return "".join(sorted({c for c in text if not c.isascii() and unicodedata.numeric(c, None) is not None}))


def clip(text: str | None, n: int = 200) -> str | None:
    """At most ``n`` characters of ``text`` for a report (the jsonl, the console)."""
    return text if text is None or len(text) <= n else text[: n - 1] + "…"


# -- the box ------------------------------------------------------------------------------------------

_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def _braced(text: str, i: int) -> tuple[str | None, int]:
    """The content of the brace group opening at ``text[i] == '{'`` and the index after it; (None, len)
    when it never closes. ``\\{`` and ``\\}`` are literal braces, not grouping."""
    depth, j = 0, i
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j], j + 1
        j += 1
    return None, len(text)


def boxes(text: str) -> list[tuple[str | None, str]]:
    """The top-level boxes of ``text`` in order, as ``(content, problem)``: the content and ``""``, or
    None and what is wrong (``never closes``, ``without braces``). A box inside a box is part of its
    outer box's content."""
    out: list[tuple[str | None, str]] = []
    pos = 0
    while (m := _BOX.search(text, pos)) is not None:
        i = m.end()
        while i < len(text) and text[i] in " \t":
            i += 1
        if i >= len(text) or text[i] != "{":
            out.append((None, f"a {m.group()} without braces"))
            pos = i
            continue
        content, pos = _braced(text, i)
        out.append((content, "") if content is not None else (None, f"a {m.group()}{{ that never closes"))
    return out


def last_boxed(text: str) -> str | None:
    """The content of the last top-level box (None when there is none or it is broken)."""
    found = boxes(text)
    return found[-1][0] if found else None


def _same(a: str | None, b: str | None) -> bool:
    def key(s: str) -> str:
        return re.sub(r"[\s$]", "", s)

    return a is not None and b is not None and key(a) == key(b)


# -- markers ------------------------------------------------------------------------------------------

_MARKER = re.compile(r"####|\banswer\s*(?:is\b\s*:?|:)|(?<![<>!=])=(?!=)", re.IGNORECASE)
_WRAPPERS = ("$$", "$", "\\(", "\\)", "\\[", "\\]", "**", "`")


def clean(answer: str) -> str:
    """``answer`` without what only wraps it: surrounding space, ``$``, ``\\( \\)``, ``\\[ \\]``, ``**``,
    backticks, and trailing full stops, commas, colons or exclamation marks."""
    s, prev = answer.strip(), None
    while s != prev:
        prev = s
        s = s.rstrip(".,;:! \t\r\n").lstrip(" \t\r\n")
        for w in _WRAPPERS:
            if s.startswith(w):
                s = s[len(w) :].lstrip()
            if s.endswith(w) and not s.endswith("\\" + w):  # "\$" is a dollar sign, not math mode
                s = s[: -len(w)].rstrip()
    return s


def final_answer(response: Any) -> Final:
    """The one place a response's answer may be (the module docstring's rule), isolated and cleaned."""
    # Reasoning tags are looked for in the whole response: a long thought cut off before </think> has
    # no answer, whatever its last characters hold.
    body = after_reasoning("" if response is None else str(response))
    if body is None:
        return Final(None, "cut off while thinking (no </think>)")
    body = tail(body)
    if not body.strip():
        return Final(None, "empty response")
    found = boxes(body)
    if found:
        last, problem = found[-1]
        if last is None:
            return Final(None, problem)
        if _BOX.search(last):
            return Final(None, "a box inside a box")
        others = [b for b, _ in found[:-1] if not _same(b, last)]
        if others:
            shown = ", ".join("a broken box" if b is None else repr(clip(b, 40)) for b in others)
            return Final(None, f"several boxes: {shown} before {clip(last, 40)!r}")
        answer = clean(last)
        if not answer:
            return Final(None, "empty \\boxed{}")
        if len(answer) > MAX_ANSWER_CHARS:
            return Final(None, f"a \\boxed{{}} of {len(answer)} characters")
        return Final(answer, BOXED)
    hashes = {re.sub(r"\s", "", clean(line)) for line in re.findall(r"####([^\n]*)", body)}
    if len(hashes) > 1:  # GSM8K's format has one "####" line; several that disagree are a hedge
        return Final(None, f"several '####' answers: {', '.join(sorted(repr(clip(h, 20)) for h in hashes))}")
    markers = list(_MARKER.finditer(body))
    if markers:
        m = markers[-1]
        answer = clean(body[m.end() :])
        where = f"after {m.group().strip()!r}"
        if not answer:
            return Final(None, f"nothing {where}")
        if len(answer) > MAX_ANSWER_CHARS:
            return Final(None, f"{len(answer)} characters {where}")
        return Final(answer, where)
    bare = clean(body)
    if bare and "\n" not in bare and len(bare) <= MAX_BARE_CHARS:
        return Final(bare, "the whole response")
    return Final(None, "no \\boxed{} and no final answer ('####', 'the answer is', '=')")


# -- numbers ------------------------------------------------------------------------------------------

_INT = r"(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)"
_DECIMAL = re.compile(rf"([-+]?)({_INT}(?:\.[0-9]+)?|\.[0-9]+)")
_FRACTION = re.compile(r"([-+]?)\\[dt]?frac(?:\{([0-9]+)\}\{([0-9]+)\}|([0-9])([0-9]))|([-+]?)([0-9]+)/([0-9]+)")
_VARIABLE = re.compile(r"^[A-Za-z](?:_\{?[A-Za-z0-9]+\}?)?\s*=\s*")  # "x = 5", "a_1 = 5"
_CURRENCY = re.compile(r"^(?:\\\$|\$|€|£|¥|\\euro\s*|\\pounds\s*)")
_PERCENT_DEGREE = re.compile(r"\s*(?:\\?%|\^\s*\{?\\circ\}?|°|\\degree)$")
_TEX_UNIT = re.compile(r"\s*\\(?:text|textrm|mbox|mathrm)\s*\{\s*([A-Za-z][A-Za-z .]*)\}$")
_WORD_UNIT = re.compile(r"\s+([A-Za-z][A-Za-z.]*(?:\s+[A-Za-z][A-Za-z.]*){0,2})$")
# Words that change the value or hedge it: never a unit.
_NOT_UNITS = frozenset(
    "or and nor to than plus minus times over divided by of hundred hundreds thousand thousands million "
    "millions billion billions trillion dozen dozens half halves quarter more less fewer about around "
    "approximately approx roughly nearly almost maybe perhaps probably either between least most some "
    "e i pi sqrt".split()
)


def _strip_unit(s: str) -> str | None:
    """``s`` without one trailing unit (``\\text{ cm}``, ``clips``); None when the trailing words are not
    a unit but change or hedge the value (``or more``, ``thousand``)."""
    for pattern in (_TEX_UNIT, _WORD_UNIT):
        m = pattern.search(s)
        if m:
            words = re.findall(r"[A-Za-z]+", m.group(1).lower())
            if not words or any(w in _NOT_UNITS for w in words):
                return None
            return s[: m.start()].rstrip()
    return s


def parse_number(
    text: str, *, fractions: bool = True, decorations: bool = True, reduced: bool = True, plain: bool = False
) -> Fraction | None:
    """The value of ``text`` when it is a single number (the module docstring's grammar), else None.

    ``fractions``: ``\\frac{a}{b}`` and ``a/b`` count (in lowest terms with ``b > 1`` when ``reduced``).
    ``decorations``: a leading ``x =`` or currency sign, a trailing ``%``, degree sign or unit are allowed
    and do not change the value (``50\\%`` is 50, as datasets write percentages).
    ``plain``: the number as it is written, no ``+`` sign and no leading zeros (``02`` is not 2).
    """
    s = fold(text).strip()
    s = s.replace("\\!", "").replace("{,}", ",").replace("\\,", ",").replace("\\ ", " ")
    s = s.replace("\\left", "").replace("\\right", "")
    if lookalike_digits(s) or len(re.findall(r"[0-9]", s)) > MAX_DIGITS:
        return None
    if decorations:
        s = _VARIABLE.sub("", s, count=1)
        s = _CURRENCY.sub("", s, count=1).strip()
        s = _PERCENT_DEGREE.sub("", s).strip()
        stripped = _strip_unit(s)
        if stripped is None:
            return None
        s = _PERCENT_DEGREE.sub("", stripped).strip()  # "50 \%" after a unit, or "30^\circ" before none
        s = _CURRENCY.sub("", s, count=1).strip()
    if s.startswith("(") and s.endswith(")") and s.count("(") == 1:  # "(-3)"
        s = s[1:-1].strip()
    m = _DECIMAL.fullmatch(s)
    if m:
        if plain and (m.group(1) == "+" or re.match(r"0[0-9]", m.group(2))):
            return None
        value = Fraction(m.group(2).replace(",", ""))
        return -value if m.group(1) == "-" else value
    if not fractions:
        return None
    m = _FRACTION.fullmatch(s.replace(" ", ""))
    if not m:
        return None
    if m.group(7) is not None:
        sign, num, den = m.group(6), int(m.group(7)), int(m.group(8))
    else:
        sign = m.group(1)
        num, den = (int(m.group(2)), int(m.group(3))) if m.group(2) is not None else (int(m.group(4)), int(m.group(5)))
    if den == 0 or (reduced and (den == 1 or gcd(num, den) != 1)):
        return None  # \frac{40}{2} is a division still to do
    return Fraction(-num if sign == "-" else num, den)


def why_not_a_number(answer: str, question: str | None = None) -> str:
    """A short reason for the report when ``answer`` is not a single number."""
    answer = fold(answer)
    if lookalike_digits(answer):
        return f"look-alike digits {lookalike_digits(answer)!r}, not 0-9"
    if question and restates(answer, question, None):
        return "restates the question instead of answering it"
    numbers = re.findall(r"[0-9]+(?:\.[0-9]+)?", answer)
    if len(numbers) > 1 and several_values(answer):
        return "several candidate values"
    words = {w.lower() for w in re.findall(r"(?<![\\A-Za-z])[A-Za-z]{2,}", answer)}
    if numbers and words & _NOT_UNITS:
        return "a word that changes or hedges the number"
    if words - {"text", "frac", "dfrac", "tfrac", "sqrt", "cdot", "times", "left", "right"}:
        return "words, not a number"
    if parse_number(answer) is not None:  # the caller wanted a plain number (arithmetic)
        return "not written plainly (a fraction, a unit, a + sign or a leading zero)"
    if parse_number(answer, reduced=False) is not None:
        return "a fraction not in lowest terms"
    if len(numbers) > 1 or re.search(r"[0-9]\s*[-+*/^×÷]|\\(?:sqrt|frac|dfrac|tfrac|binom|dbinom|times|cdot)", answer):
        return "an expression to evaluate, not a number"
    return "not a number"


def show(value: Fraction) -> str:
    """``value`` as a person writes it: ``20``, ``-0.5``, ``1/3``."""
    if value.denominator == 1:
        return str(value.numerator)
    d = value.denominator
    while d % 2 == 0:
        d //= 2
    while d % 5 == 0:
        d //= 5
    return str(float(value)) if d == 1 else f"{value.numerator}/{value.denominator}"


# -- several values and restatements ------------------------------------------------------------------

_SEPARATORS = re.compile(
    r"(?<![0-9]),|,(?![0-9]{3}(?![0-9]))|;|\\pm|\\mp|\\lor|\\vee|\\cup|\\ldots|\\dots|\\cdots"
    r"|\\(?:text|mbox|textrm|mathrm)\s*\{\s*(?:or|and)\s*\}|\b(?:or|and)\b",
    re.IGNORECASE,
)


def several_values(text: str) -> bool:
    """``text`` lists several values: a comma that is not a thousands separator, ``;``, ``\\pm``, ``or``..."""
    return _SEPARATORS.search(fold(text)) is not None


def _canon(text: str) -> str:
    s = fold(text)
    for a, b in (("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\dbinom", "\\binom"), ("\\tbinom", "\\binom"),
                 ("\\left", ""), ("\\right", ""), ("\\displaystyle", ""), ("\\cdot", "*"), ("\\times", "*"),
                 ("×", "*"), ("**", "^"), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\:", ""), ("\\ ", "")):
        s = s.replace(a, b)
    return re.sub(r"[\s${}]", "", s)


def restates(answer: str, question: str, ground_truth: Any) -> bool:
    """``answer`` appears verbatim in ``question`` (spacing, ``$``, braces and ``\\dfrac``-style variants
    aside) and is neither a plain number nor the ground truth's own form: the question restated, for a
    checker to evaluate, instead of answered."""
    a = _canon(answer)
    if not a or not question or parse_number(answer, decorations=False, reduced=False) is not None:
        return False
    if ground_truth is not None and a == _canon(str(ground_truth)):
        return False
    return a in _canon(question)
