"""A run's optional parts as components: the run starts, waits for, describes and shuts down each one without
naming it, so a new scorer, environment or service touches only its own package and its own config section.

A config section says which components it configures in a class variable, ``components``: the paths
(``package.module:factory``) of their factories. :func:`build` walks the run's config, section by section in
field order, and calls each factory with the whole config; a factory returns its component, or None when the
run does not use it (no entry of ``env.reward_functions`` names its reward, its section is unset). Adding a
component is a package with a factory and a section that names it; nothing else changes.

The life of a component (:class:`Component`), as the run drives it (:mod:`trainer.run`):

1. ``check()`` before Ray or any model starts (:func:`trainer.prestart.check_names`, also run by
   ``python -m trainer --cfg``): what can be checked from the config and the files it names, each failure one
   line naming the key (a :class:`~trainer.config.ConfigError`).
2. ``start()`` once Ray is up, right after the policy ranks start: actors launch, nothing is waited for.
3. ``wait_ready()`` once the generation engines are made; then ``describe()``'s line (None: none) joins the
   start-up banner.
4. ``shutdown(graceful)`` at the end, or at once (``graceful=False``) after a failure.

What a component may also offer the run, found by attribute (each optional):

- ``scorer``: a model-scored reward's replicas (:class:`trainer.rewards.actors.ModelPool`), which the reward
  runner sends each chunk of samples to; read after ``start()``.
- ``examples(max_examples)`` and ``tools()``: the run's prompts come from it, not from ``data.name`` (at most one
  component may offer them); ``tools()`` are offered in every prompt.
- ``attach(served)``: the run's OpenAI-compatible endpoints (:class:`Served`), once the generation engines serve
  them: for a component that drives its own rollouts through them.

:mod:`trainer.tools.plan` counts what a component holds in memory by the planner its section names in the same
way (a class variable ``plans``: ``module:function``, called with the config, None when the run does not use it). This module imports no component: the factories are imported when a config names them.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

FACTORIES = "components"  # the class variable of a config section that names its components' factories
PLANNERS = "plans"  # and the one that names what the memory plan counts for them (trainer.tools.plan)


@runtime_checkable
class Component(Protocol):
    """An optional part of a run (see the module docstring for its life and what else it may offer)."""

    name: str  # what people call it, in lines about it: "reward model", "judge", "verifiers environment"

    def check(self) -> None: ...

    def start(self) -> None: ...

    def wait_ready(self) -> None: ...

    def describe(self) -> str | None: ...

    def shutdown(self, graceful: bool = True) -> None: ...


class Base:
    """A component's defaults: nothing to check, start or wait for; no banner line; nothing to shut down."""

    name = "component"

    def check(self) -> None:
        return None

    def start(self) -> None:
        return None

    def wait_ready(self) -> None:
        return None

    def describe(self) -> str | None:
        return None

    def shutdown(self, graceful: bool = True) -> None:
        return None


@dataclasses.dataclass(frozen=True)
class Served:
    """The run's OpenAI-compatible endpoints, as a component that drives rollouts through them needs them."""

    urls: list[str]  # one per engine that serves (http://host:port/v1)
    token: str  # the bearer token they check (generation.endpoint.token_env)
    model: str  # the model name they answer to (model.name)
    max_concurrent: int  # requests one endpoint takes at once without turning any away


def factories(cfg: Any, what: str = FACTORIES) -> Iterator[tuple[str, str]]:
    """``(section key, "module:function")`` for each component a section of ``cfg`` names (``what``: or its
    planner), depth first in the config's field order (so the run starts, describes and checks them in a fixed
    order)."""

    def walk(section: Any, key: str) -> Iterator[tuple[str, str]]:
        for target in getattr(type(section), what, ()):
            yield key, target
        for field in dataclasses.fields(section):
            value = getattr(section, field.name)
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                yield from walk(value, f"{key}.{field.name}" if key else field.name)

    yield from walk(cfg, "")


def resolve(key: str, target: str) -> Callable[[Any], Any]:
    """The function ``target`` (``module:function``) that config section ``key`` names."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def build(cfg: Any) -> list[Component]:
    """The components the run ``cfg`` uses, built (nothing started) in :func:`factories`' order."""
    built = []
    for key, target in factories(cfg):
        component = resolve(key, target)(cfg)
        if component is not None:
            built.append(component)
    return built


def offering(components: list[Component], what: str) -> list[Any]:
    """The components that offer ``what`` (an attribute: "examples", "attach", "scorer"): typed Any, as what
    they offer is not part of the protocol every component keeps."""
    return [c for c in components if getattr(c, what, None) is not None]


def source(components: list[Component]) -> Any:
    """The component the run's prompts come from (one that offers ``examples``), or None: ``data.name``'s."""
    from trainer.config import ConfigError

    sources = offering(components, "examples")
    if len(sources) > 1:
        raise ConfigError(
            f"{' and '.join(c.name for c in sources)} each bring the run's prompts; configure only one of them"
        )
    return sources[0] if sources else None
