"""Multi-turn environments, by name: ``env.environment`` picks one, ``env.environment_kwargs`` configure it.

Built-ins are registered by module path and imported only when a run names them, so importing this package
never imports an environment's optional dependencies; a user's own is reachable as ``package.module:factory``. A factory is called as ``factory(**kwargs)`` and
checks its kwargs there, with one-line :class:`~trainer.config.ConfigError`s.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

from trainer.config import ConfigError
from trainer.envs.base import Environment, Episode, Step
from trainer.envs.tool_calls import HERMES, ToolCallParser

__all__ = ["ENVIRONMENTS", "Environment", "Episode", "Step", "build", "default", "register"]

ENVIRONMENTS: dict[str, Callable[..., Environment]] = {}
_BUILTIN = {  # name -> "module:factory", imported on first use
    "code_feedback": "trainer.envs.code_feedback:CodeFeedback",
    "tools": "trainer.envs.tools:ToolEnvironment",
    "skyrl_gym": "trainer.envs.skyrl_gym:SkyRLGym",
}


def register(name: str) -> Callable[[Callable[..., Environment]], Callable[..., Environment]]:
    """Decorator: make a factory available as ``env.environment: name``."""

    def add(factory: Callable[..., Environment]) -> Callable[..., Environment]:
        ENVIRONMENTS[name] = factory
        return factory

    return add


def names() -> list[str]:
    return sorted(set(ENVIRONMENTS) | {n for n, target in _BUILTIN.items() if _importable(target)})


def _importable(target: str) -> bool:
    return importlib.util.find_spec(target.split(":")[0]) is not None


def _factory(name: str) -> Callable[..., Environment]:
    if name not in ENVIRONMENTS and name in _BUILTIN and _importable(_BUILTIN[name]):
        module, attr = _BUILTIN[name].split(":")
        ENVIRONMENTS.setdefault(name, getattr(importlib.import_module(module), attr))
    if name not in ENVIRONMENTS and ":" in name:  # a user's own, as "package.module:factory"
        module, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(
                f"env.environment={name!r}: cannot import it ({type(e).__name__}: {e})"
            ) from None
        ENVIRONMENTS[name] = factory
    if name not in ENVIRONMENTS:
        raise ConfigError(
            f"env.environment={name!r} is not an environment; valid: {', '.join(names())}, or package.module:factory"
        )
    return ENVIRONMENTS[name]


def check(name: str) -> None:
    """ConfigError (one line, the valid names) unless ``name`` is a registered environment."""
    _factory(name)


def build(
    name: str,
    kwargs: dict[str, Any],
    tool_parser: str = HERMES,
    parser_for: Callable[[list[dict[str, Any]] | None], ToolCallParser] | None = None,
) -> Environment:
    """The environment ``name`` built with ``kwargs`` (env.environment_kwargs); ConfigError for a bad name.

    ``tool_parser`` is env.tool_parser: any other than the built-in Hermes goes to an environment that reads tool
    calls (one with ``use_tool_parser``), as ``parser_for(its tools)`` (the run builds vLLM's parsers, a layer
    above this one: :func:`trainer.generation.tool_parsers.build`). An environment that reads no tool calls
    refuses it, rather than ignore it."""
    factory = _factory(name)
    try:
        env = factory(**dict(kwargs))
    except TypeError as e:  # an unknown or missing kwarg: say which environment and what it said
        raise ConfigError(f"env.environment_kwargs for {name!r}: {e}") from None
    if tool_parser != HERMES:
        use = getattr(env, "use_tool_parser", None)
        if use is None:
            raise ConfigError(
                f"env.tool_parser={tool_parser}: env.environment={name} reads no tool calls; leave env.tool_parser={HERMES}"
            )
        if parser_for is None:  # a caller's mistake, not the config's
            raise ValueError(f"build(tool_parser={tool_parser!r}) needs parser_for, to build that parser")
        use(parser_for(env.tools()))
    return env


def default(env: Any, max_rollout_turns: int) -> Environment | None:
    """The environment of a multi-turn run that names none (``env.environment`` null): the feedback loop of
    ``env.feedback`` (:class:`~trainer.envs.code_feedback.CodeFeedback`, on a reward runner of its own); a
    single-turn run has none."""
    if max_rollout_turns < 2:
        return None
    from trainer.rewards.runner import RewardRunner

    feedback: Any = _factory("code_feedback")  # the built-in, by name (it registers itself with this package)
    return feedback.from_runner(RewardRunner(env, feedback=True))
