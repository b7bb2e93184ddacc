"""Verifiable rewards: ``trainer.rewards.get(name)`` returns ``fn(ground_truth, response, **kw) -> (float, bool)``.

Every module in this package is imported once so that its ``@register`` decorators run; a new
built-in reward needs only a new module here.
"""

import importlib
import pkgutil

from trainer.rewards.registry import RewardFn, check, check_specs, get, names, register

for _m in pkgutil.iter_modules(__path__):
    if _m.name not in {"registry", "runner"} and not _m.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_m.name}")

__all__ = ["RewardFn", "check", "check_specs", "get", "names", "register"]
