"""Rewards for math answers and for the ``<think>``/``<answer>`` response format.

``math``, ``gsm8k`` and ``arithmetic`` read the response's answer from one place only, by the rule in
:mod:`trainer.rewards.answer` (the last ``\\boxed{}``; without a box, what the response ends on after
``####``, "the answer is" or ``=``), and then judge that string alone:

- ``math``: a number when the ground truth is one (``\\frac{1}{2}`` equals ``0.5``, ``1,200`` equals
  ``1200``, ``0.083333`` equals 1/12; ``13+7`` is no answer to "13+7"), else the ground truth's own
  form, else symbolic equality with ``math-verify`` on the isolated answer (``\\sqrt{3}+2`` equals
  ``2+\\sqrt{3}``; an interval equals an inequality, ``(0,1)`` for ``0<x<1``, and a union the inequalities
  it joins, ``(-\\infty,-2) \\cup (3,\\infty)`` for ``x<-2 \\text{ or } x>3``), never a list of guesses
  unless the ground truth is a set, tuple, interval or inequality, never the question's expression up
  to form;
- ``gsm8k``: the answer is one number, equal to the ground truth (a unit, ``$`` or ``%`` may go with it);
- ``arithmetic``: the answer is one integer or decimal written plainly (no ``+``, no leading zeros, no
  units or fractions), equal to the ground truth; a right answer outside a ``\\boxed{}`` scores
  ``unboxed_score`` (1.0 by default and in cpu-demo; 0 takes only a boxed answer);
- ``format``: 1.0 for a non-empty ``<think>...</think>`` followed by a non-empty ``<answer>...</answer>``
  and nothing else;
- ``exact_alnum``: the ``<answer>`` content (or the whole response) equals the ground truth once both are
  lower-cased and stripped to letters and digits; several ``<answer>`` blocks that disagree score 0.

Each returns a :class:`~trainer.rewards.registry.Score` naming the answer it judged (or None) and a note
(where the answer came from, or why there is none, or why it is wrong), which the run's jsonl and
console report. A reward must never raise or hang: any error scores 0 with the error as the note.

Every call is bounded by construction, whatever the response holds: the answer is read from at most
``MAX_RESPONSE_CHARS`` by loops that each consume the text or stop at a fixed count; what reaches
math-verify is at most ``MAX_ANSWER_CHARS`` long and passes :func:`costly` (no brackets nested deeper
than ``MAX_NESTING``, no tower of numeric powers, no exponent, factorial or binomial above
``MAX_EXPONENT``: Python's integers would compute those in one C call no signal interrupts); and
math-verify's parsing and comparing together get ``timeout_seconds`` of CPU (0.5 by default) by a
timer signal. That signal only reaches a process's main thread, where the reward runner's tasks run;
elsewhere (a threaded actor, a thread pool) the reward runner's per-task timeout is the bound instead.
"""

from __future__ import annotations

import contextlib
import logging
import re
import signal
import threading
from fractions import Fraction
from typing import Any

from trainer.rewards.answer import (
    BOX,
    BOXED,
    MAX_BARE_CHARS,
    MAX_EXPONENT,
    MAX_NESTING,
    MAX_RESPONSE_CHARS,
    Final,
    answer_span,
    boxes_at,
    clean,
    clip,
    final_answer,
    fold,
    last_boxed,
    lookalike_digits,
    parse_number,
    restates,
    same_expression,
    several_values,
    show,
    why_not_a_number,
)
from trainer.rewards.registry import Score, register

log = logging.getLogger(__name__)

__all__ = ["MAX_RESPONSE_CHARS", "last_boxed", "tag_content"]


def tag_blocks(text: str, tag: str) -> list[str]:
    """The contents of the ``<tag>...</tag>`` blocks of ``text``, in order (each up to the first closing
    tag after it). One pass: a regex finds the same blocks, but tries every opening tag against the rest
    of the text, so that 12,000 ``<answer>`` with no ``</answer>`` took seconds."""
    opener, closer = f"<{tag}>", f"</{tag}>"
    out, pos = [], 0
    while (i := text.find(opener, pos)) >= 0:
        j = text.find(closer, i + len(opener))
        if j < 0:  # no block closes after this opening tag, so none after a later one either
            break
        out.append(text[i + len(opener) : j])
        pos = j + len(closer)
    return out


def tag_content(text: str, tag: str) -> str | None:
    """Content of the last ``<tag>...</tag>``; None if there is none."""
    matches = tag_blocks(text, tag)
    return matches[-1] if matches else None


# Between a ground truth's boxes, only what joins a list: "\boxed{1}, \boxed{2}", "\boxed{1} papers and ...";
# words other than "and" ("\boxed{1} no no no \boxed{2}") make it no list, and the last box the answer
_JOINS = re.compile(r"[^A-Za-z]*(?:(?:[A-Za-z]+\s+)?and\b)?[^A-Za-z]*")


def _gold(ground_truth: Any) -> str:
    """A ground truth as an answer string: a dataset's ``\\boxed{...}`` or ``$...$`` unwrapped; several
    boxes joined only by commas or "and" (``\\boxed{1} and \\boxed{2}``) are one list."""
    gt = fold(ground_truth).strip()
    found = boxes_at(gt)
    contents = [b.strip().strip("$").strip() for b, _, _ in found if b is not None and b.strip()]
    if len(contents) > 1 and len(contents) == len(found):
        between = [
            gt[end:start] for (_, _, end), start in zip(found, [m.start() for m in BOX.finditer(gt)][1:])
        ]
        if all(_JOINS.fullmatch(b) for b in between):
            return ", ".join(contents)
    boxed = found[-1][0] if found else None
    if boxed is None and len(gt) > MAX_BARE_CHARS:  # a worked solution: what its last "the answer is" gives
        said = list(re.finditer(r"\banswer\s*(?:is\b\s*:?|:)", gt, re.IGNORECASE))
        if said:
            gt = answer_span(gt[said[-1].end() :])[0]
    return (boxed if boxed is not None else gt).strip().strip("$").strip()


def _wrong(final: Final, why: str) -> Score:
    return Score(0.0, False, clip(final.answer), f"{final.source}: {why}")


def _right(final: Final) -> Score:
    return Score(1.0, True, clip(final.answer), final.source)


def _compare_numbers(final: Final, gold, value, question: str | None) -> Score:
    if final.answer is None:  # callers judge only a found answer
        return _wrong(final, "no answer")
    if value is None:
        return _wrong(final, why_not_a_number(final.answer, question))
    if value != gold:
        return _wrong(final, f"{show(value)}, not {show(gold)}")
    return _right(final)


# -- math: a number, else math-verify on the isolated answer ----------------------------------------

_RELATION = re.compile(r"<|>|\\(?:le|ge|lt|gt|leq|geq|in)(?![A-Za-z])|≤|≥")
_INTERVAL = re.compile(r"^\s*(?:\\left)?\s*[\[(].*,.*(?:\\right)?\s*[\])]\s*(?:\\cup|$)", re.DOTALL)
_UNION = re.compile(r"\\cup(?![A-Za-z])")  # \{-1\} \cup [0, 7): a set of reals, as an interval is


def _gold_number(gt: str, raw: Any):
    """The ground truth's value when it is a number. A dataset's decimal comma outside math mode (``1,22``,
    ``0,111``: not thousands; ``$-2,1$`` is two roots) reads as a decimal point; an answer's comma never does."""
    m = re.fullmatch(r"(-?)([0-9]+),([0-9]+)", gt.strip())
    if m and "$" not in str(raw) and (m.group(2) == "0" or len(m.group(3)) != 3):
        return parse_number(f"{m.group(1)}{m.group(2)}.{m.group(3)}", reduced=False)
    return parse_number(gt, reduced=False, scientific=True)


def _places(value: Fraction) -> int | None:
    """The decimal places ``value`` is written with when it is a terminating decimal (``0.125``: 3), else
    None (``2/7``). Each round divides the denominator, so there are at most log2 of it: a few hundred for
    the at most ``MAX_DIGITS``-digit numbers :func:`parse_number` reads."""
    d, twos, fives = value.denominator, 0, 0
    while d % 2 == 0:
        d, twos = d // 2, twos + 1
    while d % 5 == 0:
        d, fives = d // 5, fives + 1
    return max(twos, fives) if d == 1 else None


def _approximates(value, gold) -> bool:
    """``value`` is a decimal of at least 6 places within one unit of its last place of ``gold``, a fraction
    whose decimals never end (``0.083333`` for 1/12, as math-verify rounds to 6 places)."""
    if _places(gold) is not None:  # a terminating decimal is written exactly (0.5 for 1/2, never 0.500001)
        return False
    places = _places(value)  # None: a fraction (2/7 for 1/3) is no approximation, it is another value
    return places is not None and places >= 6 and abs(value - gold) <= Fraction(1, 10**places)


def _stated(answer: str):
    """The number ``answer`` states: ``\\frac{1}{3} \\approx 0.333`` states 1/3 when the approximation
    agrees with it to its last place (one that does not is a second value, and no number is stated)."""
    m = re.fullmatch(r"(.+?)\\approx\s*([-+]?[0-9]*\.?[0-9]+)", answer.strip())
    if m is None:
        return parse_number(answer, scientific=True)
    value, approx = parse_number(m.group(1)), parse_number(m.group(2))
    if value is None or approx is None:  # "x \\approx 11" states 11
        return parse_number(answer, scientific=True)
    places = len(m.group(2).partition(".")[2])  # 20 \\approx 21 is two values; 1/3 \\approx 0.333 is one
    return value if places and abs(value - approx) < Fraction(1, 10**places) else None


# -- what math-verify may be given: bounded by construction ------------------------------------------

_POWER = re.compile(r"\^|\*\*")
_LARGE_ARGUMENT = re.compile(  # n!, \binom{n}{k}, \Gamma(n), \sum_{k=1}^{n}: sympy computes them in full
    r"([0-9]+)\s*\)?\s*!|\\(?:[dt]?binom|Gamma|sum|prod|choose)(?![A-Za-z])"
)
_INTEGER = re.compile(r"[0-9]+")
_EXPONENT_DIGITS = re.compile(r"[0-9][eE][-+]?[0-9]{4,}")  # 1e999999: a float no answer needs
_TOKEN = re.compile(r"[-+]?(?:\\[A-Za-z]+|[A-Za-z0-9.]+)")
_THEN_POWER = re.compile(r"\s*(?:\^|\*\*)")


def _operand(text: str, i: int) -> tuple[str, int]:
    """The exponent that starts at ``text[i]`` (after ``^`` or ``**``) and the index after it: a ``{...}``
    or ``(...)`` group (without its brackets), a signed run of letters, digits and dots (``x**-1``), or one
    ``\\command``. One pass, no recursion."""
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] in "{(":
        opener, closer, depth = text[i], "}" if text[i] == "{" else ")", 0
        for j in range(i, len(text)):
            depth += (text[j] == opener) - (text[j] == closer)
            if depth == 0:
                return text[i + 1 : j], j + 1
        return text[i + 1 :], len(text)
    m = _TOKEN.match(text, i)
    return (m.group(), m.end()) if m else ("", i)


def _numeric(text: str) -> bool:
    return not re.search(r"[A-Za-z]", re.sub(r"\\[A-Za-z]+", "", text))


def _base(text: str, i: int) -> str:
    """The bracketed group that ends just before ``text[i]`` (a power's ``^``), without its brackets; ""
    when the base is no group. One pass back."""
    j = i - 1
    while j >= 0 and text[j] == " ":
        j -= 1
    if j < 0 or text[j] not in ")}]":
        return ""
    depth = 0
    for k in range(j, -1, -1):
        depth += (text[k] in ")}]") - (text[k] in "({[")
        if depth == 0:
            return text[k + 1 : j]
    return text[:j]


def costly(answer: str) -> str | None:
    """Why ``answer`` would cost a symbolic checker more than any answer needs, or None. Python's and
    sympy's integers compute ``10^{10^{10}}``, ``(10^6)!`` or ``\\binom{10^5}{5 \\cdot 10^4}`` in full,
    inside single C calls no alarm interrupts; the answer's length is already capped, so these are what
    is left: brackets nested deeper than ``MAX_NESTING``, a tower of numeric powers, an exponent,
    factorial or binomial argument above ``MAX_EXPONENT``, a float exponent of four digits or more."""
    depth = deepest = 0
    for c in answer:
        depth += (c in "([{") - (c in ")]}")
        deepest = max(deepest, depth)
    if deepest > MAX_NESTING:
        return f"brackets nested {deepest} deep"
    if _EXPONENT_DIGITS.search(answer):
        return "a power of ten of four digits or more"
    for m in _POWER.finditer(answer):
        exponent, end = _operand(answer, m.end())
        # 10^{10^{10}}, or Python's right-associative 10**10**10: numbers no integer type holds
        # (10^{9999})^{9999} too: a power of a numeric power multiplies the exponents ((x^2+1)^3 is cheap)
        base = _base(answer, m.start())
        if _numeric(exponent) and (
            _POWER.search(exponent)
            or _THEN_POWER.match(answer, end)
            or (_numeric(base) and _POWER.search(base))
        ):
            return f"a tower of powers ({clip(answer[m.start() :], 30)})"
        if any(int(n) > MAX_EXPONENT for n in _INTEGER.findall(exponent)):
            return f"an exponent over {MAX_EXPONENT:,} ({clip(exponent, 30)})"
    if _LARGE_ARGUMENT.search(answer) and any(int(n) > MAX_EXPONENT for n in _INTEGER.findall(answer)):
        return f"a factorial, binomial, sum or product over a number above {MAX_EXPONENT:,}"
    return None


class _OutOfTime(BaseException):
    """Raised by the timer inside math-verify; a BaseException so that no ``except Exception`` in sympy
    or math-verify swallows it and carries on."""


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Interrupt the block after ``seconds`` of this process's CPU time with :class:`_OutOfTime`. CPU
    time, not wall time: on a busy node a cheap check may wait seconds for a core, and must not score 0
    for it (the reward runner's per-task timeout bounds the wait). A timer signal only reaches a
    process's main thread; elsewhere (a threaded actor, a thread pool) the block runs without it, and
    :func:`costly` and the runner's timeout are the bound."""
    if threading.current_thread() is not threading.main_thread() or not seconds or seconds <= 0:
        yield
        return

    def expire(signum, frame):
        raise _OutOfTime

    previous = signal.signal(signal.SIGPROF, expire)
    outer = signal.setitimer(signal.ITIMER_PROF, seconds)[0]
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)
        if outer:  # an enclosing timer keeps running (less the time spent here)
            signal.setitimer(signal.ITIMER_PROF, max(outer - seconds, 1e-3))


@register("math")
def math_reward(
    ground_truth: Any, response: str, *, question: str | None = None, timeout_seconds: float = 0.5
) -> Score:
    """1.0 when the response's final answer is mathematically equal to ``ground_truth`` (plain or LaTeX)."""
    try:
        gt = _gold(ground_truth)
        if not gt:
            return Score(0.0, False, None, "the ground truth is empty")
        gold_number = _gold_number(gt, ground_truth)
        ranged = gold_number is None and any((_RELATION.search(gt), _INTERVAL.match(gt), _UNION.search(gt)))
        listed = gold_number is None and (several_values(gt) or ranged)
        equation = gold_number is None and re.search(r"(?<![<>!=\\])=(?!=)", gt) is not None
        final = final_answer(response, join_boxes=listed, equation=equation)
        if final.answer is None:
            return Score(0.0, False, None, final.source)
        answer = final.answer
        if lookalike_digits(answer):
            return _wrong(final, why_not_a_number(answer))
        if question and restates(answer, question, gt):
            return _wrong(final, "restates the question instead of answering it")
        if gold_number is not None:  # exact: 0.5 == 1/2, and 13+7 is not a number
            value = _stated(answer)
            if value is not None and value != gold_number and _approximates(value, gold_number):
                return _right(final)
            return _compare_numbers(final, gold_number, value, question)
        if several_values(answer) and not listed:
            return _wrong(final, "several candidate values")
        if _same_form(answer, gt):  # written as the ground truth is: right, whatever sympy makes of it
            return _right(final)
        return _verify(final, gt, timeout_seconds, ranged)
    except Exception as e:  # a reward never takes a run down
        log.debug("math reward failed", exc_info=True)
        return Score(0.0, False, None, f"math reward error: {type(e).__name__}")


def _same_form(answer: str, gt: str) -> bool:
    def form(s: str) -> str:
        s = re.sub(r"\\(?:left|right|displaystyle|[,;:! ])", "", fold(s))
        return re.sub(r"\\[dtc]frac(?![A-Za-z])", r"\\frac", re.sub(r"[\s$]", "", s))

    return form(answer) == form(gt)


_WARM = threading.Lock()
_warmed = False


def warm_up() -> None:
    """Parse and compare once, outside any time limit: a process's first parse builds math-verify's LaTeX
    parser (0.35-0.7 s of CPU measured on a 2-core EPYC), which the first answer's limit of 0.5 s must not pay.
    Charged to that answer, it scored an honest one 0 (an interval against its inequality: the first check in
    each reward process). Once per process; later calls return at once."""
    global _warmed
    if _warmed:
        return
    with _WARM:
        if _warmed:
            return
        import math_verify.grader
        import math_verify.parser
        from math_verify import LatexExtractionConfig, parse, verify

        math_verify.parser.TIMEOUT_WARNING_SHOWN = math_verify.grader.TIMEOUT_WARNING_SHOWN = (
            True  # _verify's
        )
        config = [LatexExtractionConfig(boxed_match_priority=-1)]
        try:
            for gold, given in (("$x > 2$", "$(2, \\infty)$"), ("$\\frac{1}{2}$", "$0.5$")):
                a = parse(gold, extraction_config=config, parsing_timeout=None)
                b = parse(given, extraction_config=config, parsing_timeout=None, fallback_mode="no_fallback")
                verify(a, b, timeout_seconds=None, allow_set_relation_comp=True)
        except Exception:  # a warm-up that fails leaves the first real check to find out why
            log.debug("math reward: warm-up failed", exc_info=True)
        _warmed = True


def _verify(final: Final, gt: str, timeout_seconds: float, ranged: bool) -> Score:
    import math_verify.grader
    import math_verify.parser
    from math_verify import LatexExtractionConfig, parse, verify

    if final.answer is None:  # callers judge only a found answer
        return _wrong(final, "no answer")
    given = final.answer
    why = costly(given)
    if why:
        return _wrong(final, f"{why}: not checked")
    # The time limit is ours, around parsing and comparing together (math-verify's own takes whole
    # seconds, each); its warning that it has none would only alarm a reader.
    math_verify.parser.TIMEOUT_WARNING_SHOWN = math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    warm_up()  # the parser's start-up, outside the limit
    # Both strings are already the answer alone: parse each as one inline formula, no box to look for.
    config = [LatexExtractionConfig(boxed_match_priority=-1)]

    def formula(s: str) -> str:
        return "$" + " ".join(python_powers(s).replace("$", " ").split()) + "$"

    def piece(s: str) -> list:  # an answer, or one piece of either: nothing when it does not parse
        return parse(formula(s), extraction_config=config, parsing_timeout=None, fallback_mode="no_fallback")

    try:
        with _time_limit(timeout_seconds):
            gold = parse(formula(gt), extraction_config=config, parsing_timeout=None)
            if not gold:
                log.debug("math reward: cannot parse ground truth %r", gt)
                return _wrong(final, f"cannot parse the ground truth {gt!r}")
            # A union or intersection written with words is judged as the set it is; the rest by
            # math-verify, where an interval answers an inequality and back (0 < x < 1 is x in (0, 1)).
            joined = _joined_sets(gt, given, piece) if ranged else None
            if joined is not None:
                equal = joined
            else:
                answer = piece(given)
                if not answer:
                    return _wrong(final, "cannot parse the answer")
                equal = verify(gold, answer, timeout_seconds=None, allow_set_relation_comp=ranged)
    except _OutOfTime:
        return _wrong(final, f"not checked within {timeout_seconds:g} s of CPU")
    return _right(final) if equal else _wrong(final, f"not equal to {clip(gt, 60)}")


# -- a set written as inequalities joined by "or"/"and": judged as the set it is ------------------------

# math-verify reads "x < -2 \text{ or } x > 3", "x < -2 \text{ and } x > 3" and "x < -2, x > 3" all as one list
# {x < -2, x > 3}: a list is neither the union (-oo, -2) U (3, oo) it means, so an honest "or" scored 0 against
# the union, nor different from the intersection (empty) an "and" means, so "and" scored 1 against "or".
_CONNECTIVE = re.compile(
    r"\\(?:text|textrm|textnormal|textup|mathrm|mbox|operatorname)\s*\{\s*(or|and)\s*\}"
    r"|\\(lor|vee|land|wedge)(?![A-Za-z])"
    r"|(?<![A-Za-z\\])(or|and)(?![A-Za-z])"
)
_OR = {"or", "lor", "vee"}
_SPACING = re.compile(
    r"^(?:\s|,|\\(?:quad|qquad|[,;:! ])(?![A-Za-z])|~)+|(?:\s|,|\\(?:quad|qquad|[,;:! ])(?![A-Za-z])|~)+$"
)
MAX_JOINED = 8  # pieces one answer may join; more is no answer anyone writes, and each costs a parse


def _pieces(text: str) -> tuple[str | None, list[str]]:
    """``text`` cut at its "or"/"and" connectives outside brackets: the connective ("or", "and", or None
    when there is none, or when both are mixed and the grouping is unsaid) and the pieces, spacing and
    commas trimmed. One pass for the depths; at most ``MAX_JOINED`` pieces, else none."""
    depth, depths = 0, []
    for c in text:
        depths.append(depth)
        depth += (c in "([{") - (c in ")]}")
    cuts = [m for m in _CONNECTIVE.finditer(text) if depths[m.start()] == 0]
    if not cuts:
        return None, [text]
    kinds = {"or" if (m.group(1) or m.group(2) or m.group(3)) in _OR else "and" for m in cuts}
    if len(kinds) > 1 or len(cuts) >= MAX_JOINED:
        return None, []
    bounds = [0] + [i for m in cuts for i in (m.start(), m.end())] + [len(text)]
    return kinds.pop(), [_SPACING.sub("", text[a:b]) for a, b in zip(bounds[::2], bounds[1::2])]


def _as_set(parsed: Any) -> tuple[Any, Any] | None:
    """What one parsed piece says about a real variable, as (variable or None, set of reals), or None when
    it says anything else: an interval, a union of intervals or a set of numbers (no variable); ``x \\in
    S``; a solved relation or chain of them, the variable on one side and a number on the other (``x > 3``,
    ``-2 > x``, ``0 < x \\le 1``, ``x = -2``, ``x \\neq 1``). An unsolved one (``(x+2)(x-3) > 0``) is the
    question, not its answer, and is left to math-verify like any other."""
    from math_verify.grader import unwrap_fcs
    from sympy import And, Eq, FiniteSet, Set, Symbol
    from sympy.core.relational import Relational

    if isinstance(parsed, Eq) and isinstance(parsed.rhs, Set):  # x \in S (0 < f(x) is about one unknown, f_x)
        parsed, variable = parsed.rhs, unwrap_fcs(parsed.lhs)
        if not isinstance(variable, Symbol):
            return None
    elif isinstance(parsed, (Relational, And)):
        parsed = unwrap_fcs(parsed)
        relations = parsed.args if isinstance(parsed, And) else (parsed,)
        if len(parsed.free_symbols) != 1 or not all(isinstance(r, Relational) for r in relations):
            return None
        variable = next(iter(parsed.free_symbols))
        if not all(_solved(r, variable) for r in relations):
            return None
        return variable, parsed.as_set()
    else:
        variable = None
    if not isinstance(parsed, Set) or parsed.free_symbols:  # (a, \\infty) is no set of numbers
        return None
    if isinstance(parsed, FiniteSet) and not all(getattr(e, "is_number", False) for e in parsed.args):
        return None  # a list of relations or of intervals is not a set of numbers
    return variable, parsed


def _solved(relation: Any, variable: Any) -> bool:
    """``relation`` has ``variable`` alone on one side and a number on the other."""
    sides = (relation.lhs, relation.rhs)
    return variable in sides and all(side == variable or not side.free_symbols for side in sides)


def _set_of(text: str, read) -> tuple[str | None, Any, Any] | None:
    """``text`` as (its connective, its variable, the set of reals it describes), each piece parsed by
    ``read``; None when some piece is not a set of one variable (the text is judged by math-verify)."""
    from sympy import FiniteSet, Intersection, Union

    kind, pieces = _pieces(text)
    read_pieces = []
    for piece in pieces:
        parsed = read(piece) if piece else None
        one = _as_set(parsed[0]) if parsed else None
        if one is None:
            return None
        read_pieces.append(one)
    variables = {v for v, _ in read_pieces if v is not None}
    if not read_pieces or len(variables) > 1:
        return None
    sets = [s for _, s in read_pieces]
    if kind == "and" and all(isinstance(s, FiniteSet) and len(s) == 1 for s in sets):
        return None  # "x = 1 and x = 2" lists two solutions, as people write them: math-verify reads a list
    joined = Intersection(*sets) if kind == "and" else Union(*sets)
    return kind, (variables.pop() if variables else None), joined


def _same_set(a: Any, b: Any) -> bool:
    """Equal sets of reals: the same canonical form, or an empty symmetric difference (0.5 and 1/2 as ends)."""
    if a == b:
        return True
    try:
        return a.symmetric_difference(b).is_empty is True
    except Exception:  # sympy could not decide: not shown equal
        return False


def _joined_sets(gt: str, given: str, read) -> bool | None:
    """Whether ``given`` describes the set ``gt`` does, when either joins pieces with "or" or "and" and both
    read as one variable's set of reals (``x < -2 \\text{ or } x > 3`` is (-oo, -2) U (3, oo), "and" the
    intersection); None otherwise, for math-verify to judge. Not judged here either: two sides that name
    different variables (math-verify tells ``x > 2`` from ``t > 2``), and a side that is a few points
    (``x = 1 \\text{ or } x = 2``: a list of values, which math-verify compares by its own rules, ``(1, 2)``
    being a pair as well as an interval)."""
    from sympy import FiniteSet

    if _CONNECTIVE.search(gt) is None and _CONNECTIVE.search(given) is None:
        return None
    gold, answer = _set_of(gt, read), _set_of(given, read)
    if gold is None or answer is None or (gold[0] is None and answer[0] is None):
        return None
    if gold[1] is not None and answer[1] is not None and gold[1] != answer[1]:
        return None
    if isinstance(gold[2], FiniteSet) or isinstance(answer[2], FiniteSet):
        return None
    return _same_set(gold[2], answer[2])


_PYTHON_POWER = re.compile(r"\*\*\s*")


def python_powers(text: str) -> str:
    """``text`` with Python's ``**`` written as LaTeX's ``^{...}`` (``x**(3/2)`` is ``x^{(3/2)}``,
    ``x**-1`` is ``x^{-1}``), which math-verify reads; one pass over the text."""
    out, pos = [], 0
    for m in _PYTHON_POWER.finditer(text):
        exponent, end = _operand(text, m.end())
        if m.start() < pos or not exponent:
            continue
        if text[m.end()] == "(":  # kept: x**(3/2) is x^{(3/2)}
            exponent = f"({exponent})"
        out.append(text[pos : m.start()] + "^{" + exponent + "}")
        pos = end
    return "".join(out) + text[pos:]


# -- gsm8k and arithmetic: one number ----------------------------------------------------------------


@register("gsm8k")
def gsm8k_reward(ground_truth: Any, response: str, *, question: str | None = None) -> Score:
    """1.0 when the response's final answer is one number equal to ``ground_truth`` (``"1,234"`` is 1234)."""
    try:
        # a dataset may write its answer in math mode ($244/607$) or as a program prints a float (3.05e-05)
        gold = parse_number(clean(fold(ground_truth)), reduced=False, scientific=True)
        if gold is None:
            return Score(
                0.0, False, None, f"the ground truth {clip(str(ground_truth), 40)!r} is not a number"
            )
        final = final_answer(response)
        if final.answer is None:
            return Score(0.0, False, None, final.source)
        return _compare_numbers(final, gold, parse_number(final.answer, scientific=True), question)
    except Exception as e:  # a reward never takes a run down
        log.debug("gsm8k reward failed", exc_info=True)
        return Score(0.0, False, None, f"gsm8k reward error: {type(e).__name__}")


@register("arithmetic")
def arithmetic_reward(
    ground_truth: Any, response: str, *, unboxed_score: float = 1.0, question: str | None = None
) -> Score:
    """1.0 when the final answer is one plain number (``20``, ``-3``, ``1,200``, ``20.0``) equal to
    ``ground_truth``; ``13+7`` is the question restated, not its value. A right number the response ends
    on outside a ``\\boxed{}`` (``13 + 7 = 20``) scores ``unboxed_score``: 1.0 by default (cpu-demo), 0.0
    to take only a boxed answer, 0.5 for half credit; only a score of 1.0 counts as correct."""
    try:
        gold = parse_number(str(ground_truth), fractions=False, decorations=False)
        if gold is None:
            return Score(
                0.0, False, None, f"the ground truth {clip(str(ground_truth), 40)!r} is not a number"
            )
        final = final_answer(response)
        if final.answer is None:
            return Score(0.0, False, None, final.source)
        value = parse_number(final.answer, fractions=False, decorations=False, plain=True)
        score = _compare_numbers(final, gold, value, question)
        if score.correct and final.source == "after '='" and (other := another_question(response, question)):
            return Score(0.0, False, score.answer, f"after '=': {other}")
        if score.correct and final.source != BOXED and unboxed_score != 1.0:
            s = float(unboxed_score)
            return Score(
                s, s >= 1.0, score.answer, f"{final.source}: right, but not in \\boxed{{}} (scores {s:g})"
            )
        return score
    except Exception as e:  # a reward never takes a run down
        log.debug("arithmetic reward failed", exc_info=True)
        return Score(0.0, False, None, f"arithmetic reward error: {type(e).__name__}")


_EXPRESSION = re.compile(r"[0-9][0-9 \t+\-*/×().]*[0-9)]")  # digits joined by operators, brackets, spaces
_LEFT_SIDE = re.compile(r"[0-9 \t+\-*/×().]+$")  # the arithmetic an equation's left side ends in
_OPERATION = re.compile(r"[0-9)][ \t]*[-+*/×][ \t]*[-(]*[0-9]")


_WORKED = re.compile(r"[ \t]*=[ \t]*[-(]*[0-9]")  # follows an expression equated to a number


def _asked(text: str) -> str | None:
    """The arithmetic expression a question asks: its last that holds an operation (``13+7``, ``3 - (-2)``)
    and that the question does not itself equate to a number. ``5 + 1 = 6`` is a worked example, whether
    the examples come before the question or after it (``13 + 7 = ?`` then ``5 + 1 = 6``: cpu-gemma3's
    prompt, where the last expression alone named a worked sum and every right answer was refused)."""
    found = [m for m in _EXPRESSION.finditer(text) if _OPERATION.search(m.group())]
    open_ = [m for m in found if not _WORKED.match(text, m.end())]
    return (open_ or found)[-1].group() if found else None


def another_question(response: Any, question: str | None) -> str | None:
    """Why a response whose answer closes an equation answers another question, else None: the equation's
    left side ends in arithmetic (digits, operators, brackets: what stands just before the line's first
    ``=``) that is not the expression the question asks (the last it leaves open, up to spacing, brackets and
    the order of a sum's terms).

    Only the final answer's value was compared before, and a base model trained on one-digit sums
    (experiment cpu-gemma3) learned to write one line whatever it was asked, paid whenever the sum was its
    value: ``2 - 1 = 1``, then ``+ 2 = 2`` and ``0 = 1``. The working that leads to the question's value
    (``13 + 7 = 10 + 10 = 20``) still counts, and so does a left side without arithmetic (``x = 20``)."""
    asked = _asked(question or "")
    if asked is None:
        return None
    line = next((ln for ln in reversed(fold(str(response)).splitlines()) if "=" in ln), "")
    said = _LEFT_SIDE.search(line.split("=", 1)[0].rstrip())
    if said is None or not re.search(r"[0-9]", said.group()) or same_expression(said.group(), asked):
        return None
    return f"the equation {clip(said.group().strip(), 30)!r} = ... is not the question's {asked.strip()!r}"


# -- format and exact match ----------------------------------------------------------------------


@register("format")
def format_reward(
    ground_truth: Any, response: str, *, think_tag: str = "think", answer_tag: str = "answer"
) -> Score:
    """1.0 for a non-empty ``<think>...</think>`` then a non-empty ``<answer>...</answer>``, only
    whitespace around them; the answer reported is the ``<answer>`` content."""
    try:
        t, a = re.escape(think_tag), re.escape(answer_tag)
        # each body may not open or close its own tag again: one think block, one answer block
        pattern = rf"\s*<{t}>((?:(?!</?{t}>).)*)</{t}>\s*<{a}>((?:(?!</?{a}>).)*)</{a}>\s*"
        m = re.fullmatch(pattern, "" if response is None else str(response), flags=re.DOTALL)
        if m is None:
            return Score(
                0.0, False, None, f"not <{think_tag}>...</{think_tag}><{answer_tag}>...</{answer_tag}> alone"
            )
        think, answer = m.group(1).strip(), m.group(2).strip()
        if not think or not answer:
            return Score(
                0.0, False, clip(answer) or None, f"empty <{think_tag if not think else answer_tag}>"
            )
        return Score(1.0, True, clip(answer), f"<{answer_tag}>")
    except Exception as e:  # a reward never takes a run down
        return Score(0.0, False, None, f"format reward error: {type(e).__name__}")


def _alnum(text: str) -> str:
    # NFC and full-width folding only: NFKC would read the look-alikes "𝐜𝐚𝐭" and "x²" as "cat" and "x2"
    return "".join(c for c in fold(text).lower() if c.isalnum())


@register("exact_alnum")
def exact_alnum_reward(ground_truth: Any, response: str, *, answer_tag: str = "answer") -> Score:
    """1.0 when the answer equals ``ground_truth`` up to case, spacing and punctuation."""
    try:
        text = "" if response is None else str(response)
        blocks = tag_blocks(text, answer_tag)
        if len({_alnum(b) for b in blocks}) > 1:
            return Score(0.0, False, clip(blocks[-1].strip()), f"several <{answer_tag}> blocks that disagree")
        answer = blocks[-1] if blocks else text
        source = f"<{answer_tag}>" if blocks else "the whole response"
        gold = _alnum(str(ground_truth))
        if not gold:  # an empty ground truth matches nothing
            return Score(0.0, False, clip(answer.strip()), "the ground truth has no letters or digits")
        if _alnum(answer) != gold:
            return Score(
                0.0, False, clip(answer.strip()) or None, f"{source}: not {clip(str(ground_truth), 40)!r}"
            )
        return Score(1.0, True, clip(answer.strip()), source)
    except Exception as e:  # a reward never takes a run down
        return Score(0.0, False, None, f"exact_alnum reward error: {type(e).__name__}")
