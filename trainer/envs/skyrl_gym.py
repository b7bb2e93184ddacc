"""``skyrl_gym``: SkyRL-gym's text environments (PyPI ``skyrl-gym``, the ``envs`` extra) as an Environment.

``env.environment_kwargs``:

- ``env_class``: the id SkyRL-gym registered the environment under (``gsm8k``, ``gsm8k_multi_turn``, ``aime``,
  ``text2sql``, ...; ``skyrl_gym.registry`` lists them);
- ``env_kwargs`` ({}): the environment's ``env_config`` (what skyrl-train reads from
  ``environment.skyrl_gym.<env_class>``: ``db_path`` for ``text2sql``, the search server for ``search``);
- ``extras`` ({}): merged over every example's extras, e.g. ``{max_turns: 3}`` (skyrl-train writes its
  ``generator.max_turns`` there);
- ``step_timeout_s`` (30): the most one ``init`` or ``step`` may take.

Each episode is SkyRL-gym's own: ``skyrl_gym.make(env_class, env_config=..., extras=...)``, then ``init`` with the
example's messages, then ``step(text)`` per model turn, whose observations become the next messages. Its
extras are the example's ``env_extras`` (the columns of a SkyRL dataset row besides its prompt and env class,
as skyrl-train passes them: ``data.name=skyrl_gym``), or, for an example of another dataset, its ground truth as
SkyRL's ``reward_spec``. The episode's reward is the sum of its steps' rewards: skyrl-train places each turn's
reward on that turn's last token and its outcome estimators (GRPO's among them) sum them per trajectory. The
rollout loop does not step the turn at ``grpo.max_rollout_turns``, so that limit must exceed the environment's
own number of turns for the environment to score every episode.

Where the two loops differ, this adapter refuses or says so rather than drift quietly:

- the prompt is rendered from the dataset's messages before the episode opens, so an environment whose
  ``init`` rewrites the prompt (``rlm``) is refused on its first example;
- a ``postprocessed_action`` (the environment rewriting the model's turn) is ignored: the trainer trains on the
  tokens the engine sampled, never on a re-tokenisation (skyrl-train re-tokenises it, with a warning);
- a ``step`` that goes on without observations ends the episode with the rewards so far: a turn needs a message;
- an ``init`` or ``step`` that raises or outlasts ``step_timeout_s`` ends the episode with reward 0 (counted in
  ``Step.info["errors"]``), logged once per environment and kind. It runs on a daemon thread, so one that hangs
  is abandoned, not waited for.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from trainer.config import ConfigError
from trainer.envs.base import Step

log = logging.getLogger(__name__)

INSTALL = "pip install 'kuberl-trainer[envs]'"
_logged: set[tuple[str, str]] = set()  # (env_class, kind): each failure kind is logged once per process


def _log_once(
    env_class: str, kind: str, detail: str, outcome: str = "the episode ends with reward 0"
) -> None:
    if (env_class, kind) not in _logged:
        _logged.add((env_class, kind))
        log.warning("skyrl_gym %r: %s (%s); %s (logged once per kind)", env_class, kind, detail, outcome)


class _Failed(Exception):
    """An environment call that raised or ran out of time: ``kind`` names which, for the log."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


def _bounded(fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """``fn()`` on a daemon thread, waited for at most ``timeout_s``: a hung call is left behind (a thread
    cannot be killed) and the interpreter does not wait for it at exit."""
    result: list[Any] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # the environment's own code: anything it raises ends the episode
            error.append(e)

    thread = threading.Thread(target=run, name=f"skyrl-gym-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise _Failed(f"{what} timed out", f"over {timeout_s:g}s")
    if error:
        e = error[0]
        raise _Failed(f"{what} raised", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return result[0]


def _messages(observations: Any) -> list[dict[str, Any]]:
    """SkyRL's observations (OpenAI-format messages) as the contract's messages; anything else is a failure
    of the environment, not of the model."""
    if not isinstance(observations, list) or not all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in observations
    ):
        raise _Failed("step returned bad observations", f"{str(observations)[:120]!r}")
    return [{"role": m["role"], "content": m["content"]} for m in observations]


class SkyRLEpisode:
    """One SkyRL-gym environment instance, from ``make`` to ``close``."""

    def __init__(self, env: Any, env_class: str, timeout_s: float) -> None:
        self.env, self.env_class, self.timeout_s = env, env_class, timeout_s
        self.total = 0.0  # the sum of the steps' rewards so far
        self.done = False

    def step(self, text: str) -> Step:
        if self.done:  # the environment already ended the episode (or failed): nothing more to score
            return Step(messages=[], done=True, reward=self.total)
        start = time.monotonic()
        try:
            out = _bounded(lambda: self.env.step(text), self.timeout_s, "step")
            if not isinstance(out, Mapping) or "reward" not in out or "done" not in out:
                raise _Failed("step returned no reward/done", f"{str(out)[:120]!r}")
            reward = float(out["reward"])
            if not math.isfinite(reward):
                raise _Failed("step returned a reward that is not finite", repr(reward))
            done = bool(out["done"])
            messages = [] if done else _messages(out.get("observations", []))
            if (
                not done and not messages
            ):  # skyrl-train would let the model go on; here a turn needs a message
                _log_once(
                    self.env_class,
                    "step went on without observations",
                    "the loop has nothing to append",
                    "the episode ends here with the rewards so far",
                )
                done = True
        except (_Failed, TypeError, ValueError) as e:
            kind, detail = (
                (e.kind, e.detail) if isinstance(e, _Failed) else ("step returned a bad reward", str(e))
            )
            _log_once(self.env_class, kind, detail)
            self.done, self.total = True, 0.0
            return Step(messages=[], done=True, reward=0.0, info={"errors": 1.0})
        if out.get("postprocessed_action") not in (None, text):
            _log_once(
                self.env_class,
                "rewrote the model's turn (postprocessed_action)",
                "the sampled tokens are trained on",
                "it is ignored",
            )
        self.total += reward
        self.done = done
        info = {"step_s": time.monotonic() - start}
        return Step(messages=messages, done=done, reward=self.total if done else None, info=info)

    def close(self) -> None:
        self.done = True
        try:
            _bounded(self.env.close, self.timeout_s, "close")
        except _Failed as e:
            _log_once(self.env_class, e.kind, e.detail)


class _DeadEpisode:
    """An episode whose environment failed to start: its first step ends it with reward 0."""

    def step(self, text: str) -> Step:
        return Step(messages=[], done=True, reward=0.0, info={"errors": 1.0})

    def close(self) -> None:
        pass


class SkyRLGym:
    """SkyRL-gym's environment ``env_class``, one instance per episode."""

    name = "skyrl_gym"

    def __init__(
        self,
        env_class: str,
        env_kwargs: Mapping[str, Any] | None = None,
        extras: Mapping[str, Any] | None = None,
        step_timeout_s: float = 30.0,
    ) -> None:
        try:
            import skyrl_gym
        except ImportError:
            raise ConfigError(f"env.environment=skyrl_gym needs the skyrl-gym package: {INSTALL}") from None
        from omegaconf import OmegaConf

        key = "env.environment_kwargs"
        if not isinstance(env_class, str) or env_class not in skyrl_gym.registry:
            raise ConfigError(
                f"{key}.env_class={env_class!r} is not a SkyRL-gym environment; valid: "
                f"{', '.join(sorted(skyrl_gym.registry))}"
            )
        for name, value in (("env_kwargs", env_kwargs), ("extras", extras)):
            if value is not None and not isinstance(value, Mapping):
                raise ConfigError(f"{key}.{name} must be a mapping, got {type(value).__name__}")
        if not isinstance(step_timeout_s, (int, float)) or not step_timeout_s > 0:
            raise ConfigError(f"{key}.step_timeout_s={step_timeout_s!r} must be a number of seconds > 0")
        self.env_class = env_class
        # SkyRL's environments read their config by attribute (env_config.db_path), as skyrl-train's DictConfig
        self.env_config = OmegaConf.create(dict(env_kwargs or {}))
        self.extras = dict(extras or {})
        self.timeout_s = float(step_timeout_s)
        self._make = skyrl_gym.make

    def tools(self) -> list[dict[str, Any]] | None:
        return None  # SkyRL-gym's environments parse their own tags (<sql>, <search>) out of the text

    def env_extras(self, example: Mapping[str, Any]) -> dict[str, Any]:
        """What ``make`` receives as ``extras`` for ``example``: a SkyRL row's own, else its ground truth as
        SkyRL's ``reward_spec``; the configured ``extras`` over either."""
        given = example.get("env_extras")
        if isinstance(given, Mapping):
            extras = dict(given)
        else:
            extras = {
                "reward_spec": {"method": "rule", "ground_truth": example.get("ground_truth")},
                "extra_info": {},
            }
        return {**extras, **self.extras}

    def episode(self, example: dict[str, Any]) -> SkyRLEpisode | _DeadEpisode:
        where = f"example {example.get('id', '?')!r}"
        try:
            env = self._make(self.env_class, env_config=self.env_config, extras=self.env_extras(example))
        except Exception as e:  # SkyRL asserts on missing fields: the data does not fit the environment
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(
                f"env.environment_kwargs.env_class={self.env_class!r} cannot start on {where} of data.name: {first}"
            ) from None
        messages = example["messages"]
        try:
            prompt, _ = _bounded(lambda: env.init([dict(m) for m in messages]), self.timeout_s, "init")
        except _Failed as e:
            _log_once(self.env_class, e.kind, e.detail)
            return _DeadEpisode()
        if [dict(m) for m in prompt] != [dict(m) for m in messages]:
            raise ConfigError(
                f"skyrl_gym {self.env_class!r} rewrites the prompt in init() ({where}); the rollout renders the "
                "dataset's messages, so this environment is not supported"
            )
        return SkyRLEpisode(env, self.env_class, self.timeout_s)
