"""Dataset registry.

A dataset loader is ``loader(cfg: DataConfig, split: str) -> list[Example]`` where an ``Example`` is a
dict with at least:

- ``"messages"``: the chat messages of the prompt (list of ``{"role", "content"}``), rendered later
  with the tokenizer's chat template;
- ``"ground_truth"``: whatever the rewards need (a string answer, or a dict of tests for code);
- ``"id"``: a stable identifier for logs.

Loaders register with :func:`register`; :func:`get` resolves a name, and an unknown name lists the
valid ones. :func:`check` is the same test as a one-line ConfigError naming the key (``data.name``),
for the driver to run before it loads anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainer.config import check_name

Example = dict[str, Any]
Loader = Callable[..., list[Example]]

_REGISTRY: dict[str, Loader] = {}


def register(name: str) -> Callable[[Loader], Loader]:
    def deco(fn: Loader) -> Loader:
        _REGISTRY[name] = fn
        return fn

    return deco


def names() -> list[str]:
    return sorted(_REGISTRY)


def get(name: str) -> Loader:
    if name not in _REGISTRY:
        raise KeyError(f"unknown dataset {name!r}; registered: {', '.join(names())}")
    return _REGISTRY[name]


def check(name: str | None, key: str = "data.name") -> None:
    """A registered dataset (or None, for an optional key such as data.val_name); else a ConfigError
    naming ``key``."""
    if name is not None:
        check_name(key, name, names())
