"""Scoring rollouts off the driver: one Ray task per sample, bounded in number and in time.

Each task runs every configured reward function on one response and combines them by weight. An
item is ``(ground_truth, response)`` or ``(ground_truth, response, question)``: the question (the
prompt's last user turn) goes to the rewards that declare a ``question`` parameter. The result keeps
the answer the run's first positively weighted reward judged, and its note, for the jsonl and the
console (``extracted_answer``). A reward that raises gives that function 0 for the sample and a
warning; a task that outlives ``env.reward_timeout_s`` is cancelled and the whole sample scores 0
with a warning. Neither ever crashes the run. Tasks are spread over the cluster's CPUs, at most
``env.max_concurrent_rewards`` at a time, so reward time scales with nodes.
"""

from __future__ import annotations

import logging
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import ray

from trainer.config import EnvConfig, RewardSpec, check_name

log = logging.getLogger(__name__)


@dataclass
class RewardResult:
    total: float                      # weighted sum over the reward functions
    correct: bool                     # every function with a positive weight said correct
    scores: dict[str, float] = field(default_factory=dict)  # per function name
    warnings: list[str] = field(default_factory=list)
    feedback: str | None = None       # multi-turn only: the environment's next user turn
    answer: str | None = None         # what the first positively weighted reward judged (None: nothing)
    answer_note: str = ""             # where that answer came from, or why there is none or it is wrong


def score_one(
    specs: list[RewardSpec], ground_truth: Any, response: str, question: str | None = None
) -> RewardResult:
    """Run every reward on one response in this process (also used by evaluation and tests)."""
    from trainer import rewards

    result = RewardResult(total=0.0, correct=True)
    reported = False
    for spec in specs:
        try:
            score = rewards.call(rewards.get(spec.name), ground_truth, response, spec.kwargs, question)
        except Exception as e:  # a reward bug must cost one sample, never the run
            tail = traceback.format_exception_only(type(e), e)[-1].strip()
            result.warnings.append(f"reward {spec.name!r} raised {tail}")
            score = rewards.Score(0.0, False, None, f"reward {spec.name!r} raised {tail}")
        result.scores[spec.name] = score.value
        result.total += spec.weight * score.value
        if spec.weight > 0:
            result.correct = result.correct and score.correct
            if not reported:
                result.answer, result.answer_note, reported = score.answer, score.note, True
    return result


def question_of(example: dict) -> str | None:
    """The question a dataset example asks: its last user turn (None when it has no messages)."""
    users = [m.get("content") for m in example.get("messages") or [] if m.get("role") == "user"]
    return users[-1] if users and isinstance(users[-1], str) else None


def _failed(why: str) -> RewardResult:
    return RewardResult(0.0, False, {}, [why], answer_note=why)


def feedback_one(name: str, kwargs: dict, ground_truth: Any, response: str) -> RewardResult:
    """Multi-turn: the next user turn after a failed attempt (``feedback``), or None if it passed."""
    from trainer.rewards import feedback

    try:
        text = feedback.get(name)(ground_truth, response, **kwargs)
    except Exception as e:
        tail = traceback.format_exception_only(type(e), e)[-1].strip()
        return RewardResult(0.0, False, {}, [f"feedback {name!r} raised {tail}"])
    return RewardResult(0.0, text is None, feedback=text)


@ray.remote(num_cpus=1, max_retries=0)
def _score_task(specs: list[RewardSpec], ground_truth: Any, response: str, question: str | None) -> RewardResult:
    return score_one(specs, ground_truth, response, question)


@ray.remote(num_cpus=1, max_retries=0)
def _feedback_task(name: str, kwargs: dict, ground_truth: Any, response: str) -> RewardResult:
    return feedback_one(name, kwargs, ground_truth, response)


class RewardRunner:
    """Scores (ground_truth, response) pairs; with ``feedback=True`` it asks the environment for the
    next turn instead (``RewardResult.feedback``; None when the attempt passed)."""

    def __init__(self, env: EnvConfig, feedback: bool = False):
        from trainer import rewards
        from trainer.rewards.feedback import FEEDBACK

        # Checked here, on the driver: in the tasks a bad name would only cost every sample its score.
        if feedback:
            check_name("env.feedback", env.feedback, sorted(FEEDBACK))
        else:
            rewards.check_specs(env.reward_functions)
        self.env = env
        self.specs = list(env.reward_functions)
        if feedback:
            name, kwargs = env.feedback, dict(env.feedback_kwargs)
            self._task = lambda gt, resp, question: _feedback_task.remote(name, kwargs, gt, resp)
        else:
            self._task = lambda gt, resp, question: _score_task.remote(self.specs, gt, resp, question)
        self._pending: list[tuple[int, tuple]] = []  # (index, (ground truth, response[, question])) not yet sent
        self._running: dict[ray.ObjectRef, tuple[int, float]] = {}  # ref -> (index, start time)
        self._results: dict[int, RewardResult] = {}
        self._next = 0

    def submit(self, items: list[tuple]) -> list[int]:
        """Queue ``(ground_truth, response)`` or ``(ground_truth, response, question)`` items; returns
        their indices for :meth:`results`."""
        ids = list(range(self._next, self._next + len(items)))
        self._next += len(items)
        self._pending.extend(zip(ids, items))
        self._pump()
        return ids

    def _pump(self) -> None:
        while self._pending and len(self._running) < self.env.max_concurrent_rewards:
            i, (gt, resp, *question) = self._pending.pop(0)
            self._running[self._task(gt, resp, question[0] if question else None)] = (i, time.monotonic())

    def poll(self, timeout: float = 0.0) -> None:
        """Collect finished tasks, cancel overdue ones, start queued ones."""
        if self._running:
            done, _ = ray.wait(list(self._running), num_returns=len(self._running), timeout=timeout)
            for ref in done:
                i, _ = self._running.pop(ref)
                try:
                    self._results[i] = ray.get(ref)
                except Exception as e:  # the worker died (e.g. a reward that killed its process)
                    cause = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
                    self._results[i] = _failed(f"reward task failed: {cause}")
            now = time.monotonic()
            for ref, (i, start) in list(self._running.items()):
                if now - start > self.env.reward_timeout_s:
                    ray.cancel(ref, force=True)
                    self._running.pop(ref)
                    self._results[i] = _failed(f"reward timed out after {self.env.reward_timeout_s:g}s")
        self._pump()

    def results(self, ids: list[int]) -> list[RewardResult]:
        """Block until every id has a result (bounded by the timeout), then return them in order."""
        unknown = [i for i in ids if i >= self._next or i < 0]
        if unknown:
            raise KeyError(f"reward ids {unknown[:3]} were not submitted to this runner")
        while any(i not in self._results for i in ids):
            self.poll(timeout=0.05)
        out = [self._results.pop(i) for i in ids]
        for r in out:
            for w in r.warnings:
                log.warning("%s; the sample scores 0 for it", w)
        return out
