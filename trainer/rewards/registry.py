"""Reward registry.

A reward is a plain function ``(ground_truth, response, **kwargs) -> (score: float, is_correct: bool)``.
Built-ins register themselves by name with :func:`register`; anything importable is reachable as
``"package.module:function"`` so users can plug in their own rewards without touching kuberl.
:func:`check` looks a name up as :func:`get` does and says what is wrong in one line naming the key.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol

from trainer.config import ConfigError, RewardSpec


class RewardFn(Protocol):
    def __call__(self, ground_truth: Any, response: str, **kwargs: Any) -> tuple[float, bool]: ...


_REGISTRY: dict[str, RewardFn] = {}


def register(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make ``fn`` reachable as ``trainer.rewards.get(name)``."""

    def deco(fn: RewardFn) -> RewardFn:
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
    raise KeyError(f"unknown reward {name!r}; registered: {', '.join(names())}, or 'module:function'")


def check(name: str, key: str) -> None:
    """``name`` resolves (a registered reward, or an importable ``module:function``); else a ConfigError
    naming ``key``, e.g. ``env.reward_functions[0].name``."""
    try:
        get(name)
    except KeyError as e:
        raise ConfigError(f"{key}: {e.args[0]}") from None


def check_specs(specs: list[RewardSpec]) -> None:
    """Every reward of ``env.reward_functions``."""
    for i, spec in enumerate(specs):
        check(spec.name, f"env.reward_functions[{i}].name")
