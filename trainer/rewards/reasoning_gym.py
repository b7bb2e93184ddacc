"""The ``reasoning_gym`` reward: a reasoning-gym task's own scorer on the response's final answer.

The ground truth is what ``data=reasoning_gym`` stores (``{"task", "answer", "metadata"}``); the scorer is
``reasoning_gym.get_score_answer_fn(task)``, given the answer alone, never the whole response. The answer is
the content of the response's last ``<answer>...</answer>`` (what reasoning-gym's prompts ask for), else our
final-answer rule (:func:`trainer.rewards.answer.final_answer`: the last ``\\boxed{}``, "The final answer is
...", the Minerva ending). As for every reward, the answer is taken from that one place: several ``<answer>``
blocks that disagree, or text after the answer that hedges or names another value, leave no answer.

Where it departs from the scorers (each was run against our adversarial table; tests/rewards/
test_reasoning_gym_reward.py): many pay partial credit for an answer that merely contains the right one
(``len(oracle) / len(answer)``: ``-1 or 5`` earns 0.4 for ``-1``), or a small amount for a wrong answer in the
right shape (0.01, 0.05), or 0.1 for the right one in another notation; a policy learns to collect that. Some
pay full marks for more than the answer: ``gsm_symbolic`` reads the first number anywhere (``281 282``),
``time_intervals`` the first duration of a list, ``fraction_simplification`` the first fraction, and
``puzzle24`` any expression worth 24, whatever numbers the puzzle gave. By default the reward is strict
(:func:`refuse`): 1.0 only when the scorer gives full marks to an answer that is one value where the task's
answer is one (one number where it is a number), is not the right answer with more around it, and for
``puzzle24`` uses the puzzle's numbers; else 0. ``partial_credit=True`` pays the scorer's own value instead.

Some scorers run what they are given: sympy's ``parse_expr`` (integration, polynomials, countdown,
puzzle24) and plain ``eval`` (the matrix, queens and string-insertion tasks) evaluate Python, with builtins.
Those get an answer only when it is an arithmetic expression (:func:`safe_expression`: numbers, strings,
single names, a few math functions, lists; no attributes, subscripts or other calls) whose powers are
bounded (no power of a power, an exponent of at most :data:`MAX_EXPONENT`); anything else scores 0 without
reaching the scorer. Every call is bounded: an answer longer than ``MAX_ANSWER_CHARS`` is none, and in a
process's main thread (a Ray task, evaluation) the scorer runs under a ``timeout_seconds`` alarm; elsewhere
the reward runner's per-task timeout is the bound, as for ``math``.
"""

from __future__ import annotations

import ast
import functools
import logging
import re
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from trainer.rewards.answer import (
    BOX,
    MAX_ANSWER_CHARS,
    MAX_RESPONSE_CHARS,
    Final,
    after_reasoning,
    clean,
    clip,
    final_answer,
    parse_number,
    several_values,
    takes_back,
)
from trainer.rewards.registry import Score, register

log = logging.getLogger(__name__)

# Tasks whose scorer evaluates the answer as Python (sympy.parse_expr or eval).
EVALUATES = frozenset(
    {
        "simple_integration", "intermediate_integration", "polynomial_multiplication", "countdown", "puzzle24",
        "string_insertion", "spiral_matrix", "binary_matrix", "n_queens",
    }
)  # fmt: skip
MAX_EXPONENT = 100
# Functions an evaluated answer may call: what integrals and polynomials are written with.
MATH_FUNCTIONS = frozenset(
    "sin cos tan cot sec csc asin acos atan sinh cosh tanh exp log ln sqrt Abs abs atan2 erf".split()
)
_SAFE_NODES = (
    ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Name, ast.Load, ast.List, ast.Tuple, ast.Call,
    ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.USub, ast.UAdd,
)  # fmt: skip
_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def safe_expression(text: str) -> str | None:
    """None when ``text`` may be evaluated (the module docstring's grammar), else why not."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return "not an expression"
    for node in ast.walk(tree):
        if not isinstance(node, _SAFE_NODES):
            return f"{type(node).__name__} in an answer that would be evaluated"
        if isinstance(node, ast.Name) and ("__" in node.id or not node.id.isascii()):
            return f"the name {node.id!r}"
        if isinstance(node, ast.Call) and (
            not isinstance(node.func, ast.Name) or node.func.id not in MATH_FUNCTIONS or node.keywords
        ):
            return "a call other than a math function"
        if isinstance(node, ast.Constant) and not isinstance(node.value, (int, float, str)):
            return f"the constant {node.value!r}"
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            for sub in ast.walk(node.right):
                if isinstance(sub, ast.BinOp) and not isinstance(sub.op, (ast.Add, ast.Sub, ast.Div)):
                    return "an exponent that is a product or a power"
                if isinstance(sub, ast.Constant) and (
                    not isinstance(sub.value, (int, float)) or abs(sub.value) > MAX_EXPONENT
                ):
                    return f"an exponent above {MAX_EXPONENT}"
            if any(isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.Pow) for sub in ast.walk(node.left)):
                return "a power of a power"
    return None


@functools.cache
def scorer(task: str) -> Callable[[str, dict], float]:
    """The task's own scorer (built once per process: it instantiates the task's dataset)."""
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


class _Timeout(Exception):
    pass


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise :class:`_Timeout` after ``seconds`` in the main thread (signals reach no other); elsewhere nothing."""
    if threading.current_thread() is not threading.main_thread() or seconds <= 0:
        yield
        return

    def expire(signum, frame):
        raise _Timeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def extract(response: Any) -> Final:
    """The response's final answer: its last ``<answer>`` block, else :func:`final_answer`'s."""
    text = "" if response is None else str(response)
    if len(text) > MAX_RESPONSE_CHARS:
        return Final(None, f"a response of {len(text)} characters")
    body = after_reasoning(text)
    if body is None:
        return Final(None, "cut off while thinking (no </think>)")
    blocks = list(_TAG.finditer(body))
    if not blocks:
        return final_answer(body)
    contents = {clean(b.group(1)) for b in blocks}
    if len(contents) > 1:
        return Final(None, "several <answer> blocks that disagree")
    content, source = clean(blocks[-1].group(1)), "<answer>"
    if BOX.search(content):  # "<answer>\boxed{5}</answer>": the box inside
        inner = final_answer(content)
        if inner.answer is None:
            return Final(None, f"<answer>: {inner.source}")
        content, source = inner.answer, "<answer> \\boxed{}"
    if not content:
        return Final(None, "empty <answer>")
    if len(content) > MAX_ANSWER_CHARS:
        return Final(None, f"an <answer> of {len(content)} characters")
    after = body[blocks[-1].end() :]
    problem = takes_back(after, content)
    if problem:
        return Final(None, f"{source}: {problem} ({clip(after.strip(), 40)!r})")
    return Final(content, source)


def _squash(text: str) -> str:
    return " ".join(text.split()).casefold()


def refuse(task: str, answer: str, oracle: Any, metadata: dict) -> str | None:
    """Why a strict reward refuses an answer its scorer paid in full (None: it does not)."""
    if not isinstance(oracle, str):
        return None
    oracle = clean(oracle)  # "$\\frac{2}{3}$" is the number 2/3
    if parse_number(oracle, reduced=False) is not None:
        if parse_number(answer, reduced=False) is None:
            return "not a single number"
    elif several_values(answer) and not several_values(oracle):
        return "several candidate values"
    elif _squash(oracle) in _squash(answer) and _squash(oracle) != _squash(answer):
        return "the right answer with more around it"
    if task == "puzzle24" and sorted(int(n) for n in re.findall(r"\d+", answer)) != sorted(
        metadata.get("numbers", [])
    ):
        return "not the puzzle's numbers"
    return None


@register("reasoning_gym")
def reasoning_gym_reward(
    ground_truth: Any, response: str, *, partial_credit: bool = False, timeout_seconds: float = 5.0
) -> Score:
    """The task's scorer on the final answer: 1.0 for its full marks, else 0 (its own value with
    ``partial_credit``)."""
    try:
        if not isinstance(ground_truth, dict) or not {"task", "answer", "metadata"} <= set(ground_truth):
            return Score(
                0.0, False, None, "the ground truth is not a reasoning_gym problem (task, answer, metadata)"
            )
        task = str(ground_truth["task"])
        final = extract(response)
        if final.answer is None:
            return Score(0.0, False, None, final.source)
        answer = final.answer
        shown = clip(answer)
        oracle = ground_truth["answer"]
        # the oracle was written by the task itself: evaluating it is safe
        if task in EVALUATES and answer != oracle and (why := safe_expression(answer)) is not None:
            return Score(0.0, False, shown, f"{final.source}: not scored ({why})")
        entry = {"answer": oracle, "metadata": ground_truth["metadata"]}
        score_answer = scorer(task)  # outside the deadline: a fresh worker's first call imports reasoning-gym
        try:
            with _deadline(timeout_seconds):
                value = float(score_answer(answer, entry))
        except _Timeout:
            return Score(
                0.0, False, shown, f"{final.source}: the {task} scorer ran over {timeout_seconds:g}s"
            )
        if partial_credit:
            return Score(value, value >= 1.0, shown, f"{final.source}: {task} scores {value:g}")
        if value >= 1.0 and (why := refuse(task, answer, oracle, ground_truth["metadata"])) is not None:
            return Score(
                0.0, False, shown, f"{final.source}: {why} (the {task} scorer pays it; partial_credit=False)"
            )
        if value >= 1.0:
            return Score(1.0, True, shown, final.source)
        return Score(0.0, False, shown, f"{final.source}: {task} scores {value:g}, not full marks")
    except Exception as e:  # a reward never takes a run down
        log.debug("reasoning_gym reward failed", exc_info=True)
        return Score(0.0, False, None, f"reasoning_gym reward error: {type(e).__name__}")
