"""What answers the model between its turns: a multi-turn environment.

An :class:`Environment` is built once per run from ``env.environment`` and ``env.environment_kwargs``
(:func:`trainer.envs.build`). For each sample of a batch the rollout loop opens an :class:`Episode` on the
sample's dataset example and, after every model turn, hands it the turn's text; the :class:`Step` it
returns says what is appended to the conversation (tool results, feedback as a user turn) and whether the
episode ends there. The loop renders those messages through the chat template's own markers and appends
their tokens, never re-tokenising what the model wrote (:class:`trainer.data.prompts.TurnEncoder`).

An episode is bounded in time by its environment and fails into a message or a ``Step(done=True)``:
nothing the model writes may crash the run or hang it.

A :class:`RolloutEnvironment` (``env.verifiers``) runs its episodes itself, through the generation endpoint, and hands
back each one's turns (:class:`Turn`) as the endpoint rendered and sampled them; :func:`chain` joins them into one
token-exact sample. The endpoint builds a later turn's prompt from the ids it sampled for the earlier one (tokens in,
tokens out: :mod:`trainer.generation.endpoint`), so each prompt extends the sample however the chat template writes
the model's earlier turns back; a turn whose prompt still does not (the endpoint could not tell which of its samples
the conversation holds) ends the sample, logged once per run and counted in ``turns_dropped``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

log = logging.getLogger(__name__)


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
        """The model's turn (its sampled tokens decoded with special tokens kept, less the token that ended it:
        ``Completion.raw_text``, so a tool-call marker that is a special token reaches the parser) -> the
        environment's answer.
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


# An environment that drives its own episodes (env.verifiers): it talks to the trainer's engines through the
# generation endpoint, one chat request per turn, and hands back each episode's turns as the endpoint sampled them.
# fmt: off
@dataclass
class Turn:
    """One chat request of an episode, as the endpoint answered it."""
    prompt_ids: list[int]      # the ids the endpoint rendered the turn's messages to
    completion_ids: list[int]  # the ids the engine sampled
    logprobs: list[float]      # the engine's logprob of each sampled id
    finish_reason: str         # "stop" (an EOS, a stop string or a tool call) or "length"


@dataclass
class Trajectory:
    """One driven episode: its turns in order, the environment's score and what it counted."""
    turns: list[Turn]
    text: str                   # the last turn's answer as the environment read it (what our rewards judge)
    reward: float | None        # the environment's own score of the episode
    info: dict[str, float] = field(default_factory=dict)  # its metrics, averaged per step into train/verifiers/*
# fmt: on


@dataclass
class Chained:
    """A trajectory as one training sample: the first turn's prompt, then every token after it."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]  # 1 on the engine's tokens, 0 on what the environment's messages rendered to
    response_logprobs: list[float]  # the engine's, 0.0 on the environment's tokens
    turns: int  # the turns in the sample: a turn whose prompt does not extend the sample ends it


def chain(turns: list[Turn]) -> Chained:
    """The turns of one episode as one token-exact sample: each later turn's prompt must begin with the sample so
    far (the previous prompt and its sampled ids), and what follows them there is the environment's (mask 0).
    A turn whose prompt does not (the endpoint rendered the conversation again and the chat template wrote the
    model's earlier turn otherwise than it was sampled: a tool call re-serialised, a ``<think>`` block stripped)
    ends the sample before it: nothing is re-tokenised, and the turns after it are not trained on. The first such
    turn of a run is logged, with where its prompt departs from the sample."""
    if not turns:
        raise ValueError("an episode with no turns cannot be trained on")
    first = turns[0]
    out = Chained(
        list(first.prompt_ids),
        list(first.completion_ids),
        [1] * len(first.completion_ids),
        list(first.logprobs),
        1,
    )
    for k, turn in enumerate(turns[1:], start=2):
        context = out.prompt_ids + out.response_ids
        if turn.prompt_ids[: len(context)] != context:
            _log_dropped(k, len(turns), context, turn.prompt_ids)
            break
        glue = turn.prompt_ids[len(context) :]
        out.response_ids += glue + turn.completion_ids
        out.response_mask += [0] * len(glue) + [1] * len(turn.completion_ids)
        out.response_logprobs += [0.0] * len(glue) + list(turn.logprobs)
        out.turns += 1
    return out


_dropped_logged = False  # a run drops turns in every step once it drops any: one line says why


def _log_dropped(k: int, total: int, context: list[int], prompt: list[int]) -> None:
    global _dropped_logged
    if _dropped_logged:
        return
    _dropped_logged = True
    at = next((i for i, (a, b) in enumerate(zip(context, prompt)) if a != b), min(len(context), len(prompt)))
    log.warning(
        "a driven episode's turn %d of %d is not trained on, nor the %d after it: its prompt departs from the "
        "previous prompt + sampled ids at token %d of %d (the endpoint rendered the model's earlier turn otherwise "
        "than it was sampled, and could not continue from the ids it sampled); train/verifiers/turns_dropped "
        "counts such turns (logged once per run)",
        k,
        total,
        total - k,
        at,
        len(context),
    )


class RolloutEnvironment(Protocol):
    """An environment that runs its episodes itself, through the endpoint (:mod:`trainer.envs.verifiers_env`)."""

    name: str

    def run(self, examples: list[dict[str, Any]], n: int, sampling: dict[str, Any]) -> list[Trajectory]:
        """``n`` episodes per example, group-contiguous (rows [i*n, (i+1)*n) are example i's), sampled with
        ``sampling`` (OpenAI chat arguments: temperature, top_p, max_tokens, stop)."""
        ...
