"""Reward registry, and what a reward returns.

A reward is a plain function ``(ground_truth, response, **kwargs)`` that returns any of:

- a :class:`Score`: ``(value, correct)`` plus the answer it judged (``.answer``) and a note (``.note``:
  where the answer came from, or why there is none or why it is wrong), so a person can audit what
  was paid for; every built-in returns one;
- ``(value, correct)``, or ``(value, correct, answer)`` / ``(value, correct, answer, note)``;
- a plain number: correct when it is at least 1.0 (full marks), with no answer to report.

A reward that declares a ``question`` parameter also receives the prompt it answers (the last user
turn), e.g. to refuse an answer that only restates the question; the others are called as before.
:func:`call` runs a reward that way and turns whatever it returns into a Score.

Built-ins register themselves by name with :func:`register`; anything importable is reachable as
``"package.module:function"`` so users can plug in their own rewards without touching kuberl.
:func:`check` looks a name up as :func:`get` does and says what is wrong in one line naming the key;
:func:`check_specs` also binds each reward's kwargs to its signature and wants a finite weight, so a
bad entry stops the run at start instead of scoring every sample 0 (or ``nan``) to the end. The entries
``reward_model``, ``llm_judge`` and ``reward_server`` are no functions: the reward model's actors score the first
(:mod:`trainer.rewards.reward_model`), the judge's the second (:mod:`trainer.rewards.judge`), a reward model
served over HTTP the third (:mod:`trainer.rewards.reward_server`).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import numbers
from collections.abc import Callable
from typing import Any, TypeVar

from trainer.config import ConfigError, RewardSpec


class Score(tuple):
    """``(value, correct)``, unpacking and comparing as the pair rewards have always returned, with
    ``.answer`` (what the reward judged; None when it found none) and ``.note`` beside it."""

    answer: str | None
    note: str

    def __new__(cls, value: float, correct: bool, answer: str | None = None, note: str = "") -> Score:
        self = super().__new__(cls, (float(value), bool(correct)))
        self.answer, self.note = answer, note
        return self

    def __getnewargs__(self) -> tuple:  # pickling (Ray) rebuilds it through __new__
        return (self[0], self[1], self.answer, self.note)

    @property
    def value(self) -> float:
        return self[0]

    @property
    def correct(self) -> bool:
        return self[1]

    def __repr__(self) -> str:
        return f"Score({self[0]!r}, {self[1]!r}, answer={self.answer!r}, note={self.note!r})"


# A reward takes (ground_truth, response) and its own keyword arguments, each reward its own names
# (checked against its signature at start: check_kwargs), so the type names only what all share.
RewardFn = Callable[..., "Score | tuple[Any, ...] | float"]
F = TypeVar("F", bound=Callable[..., Any])


def as_score(out: Any) -> Score:
    """What a reward returned, as a Score (see the module docstring); anything else raises TypeError."""
    if isinstance(out, Score):
        return out
    if isinstance(out, numbers.Real):
        return Score(float(out), float(out) >= 1.0)
    if isinstance(out, (tuple, list)) and 1 <= len(out) <= 4:
        value = float(out[0])
        correct = bool(out[1]) if len(out) > 1 else value >= 1.0
        answer = None if len(out) < 3 or out[2] is None else str(out[2])
        return Score(value, correct, answer, str(out[3]) if len(out) > 3 and out[3] is not None else "")
    raise TypeError(f"a reward returned {type(out).__name__}; return a number, (value, correct) or a Score")


def _declares_question(fn: Callable) -> bool:
    try:
        return "question" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C function without a signature
        return False


_declares_question_cached = functools.lru_cache(maxsize=256)(_declares_question)


def takes_question(fn: Callable) -> bool:
    """``fn`` declares a ``question`` parameter (a ``**kwargs`` catch-all does not count)."""
    try:
        return _declares_question_cached(fn)
    except TypeError:  # an unhashable callable object: look at it every time
        return _declares_question(fn)


def call(fn: Callable, ground_truth: Any, response: str, kwargs: dict, question: str | None = None) -> Score:
    """Run one reward on one response, with ``question`` when it takes one, and return a Score."""
    if question is not None and "question" not in kwargs and takes_question(fn):
        kwargs = {**kwargs, "question": question}
    return as_score(fn(ground_truth, response, **kwargs))


_REGISTRY: dict[str, RewardFn] = {}
# The env.reward_functions entry that the reward model's actors score (trainer.rewards.reward_model), not a
# function; check_specs accepts it without kwargs.
REWARD_MODEL = "reward_model"
LLM_JUDGE = "llm_judge"  # the same, for the generative judge's actors (trainer.rewards.judge)
REWARD_SERVER = (
    "reward_server"  # the same, for a reward model served over HTTP (trainer.rewards.reward_server)
)
# Each actor-scored entry and the config section that holds its settings.
MODEL_SCORED = {
    REWARD_MODEL: "reward_model (e.g. reward_model.name)",
    LLM_JUDGE: "judge (e.g. judge.model)",
    REWARD_SERVER: "reward_server (e.g. reward_server.url)",
}


def register(name: str) -> Callable[[F], F]:
    """Decorator: make ``fn`` reachable as ``trainer.rewards.get(name)``; ``fn`` keeps its own signature."""

    def deco(fn: F) -> F:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"reward {name!r} is registered twice")
        _REGISTRY[name] = fn
        return fn

    return deco


def names() -> list[str]:
    return sorted(_REGISTRY)


def get(name: str) -> RewardFn:
    """Look a reward up by registered name or as ``module:function``.

    Raises ``KeyError`` with a message that lists the valid names.
    """
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise KeyError(f"reward {name!r}: cannot import module {module_name!r} ({e})") from None
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise KeyError(f"reward {name!r}: module {module_name!r} has no callable {attr!r}")
        return fn
    raise KeyError(
        f"unknown reward {name!r}; registered: {', '.join(names())}, or 'module:function' (and, in "
        f"env.reward_functions, {' and '.join(MODEL_SCORED)})"
    )


def check(name: str, key: str) -> None:
    """``name`` resolves (a registered reward, or an importable ``module:function``); else a ConfigError
    naming ``key``, e.g. ``env.reward_functions[0].name``."""
    try:
        get(name)
    except KeyError as e:
        raise ConfigError(f"{key}: {e.args[0]}") from None


def check_kwargs(fn: Callable, kwargs: dict, key: str) -> None:
    """``fn(ground_truth, response, **kwargs)`` binds (the run would otherwise score every sample 0 with a
    warning each); else a ConfigError naming ``key`` and the argument, e.g.
    ``env.reward_functions[0].kwargs.bogus``. A reward without a readable signature is taken as it is."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    params = sig.parameters
    name = getattr(fn, "__name__", repr(fn))
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        takes = [
            n for n, p in list(params.items())[2:] if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        for k in kwargs:
            if k not in takes:
                raise ConfigError(
                    f"{key}.{k}: {name}() takes no argument {k!r}; it takes: {', '.join(takes) or 'none'}"
                )
    try:
        sig.bind(None, "", **kwargs)
    except TypeError as e:  # a required argument left out, or too few positional parameters
        raise ConfigError(
            f"{key}: {name}(ground_truth, response, **kwargs) cannot be called with these: {e}"
        ) from None


def check_specs(specs: list[RewardSpec]) -> None:
    """Every reward of ``env.reward_functions``: its name resolves, its kwargs bind to its signature (a
    plug-in's too), and its weight is a finite number; a bad entry is one line naming the index and key."""
    for i, spec in enumerate(specs):
        key = f"env.reward_functions[{i}]"
        if spec.name not in MODEL_SCORED:
            check(spec.name, f"{key}.name")
        if not isinstance(spec.weight, numbers.Real) or not math.isfinite(spec.weight):
            raise ConfigError(
                f"{key}.weight={spec.weight!r} must be a finite number (it multiplies the reward)"
            )
        if spec.name in MODEL_SCORED:  # scored by actors of its own, configured in a section of its own
            if spec.kwargs:
                raise ConfigError(
                    f"{key}.kwargs: the {spec.name} entry takes none; its settings are under "
                    f"{MODEL_SCORED[spec.name]}"
                )
            if sum(s.name == spec.name for s in specs) > 1:
                raise ConfigError(f"{key}: env.reward_functions names {spec.name} twice; keep one entry")
            continue
        check_kwargs(get(spec.name), dict(spec.kwargs or {}), f"{key}.kwargs")
