"""The final answer of a response: one rule shared by the ``math``, ``gsm8k`` and ``arithmetic`` rewards.

GRPO pays for whatever a reward accepts, and a policy finds every answer a lenient extractor reads into
its text (math-verify, given a whole response, found the question's own ``13 + 7`` in
``'13 + 7 equals C3.'`` and paid for it). So the answer is taken from one place only, and a response
that does not put an answer there has none; nothing falls back to the rest of the text. The rule must
also be fair: an honest answer in any format real models and evaluation harnesses write
(boxed, "The final answer is", lm-eval's Minerva ending, LaTeX dressing) scores as its value deserves.

Where the answer is (:func:`final_answer`):

1. **After the reasoning.** With ``</think>`` only the text after the last one counts; a response that
   opened ``<think>`` and never closed it was cut off while thinking and has no answer. The rest is read
   whole, up to ``MAX_RESPONSE_CHARS``; a longer one scores 0 with a note (a window on its end would
   forget a hedge at its start).
2. **In the box.** When the response has a ``\\boxed{...}`` (or ``\\fbox{...}``), the answer is the content
   of the last one. An empty box, a box cut off before its closing brace, a ``\\boxed`` without braces, a
   box inside a box, or an earlier box holding something else (``\\boxed{20} ... \\boxed{21}``: a hedge)
   leaves no answer, except that when the ground truth is a set or tuple the boxes join into one list
   (``\\boxed{(2, 2)} and \\boxed{(6, 2)}``). ``\\Boxed``, ``\\textbf{...}``, ``**...**`` and other
   look-alikes are not boxes.
3. **Without a box, at the end.** The answer follows the response's last marker: ``####``, "answer is" /
   "answer:", ``=`` (not ``<=``, ``>=``, ``!=``, ``==``; not a marker at all when the ground truth is an
   equation, whose answer keeps its ``=``: the formula after "the answer is", else the one the response
   ends on), or "is" / "equals" between an expression and a value. It runs to the end of
   its ``$...$`` (or ``\\( \\)``, ``\\[ \\]``, ``**``) or of its sentence. Several ``####`` lines that
   disagree leave no answer; so does a hedge before a final ``=`` (``x = 5 or x = 6``). A response with no
   marker has an answer only when it is nothing but one (a single line of at most ``MAX_BARE_CHARS``
   characters, e.g. ``'20'``); a number mentioned mid-text (``'She makes $18 a day.'``) never is.
4. **Nothing after it takes it back.** Text after the answer (after the box, or after the answer's
   sentence) that states or hedges another value (a number other than the answer's, another "the answer
   is", ``or``, ``wait``, ``wrong``, ``maybe``, ...) leaves no single answer: ``\\boxed{20} (or 21 if you
   count differently)`` scores 0. A sentence that does neither (Minerva's "I hope it is correct.",
   "hope that helps!", "square centimeters.") is not part of the answer.

What an answer may be is then each reward's check on that string alone:

- **a single number** (:func:`parse_number`; ``gsm8k``, ``arithmetic``, and ``math`` when the ground truth
  is a number): an integer or decimal in ASCII digits (full-width ``４２`` folds to ``42``), optionally
  signed, with thousands commas only in groups of three (``1,200``, ``32,\\! 349``); for ``arithmetic``
  written plainly (no ``+`` sign, no leading zeros: ``02`` is not 2); for ``math`` and ``gsm8k`` also a
  fraction in lowest terms (``\\frac{1}{2}``, ``\\cfrac{1}{2}``, ``1/2``), a mixed number (``1\\frac{1}{2}``),
  LaTeX that does not change the value (``\\text{2}``, ``\\mathbf{2}``, ``- 3``, ``\\left( \\right)``), a
  leading ``x =``, ``f(3) =`` or ``x \\approx``, a currency sign, ``%``, a degree sign, or a unit: a
  measurement unit from :data:`UNITS` (``\\text{ cm}``, ``\\textbf{meters}``, ``miles per hour``, ``cm^2``)
  or one plural noun naming what is counted (``72 clips``). An expression still to evaluate (``13+7``,
  ``\\frac{40}{2}``, ``\\sqrt{400}``) is not a number: an answer must be the value, not the question restated.
  A base-prefixed integer (``0x1f``, ``-0b101``, ``0o17``) is the integer it is, for every reward but
  ``arithmetic``; ``math`` and ``gsm8k`` also read a float as programs print it (``3.051757812e-05``,
  an exponent of at most 3 digits).
- **several candidate values** (a list, ``or``/``and``, ``\\pm``, ``;``) score 0 unless the ground truth is
  itself a set, tuple, interval or inequality.
- **restating the question** scores 0: an answer (other than a plain number or the ground truth's own
  form) that is the question's expression up to form (:func:`restates`: spacing, ``$``, braces, brackets,
  ``\\dfrac``-style variants, a factor ``1`` or a term ``0``, the order of its terms), e.g.
  ``\\boxed{\\dbinom{8}{4}}`` for "Compute $\\dbinom{8}{4}$", which math-verify would evaluate to the right value.
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

MAX_RESPONSE_CHARS = (
    100_000  # after the reasoning; a longer response scores 0 (it is read whole, not windowed)
)
MAX_ANSWER_CHARS = 400  # a final answer longer than this is not one (and would only feed sympy a bomb)
MAX_BARE_CHARS = 32  # a response with no box and no marker is an answer only when this short and one line
MAX_DIGITS = 60  # digits in one number; more is a flood, not an answer
MAX_RESTATEMENTS = 3  # the same answer given again after it ("Final Answer: ..."); more is a flood
MAX_WRAPPERS = 8  # layers of $, **, \( \) ... peeled off an answer; a real one has two or three
MAX_NESTING = 12  # brackets and braces inside an answer nested deeper than this: a bomb for a parser
MAX_EXPONENT = (
    10_000  # an exponent (or factorial, binomial) this large is a number no answer needs written so
)
BOXED = "\\boxed{}"  # Final.source of an answer taken from a box


@dataclass(frozen=True)
class Final:
    """The isolated final answer (``answer``, None when there is none) and where it came from or why
    there is none (``source``: ``\\boxed{}``, ``after '####'``, ... or ``empty \\boxed{}``, ...)."""

    answer: str | None
    source: str


# -- text ---------------------------------------------------------------------------------------------

_FOLD = {cp: cp - 0xFEE0 for cp in range(0xFF01, 0xFF5F)}  # full-width ASCII forms -> ASCII
_FOLD.update({0x3000: 0x20, 0x00A0: 0x20, 0x2009: 0x20, 0x202F: 0x20, 0x2212: ord("-")})  # spaces, minus sign


def fold(text: Any) -> str:
    """``text`` as a string with full-width ASCII forms, no-break and thin spaces and the minus sign folded
    to ASCII. Nothing else is normalised: NFKC would also read ``4²`` as ``42`` and ``𝟐𝟏`` as ``21``."""
    return unicodedata.normalize("NFC", "" if text is None else str(text)).translate(_FOLD)


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

BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


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


def boxes_at(text: str) -> list[tuple[str | None, str, int]]:
    """:func:`boxes`, each with the index just after it."""
    out: list[tuple[str | None, str, int]] = []
    pos = 0
    while (m := BOX.search(text, pos)) is not None:
        i = m.end()
        while i < len(text) and text[i] in " \t":
            i += 1
        if i >= len(text) or text[i] != "{":
            out.append((None, f"a {m.group()} without braces", i))
            pos = i
            continue
        content, pos = _braced(text, i)
        problem = "" if content is not None else f"a {m.group()}{{ that never closes"
        out.append((content, problem, pos))
    return out


def boxes(text: str) -> list[tuple[str | None, str]]:
    """The top-level boxes of ``text`` in order, as ``(content, problem)``: the content and ``""``, or
    None and what is wrong (``never closes``, ``without braces``). A box inside a box is part of its
    outer box's content."""
    return [(content, problem) for content, problem, _ in boxes_at(text)]


def last_boxed(text: str) -> str | None:
    """The content of the last top-level box (None when there is none or it is broken)."""
    found = boxes(text)
    return found[-1][0] if found else None


def _key(s: str) -> str:
    return re.sub(r"[\s$]", "", s)


def _same(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and _key(a) == _key(b)


# -- markers, and what follows the answer ----------------------------------------------------------

# "is" and "equals" read as "=" between an expression and a value ("13 + 7 is 20"); not in "it is
# correct", nor in "The temperature is -7 degrees", which mentions a number rather than answering
_MARKER = re.compile(
    r"####|\banswer\s*(?:is\b\s*:?|:)|(?<=[0-9)}$])\s*\b(?:is|equals)\b(?=\s*(?:[-+$(\[0-9.]|\\[A-Za-z(\[{]))"
    r"|(?<![<>!=\\])=(?!=)",
    re.IGNORECASE,
)
_WRAPPERS = ("$$", "$", "\\(", "\\)", "\\[", "\\]", "**", "`")
_SPANS = (("$$", "$$"), ("\\[", "\\]"), ("\\(", "\\)"), ("$", "$"), ("**", "**"), ("`", "`"))
# Where an unwrapped answer ends: a line break, a full stop, ! or ? before a space, or math mode closing.
# "**" is bold closing unless a value follows at once: ``-x**9 + 7*x**7`` is Python's exponent, not bold.
_ANSWER_END = re.compile(r"\n|(?<!\\)[.!?](?=\s|$)|(?<!\\)\$|\\\)|\\\]|\*\*(?![-+]?[A-Za-z0-9(])")
# Words that take a value back or hedge it, after the answer or before a final "=".
_HEDGE = re.compile(
    r"\b(?:or|nor|maybe|perhaps|possibly|probably|approximately|approx|roughly|unless|wrong|incorrect|mistake|"
    r"wait|actually|instead|alternatively|otherwise|unsure)\b|\\(?:pm|mp|approx)(?![A-Za-z])",
    re.IGNORECASE,
)
_RESTATED = re.compile(r"####|\banswer\s*(?:is\b|:)", re.IGNORECASE)  # another answer after the answer
_NOT_A_VALUE = re.compile(r"\\pmod\s*\{[^{}]*\}|\^\s*\{?\s*[23]\s*\}?(?![0-9])|\\end\s*\{[^{}]*\}")
_NUMBER = re.compile(r"[0-9]+(?:\.[0-9]+)?")


def clean(answer: str) -> str:
    """``answer`` without what only wraps it: surrounding space, ``$``, ``\\( \\)``, ``\\[ \\]``, ``**``,
    backticks, and trailing full stops, commas, colons or exclamation marks."""
    s, prev = answer.strip(), None
    for _ in range(MAX_WRAPPERS):  # each round peels one layer; more layers than this is no answer
        if s == prev:
            break
        prev = s
        s = s.rstrip(".,;:! \t\r\n").lstrip(" \t\r\n")
        for w in _WRAPPERS:
            if s.startswith(w):
                s = s[len(w) :].lstrip()
            if s.endswith(w) and not s.endswith("\\" + w):  # "\$" is a dollar sign, not math mode
                s = s[: -len(w)].rstrip()
    return s


def _find_closer(text: str, closer: str, start: int) -> int:
    """The index of ``closer`` in ``text`` from ``start``, skipping escaped ones (``\\$``); -1 if none."""
    j = text.find(closer, start)
    while j > 0 and closer == "$" and text[j - 1] == "\\":
        j = text.find(closer, j + 1)
    return j


def answer_span(text: str) -> tuple[str, str]:
    """What follows a marker, split into the answer and the text after it: the answer is the
    ``$...$`` (or ``\\( \\)``, ``\\[ \\]``, ``**``) that opens it, else it runs to the end of its sentence."""
    t = text.lstrip(" \t:")
    for opener, closer in _SPANS:
        if t.startswith(opener):
            j = _find_closer(t, closer, len(opener))
            if j >= 0:
                return t[len(opener) : j], t[j + len(closer) :]
            break
    m = _ANSWER_END.search(t, 1 if t[:1] == "$" else 0)
    return (t, "") if m is None else (t[: m.start()], t[m.start() :])


def takes_back(after: str, answer: str) -> str | None:
    """Why the text ``after`` an answer leaves the response without a single answer (it hedges, gives
    another answer, or names a value the answer does not), or None when it does neither (``I hope it is
    correct.``, ``square centimeters.``, the same answer again)."""
    if not re.search(r"[A-Za-z0-9]", after) and not lookalike_digits(after):
        return None
    if (m := _HEDGE.search(after)) is not None:
        return f"{m.group()!r} after the answer"
    for _ in range(MAX_RESTATEMENTS + 1):
        # "\\boxed{28}. Final Answer: The final answer is $28$.": the same answer again takes nothing back
        if (m := _RESTATED.search(after)) is None:
            break
        again, rest = answer_span(after[m.end() :])
        inner = list(_RESTATED.finditer(again))  # "Final Answer: The final answer is 28"
        if inner:
            again = answer_span(again[inner[-1].end() :])[0]
        if not _same(clean(again), answer):
            return "another answer after the answer"
        after = after[: m.start()] + rest
    else:
        return f"the answer given again more than {MAX_RESTATEMENTS} times"
    if lookalike_digits(after):
        return f"look-alike digits {lookalike_digits(after)!r} after the answer"
    known = set(_NUMBER.findall(fold(answer)))
    for n in _NUMBER.findall(_NOT_A_VALUE.sub(" ", after)):
        if n not in known:
            return f"another value ({clip(n, 20)}) after the answer"
    return None


def _sentence(text: str) -> str:
    """The last sentence (or line) of ``text``, where a final ``=`` or "is" states its value."""
    cut = max(text.rfind("\n"), *(m.end() - 1 for m in re.finditer(r"(?<!\\)[.!?](?=\s)", text)), -1)
    return text[cut + 1 :]


def final_answer(response: Any, *, join_boxes: bool = False, equation: bool = False) -> Final:
    """The one place a response's answer may be (the module docstring's rule), isolated and cleaned.

    ``join_boxes``: several boxes are one list answer (the ground truth is a set or tuple).
    ``equation``: ``=`` is no marker (the ground truth is an equation, and so is the answer)."""
    # Reasoning tags are looked for in the whole response: a long thought cut off before </think> has
    # no answer, whatever its last characters hold.
    body = after_reasoning("" if response is None else str(response))
    if body is None:
        return Final(None, "cut off while thinking (no </think>)")
    if len(body) > MAX_RESPONSE_CHARS:
        return Final(
            None, f"a response of {len(body):,} characters (more than the {MAX_RESPONSE_CHARS:,} read)"
        )
    body = fold(body)
    if not body.strip():
        return Final(None, "empty response")
    found = boxes_at(body)
    if found:
        return _boxed_answer(body, found, join_boxes)
    hashes = {re.sub(r"\s", "", clean(line)) for line in re.findall(r"####([^\n]*)", body)}
    if len(hashes) > 1:  # GSM8K's format has one "####" line; several that disagree are a hedge
        return Final(None, f"several '####' answers: {', '.join(sorted(repr(clip(h, 20)) for h in hashes))}")
    markers = list(_MARKER.finditer(body))
    if equation and markers and markers[-1].group() == "=":
        return _equation_answer(body, markers)
    if markers:
        m = markers[-1]
        raw, after = answer_span(body[m.end() :])
        while (
            join_boxes
            and len(raw)
            <= MAX_ANSWER_CHARS  # a longer list is refused below; joining more would only cost time
            and (more := re.match(r"\s*(?:,\s*)?(?:and\s+)?(?=\$)", after))
            and more.group().strip()
        ):
            nxt, rest = answer_span(after[more.end() :])  # "$12$ and $13$": a list over several formulas
            raw, after = f"{raw}, {nxt}", rest
        where = f"after {m.group().strip()!r}"
        if len(raw) > 4 * MAX_ANSWER_CHARS:  # what wraps an answer is a few characters, not thousands
            return Final(None, f"{len(raw)} characters {where}")
        answer = clean(raw)
        if not answer:
            return Final(None, f"nothing {where}")
        if len(answer) > MAX_ANSWER_CHARS:
            return Final(None, f"{len(answer)} characters {where}")
        if not m.group().strip().lower().startswith(("#", "answer")):  # "x = 5 or x = 6": two candidates
            hedge = _HEDGE.search(_sentence(body[: m.start()]))
            if hedge is not None:
                return Final(
                    None, f"several candidate values: {hedge.group()!r} before the last {m.group()!r}"
                )
        problem = takes_back(after, answer)
        if problem:
            return Final(None, f"{where}: {problem} ({clip(after.strip(), 40)!r})")
        return Final(answer, where)
    bare = clean(body)
    if re.match(
        r"\\(?:textbf|mathbf|bf|boldsymbol|bm)(?![A-Za-z])", bare
    ):  # bold looks like a box and is not one
        return Final(None, "bold is not a \\boxed{}")
    if bare and "\n" not in bare and len(bare) <= MAX_BARE_CHARS:
        return Final(bare, "the whole response")
    return Final(None, "no \\boxed{} and no final answer ('####', 'the answer is', '=', 'is ...')")


def _equation_answer(body: str, markers: list[re.Match]) -> Final:
    """The ground truth is an equation, so ``=`` is no marker: the answer follows the last other marker
    (``The final answer is $x-2y+z-1=0$``), else it is the formula holding the last ``=`` when the
    response ends on it (``So the plane is $x-2y+z-1=0$.``)."""
    others = [m for m in markers if m.group() != "="]
    last = markers[-1]
    opened = max(
        body.rfind("$", 0, last.start()),
        body.rfind("\\(", 0, last.start()),
        body.rfind("\\[", 0, last.start()),
    )
    if others and (opened < others[-1].end() or not body[others[-1].end() : opened].strip(" \t:")):
        start, where = others[-1].end(), f"after {others[-1].group().strip()!r}"
    elif opened >= 0:
        if body[opened - 1 : opened + 1] == "$$":
            opened -= 1
        start, where = opened, "the formula it ends on"
        hedge = _HEDGE.search(_sentence(body[:opened]))
        if hedge is not None:
            return Final(None, f"several candidate values: {hedge.group()!r} before {where}")
    else:
        return Final(None, "no \\boxed{} and no final answer ('####', 'the answer is', 'is ...')")
    raw, after = answer_span(body[start:])
    answer = clean(raw)
    if not answer or len(answer) > MAX_ANSWER_CHARS:
        return Final(None, f"no equation {where}")
    problem = takes_back(after, answer)
    if problem:
        return Final(None, f"{where}: {problem} ({clip(after.strip(), 40)!r})")
    return Final(answer, where)


def _boxed_answer(body: str, found: list[tuple[str | None, str, int]], join_boxes: bool) -> Final:
    last, problem, end = found[-1]
    if last is None:
        return Final(None, problem)
    if any(c is not None and BOX.search(c) for c, _, _ in found):
        return Final(None, "a box inside a box")
    distinct: list[str | None] = []
    seen: set[str] = set()  # one look-up per box: thousands of boxes cost linear time, not quadratic
    for content, _, _ in found:
        if content is None:
            distinct.append(content)
        elif (key := _key(content)) not in seen:
            seen.add(key)
            distinct.append(content)
    source = BOXED
    boxes = [d for d in distinct if d is not None]
    if len(distinct) > 1 and join_boxes and len(boxes) == len(distinct):
        answer = ", ".join(c for c in map(clean, boxes) if c)
        source = f"{len(distinct)} \\boxed{{}} joined"
    elif len(distinct) > 1:
        shown = ", ".join("a broken box" if b is None else repr(clip(b, 40)) for b in distinct[:-1])
        return Final(None, f"several boxes: {shown} before {clip(last, 40)!r}")
    else:
        answer = clean(last)
    if not answer:
        return Final(None, "empty \\boxed{}")
    if len(answer) > MAX_ANSWER_CHARS:
        return Final(None, f"a \\boxed{{}} of {len(answer)} characters")
    taken_back = takes_back(body[end:], answer)
    if taken_back:
        return Final(None, f"{source}: {taken_back} ({clip(body[end:].strip(), 40)!r})")
    return Final(answer, source)


# -- numbers ------------------------------------------------------------------------------------------

_INT = r"(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)"
_DECIMAL = re.compile(rf"([-+]?)({_INT}(?:\.[0-9]+)?|\.[0-9]+)")
_FRACTION = re.compile(r"([-+]?)\\frac(?:\{([0-9]+)\}\{([0-9]+)\}|([0-9])([0-9]))|([-+]?)([0-9]+)/([0-9]+)")
# Base-prefixed integers (0x1f, -0b101, 0o17) are the integers they are: math-verify reads 0x1f as 0.
_PREFIXED = re.compile(r"([-+]?)0([xX][0-9a-fA-F]+|[bB][01]+|[oO][0-7]+)")
_BASES = {"x": 16, "b": 2, "o": 8}
_SCIENTIFIC = re.compile(
    r"([-+]?)([0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE]([-+]?[0-9]{1,3})"
)  # 3.05e-05, as floats print
_MIXED = re.compile(r"([-+]?)([0-9]+)\\frac\{([0-9]+)\}\{([0-9]+)\}")  # 1\frac{1}{2}: one and a half
_VARIABLE = re.compile(  # "x = 5", "a_1 = 5", "f(3) = 5", "\theta = 5", "x \approx 5"
    r"^(?:[A-Za-z](?:_\{?[A-Za-z0-9]+\}?)?|\\[A-Za-z]+)(?:\([^()=]*\))?\s*(?:=|\\approx(?![A-Za-z]))\s*"
)
_CURRENCY = re.compile(r"^(?:\\\$|\$|€|£|¥|\\euro\s*|\\pounds\s*)")
_PERCENT_DEGREE = re.compile(r"\s*(?:\\?%|\^\s*\{?\\circ\}?|°|\\degree)$")
_STYLE = (
    r"\\(?:text|textrm|textbf|textit|textnormal|textup|mbox|mathrm|mathbf|mathit|mathnormal|boldsymbol|bm)"
)
_STYLED_NUMBER = re.compile(_STYLE + r"\s*\{([-+0-9.,\s]*)\}")  # \text{2}, \mathbf{2}: the number itself
_TEX_UNIT = re.compile(r"\s*" + _STYLE + r"\s*\{\s*([A-Za-z][A-Za-z ./^{}0-9]*)\}(\s*\^\s*\{?[23]\}?)?$")
_UNIT_TOKEN = r"[A-Za-z][A-Za-z.]*(?:\^\{?[23]\}?)?"
_WORD_UNIT = re.compile(rf"\s*({_UNIT_TOKEN}(?:(?:\s+|\s*/\s*){_UNIT_TOKEN}){{0,3}})$")

# Measurement units: the only words, besides one plural noun naming what is counted, that may follow a
# number. An allow-list: a block-list of hedges let any other word through (``20 unless it is 21``).
UNITS = frozenset(
    """
    m cm mm km nm um mi in inch inches ft foot feet yd yard yards mile miles meter meters metre metres
    centimeter centimeters centimetre centimetres millimeter millimeters kilometer kilometers kilometre kilometres
    g kg mg gram grams kilogram kilograms milligram milligrams lb lbs pound pounds oz ounce ounces ton tons tonne tonnes
    s sec secs second seconds ms min mins minute minutes h hr hrs hour hours day days week weeks month months
    year years yr yrs
    l ml liter liters litre litres milliliter milliliters gal gallon gallons quart quarts pint pints cup cups cc
    dollar dollars cent cents euro euros pence penny pennies usd
    deg degree degrees rad radian radians percent percentage pct
    mph kph kmh km/h m/s unit units sq square cubic per
    """.split()
)
# Plural words that are not things counted: multipliers, fractions and hedges change or doubt the value.
_NOT_COUNTED = frozenset(
    """
    tens hundreds thousands millions billions trillions dozens scores halves thirds quarters fourths fifths sixths
    sevenths eighths ninths tenths hundredths thousandths millionths ones twos threes perhaps plus minus times less
    unless thus yes was has does this always sometimes otherwise besides guess guesses various
    """.split()
)


def _is_unit(phrase: str) -> bool:
    """``phrase`` names a unit: measurement units (``cm^2``, ``miles per hour``, ``km/h``) or one plural
    noun naming what is counted (``clips``)."""
    tokens = [re.sub(r"\^\{?[23]\}?$", "", t) for t in re.split(r"\s+|/", phrase.strip()) if t]
    if (
        tokens
        and all(t.lower().rstrip(".") in UNITS for t in tokens)
        and tokens[-1].lower() not in {"per", "square", "cubic", "sq"}
    ):
        return True
    return (
        len(tokens) == 1
        and re.fullmatch(r"[a-z]{2,}s", tokens[0]) is not None
        and tokens[0] not in _NOT_COUNTED
    )


def _strip_unit(s: str) -> str | None:
    """``s`` without one trailing unit (``\\text{ cm}``, ``clips``); None when the trailing words are not
    a unit (``or more``, ``thousand``, ``unless it is 21``)."""
    for pattern in (_TEX_UNIT, _WORD_UNIT):
        m = pattern.search(s)
        if m:
            if not _is_unit(m.group(1)):
                return None
            return s[: m.start()].rstrip()
    return s


def _undress(s: str, plain: bool = False) -> str:
    """LaTeX that does not change a value, removed: ``\\left``/``\\right``, ``\\!`` and thin spaces in digit
    groups (``32,\\! 349``); unless ``plain``, also ``\\text{2}``, ``\\dfrac``/``\\cfrac``, a space after a
    minus sign."""
    s = s.replace("\\left", "").replace("\\right", "").replace("\\displaystyle", "")
    s = re.sub(r"(?<=[0-9]),\s*\\[!,;:]\s*(?=[0-9]{3}(?![0-9]))", ",", s)  # "32,\! 349": a grouping comma
    s = re.sub(r"(?<=[0-9])\\[,;:]\s*(?=[0-9]{3}(?![0-9]))", ",", s)  # "32\,349": a thin space groups too
    s = s.replace("\\!", "").replace("{,}", ",").replace("\\,", ",").replace("\\ ", " ")
    if plain:
        return s.strip()
    s = re.sub(r"\\[dtc]frac(?![A-Za-z])", r"\\frac", s)
    s = _STYLED_NUMBER.sub(lambda m: m.group(1).strip(), s)
    return re.sub(r"^([-+])\s+(?=[0-9.\\])", r"\1", s.strip())


def parse_number(
    text: str,
    *,
    fractions: bool = True,
    decorations: bool = True,
    reduced: bool = True,
    plain: bool = False,
    scientific: bool = False,
) -> Fraction | None:
    """The value of ``text`` when it is a single number (the module docstring's grammar), else None.

    ``fractions``: ``\\frac{a}{b}`` and ``a/b`` count (in lowest terms with ``b > 1`` when ``reduced``), and
    mixed numbers ``1\\frac{1}{2}`` (a proper fraction after the whole part).
    ``decorations``: a leading ``x =`` or currency sign, a trailing ``%``, degree sign or unit are allowed
    and do not change the value (``50\\%`` is 50, as datasets write percentages).
    ``plain``: the number as it is written, no ``+`` sign and no leading zeros (``02`` is not 2).
    ``scientific``: a float as programs print it, ``3.051757812e-05`` (an exponent of at most 3 digits).
    """
    s = _undress(fold(text), plain)
    if lookalike_digits(s) or len(re.findall(r"[0-9]", s)) > MAX_DIGITS:
        return None
    if (
        not plain and (m := _PREFIXED.fullmatch(s.replace(" ", ""))) is not None
    ):  # before units: 0x1f is no 'f'
        digits = m.group(2)[1:]
        if len(digits) > MAX_DIGITS:
            return None
        value = Fraction(int(digits, _BASES[m.group(2)[0].lower()]))
        return -value if m.group(1) == "-" else value
    if decorations:
        s = _VARIABLE.sub("", s, count=1)
        s = _CURRENCY.sub("", s, count=1).strip()
        s = _PERCENT_DEGREE.sub("", s).strip()
        stripped = _strip_unit(s)
        if stripped is None:
            return None
        s = _PERCENT_DEGREE.sub("", stripped).strip()  # "50 \%" after a unit, or "30^\circ" before none
        s = _CURRENCY.sub("", s, count=1).strip()
        s = re.sub(r"^([-+])\s+(?=[0-9.\\])", r"\1", s)
    if s.startswith("(") and s.endswith(")") and s.count("(") == 1:  # "(-3)"
        s = s[1:-1].strip()
    if scientific and (m := _SCIENTIFIC.fullmatch(s)) is not None:
        value = Fraction(m.group(2)) * Fraction(10) ** int(m.group(3))
        return -value if m.group(1) == "-" else value
    m = _DECIMAL.fullmatch(s)
    if m:
        if plain and (m.group(1) == "+" or re.match(r"0[0-9]", m.group(2))):
            return None
        value = Fraction(m.group(2).replace(",", ""))
        return -value if m.group(1) == "-" else value
    if not fractions:
        return None
    compact = s.replace(" ", "")
    mixed = _MIXED.fullmatch(compact)
    if mixed:
        whole, num, den = int(mixed.group(2)), int(mixed.group(3)), int(mixed.group(4))
        if den == 0 or num >= den or (reduced and gcd(num, den) != 1):
            return None
        value = whole + Fraction(num, den)
        return -value if mixed.group(1) == "-" else value
    m = _FRACTION.fullmatch(compact)
    if not m:
        return None
    if m.group(7) is not None:
        sign, num, den = m.group(6), int(m.group(7)), int(m.group(8))
    else:
        sign = m.group(1)
        num, den = (
            (int(m.group(2)), int(m.group(3)))
            if m.group(2) is not None
            else (int(m.group(4)), int(m.group(5)))
        )
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
    if len(numbers) > 1 and several_values(_undress(answer)):
        return "several candidate values"
    words = {w.lower() for w in re.findall(r"(?<![\\A-Za-z])[A-Za-z]{2,}", answer)}
    if numbers and (words & _NOT_COUNTED or _HEDGE.search(answer)):
        return "a word that changes or hedges the number"
    if words - {"text", "frac", "dfrac", "tfrac", "cfrac", "sqrt", "cdot", "times", "left", "right"} - UNITS:
        return "words, not a number (a unit must be a measurement unit or what is counted)"
    if parse_number(answer) is not None:  # the caller wanted a plain number (arithmetic)
        return "not written plainly (a fraction, a unit, a + sign or a leading zero)"
    if parse_number(answer, reduced=False) is not None:
        return "a fraction not in lowest terms"
    if len(numbers) > 1 or re.search(
        r"[0-9]\s*[-+*/^×÷]|\\(?:sqrt|frac|dfrac|tfrac|binom|dbinom|times|cdot)", answer
    ):
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
    for a, b in (
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
        ("\\cfrac", "\\frac"),
        ("\\dbinom", "\\binom"),
        ("\\tbinom", "\\binom"),
        ("\\left", ""),
        ("\\right", ""),
        ("\\displaystyle", ""),
        ("\\cdot", "*"),
        ("\\times", "*"),
        ("×", "*"),
        ("**", "^"),
        ("\\!", ""),
        ("\\,", ""),
        ("\\;", ""),
        ("\\:", ""),
        ("\\ ", ""),
    ):
        s = s.replace(a, b)
    return re.sub(r"[\s${}]", "", s)


def _form(text: str) -> str:
    """``text`` up to form: :func:`_canon`, without brackets, factors ``1`` or terms ``0``."""
    s = re.sub(r"\\?[()\[\]]|\\[{}]", "", _canon(text))
    prev = None
    while s != prev:
        prev = s
        s = re.sub(r"(?:^|(?<=[-+*/=]))1\*|\*1(?![0-9.])|(?:^|(?<=[-+*/=]))0\+|[-+]0(?![0-9.])", "", s)
    return s


def _terms(form: str) -> list[str]:
    """The terms of a sum in ``form``, signed and sorted: the sum up to the order of its terms."""
    return sorted(t if t[0] in "+-" else "+" + t for t in re.split(r"(?<=.)(?=[-+])", form) if t)


def same_expression(a: str, b: str) -> bool:
    """``a`` and ``b`` are one expression up to spacing, brackets and the order of a sum's terms (not up to
    a term 0 or a factor 1, as :func:`_form` is: ``+ 2`` is not ``0+2`` written out)."""
    fa, fb = (re.sub(r"\\?[()\[\]]|\\[{}]", "", _canon(x)) for x in (a, b))
    return bool(fa) and (fa == fb or _terms(fa) == _terms(fb))


_MATH_SPAN = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.DOTALL)


def restates(answer: str, question: str, ground_truth: Any) -> bool:
    """``answer`` is the question's expression up to form (spacing, ``$``, braces, brackets, ``\\dfrac``-style
    variants, a factor ``1`` or a term ``0``, the order of its terms) and is neither a plain number nor the
    ground truth's own form: the question restated, for a checker to evaluate, instead of answered."""
    a = _form(answer)
    if not a or not question or parse_number(answer, decorations=False, reduced=False) is not None:
        return False
    if ground_truth is not None and (
        a == _form(str(ground_truth)) or _terms(a) == _terms(_form(str(ground_truth)))
    ):
        return False
    if a in _form(question):
        return True
    spans = [next(g for g in m.groups() if g is not None) for m in _MATH_SPAN.finditer(fold(question))]
    exprs = [part for span in spans for part in re.split(r"=|\\approx|<|>|\\le|\\ge", span) if part.strip()]
    return len(_terms(a)) > 1 and any(_terms(a) == _terms(_form(e)) for e in exprs)
