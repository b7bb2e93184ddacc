"""What answers the model between its turns: a multi-turn environment.

An :class:`Environment` is built once per run from ``env.environment`` and ``env.environment_kwargs``
(:func:`trainer.envs.build`). For each sample of a batch the rollout loop opens an :class:`Episode` on the
sample's dataset example and, after every model turn, hands it the turn's text; the :class:`Step` it
returns says what is appended to the conversation (tool results, feedback as a user turn) and whether the
episode ends there. The loop renders those messages through the chat template's own markers and appends
their tokens, never re-tokenising what the model wrote (:class:`trainer.data.prompts.TurnEncoder`).

An episode is bounded in time by its environment and fails into a message or a ``Step(done=True)``:
nothing the model writes may crash the run or hang it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


# fmt: off
@dataclass
class Step:
    """What the environment says after one model turn."""
    messages: list[dict[str, Any]]  # chat messages appended after the model's turn (role "tool" or "user"); [] when done
    done: bool                       # the episode ends here: the model answered, or the environment ended it
    reward: float | None = None      # an environment that scores its own episodes: the episode's reward, set when done
    info: dict[str, float] = field(default_factory=dict)  # counters summed per step into metrics: tool_calls, tool_errors, tool_s
# fmt: on


class Episode(Protocol):
    def step(self, text: str) -> Step:
        """The model's turn (its sampled tokens decoded, special tokens skipped) -> the environment's answer.
        Bounded in time by the environment; fails into a message or a Step(done=True), never raises for bad model output."""
        ...

    def close(self) -> None: ...


class Environment(Protocol):
    name: str

    def tools(self) -> list[dict[str, Any]] | None:
        """JSON schemas (OpenAI function format) offered through the chat template's tools=, or None."""
        ...

    def episode(self, example: dict[str, Any]) -> Episode:
        """A new episode for one dataset example (its messages, ground_truth, ...)."""
        ...
