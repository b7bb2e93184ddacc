"""Datasets: ``trainer.data.get(name)(cfg, split)`` returns a list of examples (see ``registry``).

Every module in this package is imported once so that its ``@register`` decorators run.
"""

import importlib
import pkgutil

from trainer.data.registry import Example, check, get, names, register

for _m in pkgutil.iter_modules(__path__):
    if _m.name not in {"registry"} and not _m.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_m.name}")

__all__ = ["Example", "check", "get", "names", "register"]
