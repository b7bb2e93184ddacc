"""Dataset registry.

A dataset loader is ``loader(cfg: DataConfig, split: str) -> list[Example]`` where an ``Example`` is a
dict with at least:

- ``"messages"``: the chat messages of the prompt (list of ``{"role", "content"}``), rendered later
  with the tokenizer's chat template;
- ``"ground_truth"``: whatever the rewards need (a string answer, or a dict of tests for code);
- ``"id"``: a stable identifier for logs.

Loaders register with :func:`register`; :func:`get` resolves a name, and an unknown name lists the
valid ones. :func:`check` is the same test as a one-line ConfigError naming the key (``data.name``),
for the driver to run before it loads anything; a loader that registers an ``options`` check (a function
of ``data.options`` that raises ValueError) has it run there too, so a bad option stops the run before Ray
starts rather than when the data loads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainer.config import ConfigError, check_name

Example = dict[str, Any]
Loader = Callable[..., list[Example]]

_REGISTRY: dict[str, Loader] = {}
_OPTION_CHECKS: dict[str, Callable[[Any], None]] = {}


def register(name: str, options: Callable[[Any], None] | None = None) -> Callable[[Loader], Loader]:
    def deco(fn: Loader) -> Loader:
        _REGISTRY[name] = fn
        if options is not None:
            _OPTION_CHECKS[name] = options
        return fn

    return deco


def names() -> list[str]:
    return sorted(_REGISTRY)


def get(name: str) -> Loader:
    if name not in _REGISTRY:
        raise KeyError(f"unknown dataset {name!r}; registered: {', '.join(names())}")
    return _REGISTRY[name]


def check(name: str | None, key: str = "data.name", options: Any = None) -> None:
    """A registered dataset (or None, for an optional key such as data.val_name), and ``options`` its
    option check accepts; else a ConfigError naming ``key`` (the option check's message names its own)."""
    if name is None:
        return
    check_name(key, name, names())
    if options is not None and name in _OPTION_CHECKS:
        try:
            _OPTION_CHECKS[name](options)
        except ValueError as e:
            raise ConfigError(str(e).splitlines()[0]) from None
