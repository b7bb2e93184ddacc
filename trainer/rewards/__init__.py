"""Verifiable rewards: ``trainer.rewards.get(name)`` returns ``fn(ground_truth, response, **kw) -> Score``.

A :class:`Score` unpacks as ``(value, correct)`` and carries the answer the reward judged; user rewards
may return a plain number or a pair too (:mod:`trainer.rewards.registry`). What the built-in math rewards
accept as an answer is one rule, in :mod:`trainer.rewards.answer`.

Every module in this package is imported once so that its ``@register`` decorators run; a new
built-in reward needs only a new module here.
"""

import importlib
import pkgutil

from trainer.rewards.registry import RewardFn, Score, as_score, call, check, check_specs, get, names, register

for _m in pkgutil.iter_modules(__path__):
    if _m.name not in {"registry", "runner"} and not _m.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_m.name}")

__all__ = ["RewardFn", "Score", "as_score", "call", "check", "check_specs", "get", "names", "register"]
