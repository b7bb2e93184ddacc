"""Scoring rollouts off the driver: Ray tasks bounded in number and in time, each carrying as many
samples as it can score in about :data:`TASK_TARGET_S`.

Every configured reward function runs on each response, combined by weight. An item is
``(ground_truth, response)`` or ``(ground_truth, response, question)``: the question (the prompt's
last user turn) goes to the rewards that declare a ``question`` parameter. The result keeps the
answer the run's first positively weighted reward judged, and its note, for the jsonl and the
console (``extracted_answer``). A reward that raises gives that function 0 for the sample and a
warning. Tasks are spread over the cluster's CPUs, at most ``env.max_concurrent_rewards`` at a time,
so reward time scales with nodes.

How many samples a task carries follows their measured cost: a Ray task costs 1-3 ms of scheduling,
which was 60% of a tiny test step when each of its 256 one-millisecond samples had a task of its own;
a sample that takes seconds (code run in a sandbox) still gets a task to itself, so expensive rewards
keep spreading over the CPUs. Until a cost has been measured, one task of one sample is in flight.
Samples that arrive one at a time (a multi-turn rollout's episodes, as each ends) wait up to :data:`HOLD_S`
for a task's worth while other tasks are in flight.

Nothing a reward does can crash the run, and each sample keeps its own time limit: a task that
runs longer than ``env.reward_timeout_s`` (or whose process dies) is cancelled; alone in its task, the
sample scores 0 with a warning; sharing one, its samples are scored again one per task, so only the one
that hangs or kills its process loses its score (at the cost of up to twice the timeout, once).

The time limit counts from the moment a task starts running, not from its submission: a task is a
streaming generator whose first item says it has started. Before that, it may wait for a CPU that the
cluster's other work holds, or for a worker process to start (seconds of imports on a busy node); a
correct answer must not score 0 for that. When tasks wait, none runs, and none has started or ended
for :data:`START_TIMEOUT_S`, the run stops with one line: no reward can be computed on such a cluster.
(A long queue behind busy CPUs is not that: its tasks start as others end.)

Code rewards run model-written programs. The chart's ``sandbox.enabled`` gives the release a sandbox service (below);
on a cluster of the earlier chart, with a sandbox group of Ray workers (``KUBERL_SANDBOX_RESOURCE`` on every Ray
container names the group's Ray resource),
every task of a run with a code reward asks for one unit of it, so the programs run only on the
sandbox nodes, never beside the GPUs, and compile in parallel over that group's CPUs. A run whose
cluster has no node with the resource (after :data:`SANDBOX_WAIT_S` for one to join; at once on a
private local instance, which can gain none) stops with one line. Without the variable (``make up``,
tests) nothing changes. With the release's sandbox service (``KUBERL_SANDBOX_URL``, :mod:`trainer.sandbox.remote`)
the programs run there instead, in a pod without the Ray token: the tasks then ask for no sandbox resource (they
only wait on the service), the driver checks at start that the service answers its token (one line if not), and a
task of code rewards scores its samples on threads, so that their programs go to the service in shared requests;
such a task carries at least :data:`trainer.sandbox.remote.MAX_BATCH` samples once a cost is measured.

A ``reward_model`` entry (:mod:`trainer.rewards.reward_model`) or an ``llm_judge`` entry
(:mod:`trainer.rewards.judge`) is not scored in these tasks: each chunk of samples also goes, split over
the replicas, to that model's actors (``RewardRunner(..., scorers=pools)``: the run's pools, one per
entry), with the same time limit from the moment a replica starts the batch; its score joins the others'
by weight when all are in. The reward model pays, it never says correct: a sample is correct by the
verifiable rewards beside it, and never with the reward model alone. The judge says correct when it pays
full marks; its note (the judge's own output) is the sample's when the judge is the first positively
weighted entry, or when no verifiable reward pays beside it.

An entry with ``normalize: batch`` or ``running`` pays its score as a z-score (:class:`RewardNormalizer`): over
the scored samples of the step's :meth:`RewardRunner.results` call, or of its last ``window`` calls, each call
one step's samples (a round of dynamic sampling is a call of its own). It happens on the driver once every score
of the call is in and the failure budget has passed, so the statistics never see a failed score or a failed
step; ``scores`` keep the raw values (``train/reward/<name>``, the jsonl's ``rewards``, ``correct``), ``total`` is
the normalised sum. Validation runs inside :meth:`RewardRunner.validating`, which reads the windows and never
adds to them; the windows are run state (:meth:`RewardRunner.state_dict`), saved with a checkpoint.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import logging
import math
import os
import threading
import time
import traceback
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import ray

from trainer.cluster import ClusterError
from trainer.config import ConfigError, EnvConfig, RewardSpec, check_name
from trainer.rewards import judge, registry
from trainer.rewards import reward_model as rm
from trainer.rewards.actors import ModelPool
from trainer.sandbox import remote

log = logging.getLogger(__name__)


@dataclass
class RewardResult:
    total: float  # weighted sum over the reward functions
    correct: bool  # every function with a positive weight said correct
    scores: dict[str, float] = field(default_factory=dict)  # per function name
    warnings: list[str] = field(default_factory=list)
    feedback: str | None = None  # multi-turn only: the environment's next user turn
    answer: str | None = None  # what the first positively weighted reward judged (None: nothing)
    answer_note: str = ""  # where that answer came from, or why there is none or it is wrong
    rm_score: float | None = None  # the reward model's raw score (None: it did not read this sample)
    model_notes: dict[str, str] = field(default_factory=dict)  # a model-scored entry's note, by its name
    # Entries whose score is a failure (raised, timed out, lost its task), not a verdict.
    failed: list[str] = field(default_factory=list)
    # Entries with a normalize: what each paid before its weight (its z-score) and the (mean, std) behind it.
    normalized: dict[str, float] = field(default_factory=dict)
    norm: dict[str, tuple[float, float]] = field(default_factory=dict)


def score_one(
    specs: list[RewardSpec],
    ground_truth: Any,
    response: str,
    question: str | None = None,
    environment_reward: float | None = None,
) -> RewardResult:
    """Run every reward on one response in this process (also used by evaluation and tests);
    ``environment_reward`` is what a multi-turn environment scored the episode (the ``environment`` entry)."""
    from trainer import rewards

    result = RewardResult(total=0.0, correct=True)
    reported = False
    for spec in specs:
        try:
            kwargs = spec.kwargs
            if spec.name == "environment":
                kwargs = {**kwargs, "environment_reward": environment_reward}
            score = rewards.call(rewards.get(spec.name), ground_truth, response, kwargs, question)
        except Exception as e:  # a reward bug must cost one sample, never the run
            tail = traceback.format_exception_only(type(e), e)[-1].strip()
            result.warnings.append(f"reward {spec.name!r} raised {tail}")
            score = rewards.Score(0.0, False, None, f"reward {spec.name!r} raised {tail}")
            result.failed.append(spec.name)
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


def _conversation(rest: list) -> list[dict]:
    """The prompt an item carries for the reward model: its messages, else its question as the user's turn."""
    question, messages = (rest + [None, None])[:2]
    return list(messages) if messages else [{"role": "user", "content": question or ""}]


class RewardFailureError(RuntimeError):
    """More of a step's samples lost their reward than ``env.reward_failure_budget`` allows (the message names the
    commonest cause and the fix)."""


def failure_cause(warning_or_note: str) -> str | None:
    """The cause of a failed reward, from a sample's warning or a model's note; None when it is no failure (a
    verdict, a parse note, a too-long sample is scored, not failed)."""
    for mark in (" raised ", " timed out", "reward task failed"):
        if mark in warning_or_note:
            return (
                warning_or_note.split(":")[0].split(" (")[0]
                if mark == "reward task failed"
                else warning_or_note
            )
    return None


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


# ----- normalisation: each entry's score as a z-score before the weighted sum ---------------------------------

# An entry whose scores spread (std) no more than this, relative to their scale (|mean|, at least 1), is constant
# over its statistics: its samples pay 0, never a rounding residue divided by a near-zero std (as
# core_algos.FLAT_GROUP_RTOL does for a group's advantages).
NORM_STD_RTOL = 1e-5

# (n, mean, M2): how many scores, their mean and the sum of their squared deviations from it.
Moments = tuple[int, float, float]


def moments(xs: list[float]) -> Moments:
    """The :data:`Moments` of ``xs`` (exactly rounded sums: a step of 16 equal scores has M2 0, not a residue)."""
    if not xs:
        return 0, 0.0, 0.0
    mean = math.fsum(xs) / len(xs)
    return len(xs), mean, math.fsum((x - mean) ** 2 for x in xs)


def pooled(parts: Iterable[Moments]) -> Moments:
    """The moments of the union of ``parts`` (Chan, Golub and LeVeque's pairwise update): a window's mean and
    std are those of every score it holds, not a mean of the steps' means."""
    n, mean, m2 = 0, 0.0, 0.0
    for nb, mb, m2b in parts:
        if nb == 0:
            continue
        total = n + nb
        delta = mb - mean
        mean += delta * nb / total
        m2 += m2b + delta * delta * n * nb / total
        n = total
    return n, mean, m2


class RewardNormalizer:
    """``env.reward_functions[*].normalize``: each such entry pays ``(score - mean) / std`` before its weight,
    with the mean and std (population, ``/n``) of that entry's scored samples: this step's (``batch``), or its
    last ``window`` steps', this one included (``running``), so that step 1 is defined. Order: the step's own
    scores first enter the window, then every sample of the step is normalised with it.

    Only scored samples make the statistics: a sample whose entry failed (raised, timed out, lost its task; a
    model batch that failed) is left out of them and pays 0 for that entry, the window's mean (the failure
    budget bounds how many there are); so is a non-finite score, which would otherwise poison the window for
    ``window`` steps. An entry constant over its statistics (std at most :data:`NORM_STD_RTOL` of its scale)
    pays 0 on every sample: it tells the samples nothing apart, and 1 / std would make rounding an advantage.

    ``update=False`` (validation) normalises with the window as it stands and adds nothing to it; ``batch``
    entries, and ``running`` ones whose window is still empty (validation before step 1), use the batch's own
    statistics. An entry with ``normalize: none`` pays its raw score, and a run without any normalised entry
    keeps its sums bit for bit. The windows are run state (:meth:`state_dict`): a resumed run continues them.
    """

    def __init__(self, specs: list[RewardSpec]):
        # The entries in the order the sum adds them (the runner's: its tasks' rewards, then the models').
        self.order = list(specs)
        self.specs = [spec for spec in specs if spec.normalize != "none"]
        # entry name -> one Moments per step, the newest last
        self.windows: dict[str, collections.deque[Moments]] = {
            spec.name: collections.deque(maxlen=spec.window)
            for spec in self.specs
            if spec.normalize == "running"
        }
        # An asynchronous run's producer thread updates the windows while the driver may save them.
        self._lock = threading.Lock()

    def apply(self, results: list[RewardResult], update: bool = True) -> None:
        """Normalise the step's ``results`` in place: ``normalized``, ``norm`` and ``total``."""
        if not self.specs or not results:
            return
        with self._lock:
            for spec in self.specs:
                scored = [
                    r.scores[spec.name]
                    for r in results
                    if spec.name in r.scores
                    and spec.name not in r.failed
                    and math.isfinite(r.scores[spec.name])
                ]
                step = moments(scored)
                window = self.windows.get(spec.name)
                if window is not None and update:
                    window.append(step)  # a step without a scored sample still counts as a step of the window
                n, mean, m2 = pooled(window) if window else step
                std = math.sqrt(m2 / n) if n else 0.0
                constant = std <= NORM_STD_RTOL * max(1.0, abs(mean))
                for r in results:
                    ok = spec.name in r.scores and spec.name not in r.failed
                    r.normalized[spec.name] = (
                        (r.scores[spec.name] - mean) / std if ok and not constant else 0.0
                    )
                    r.norm[spec.name] = (mean, std)
        # The sum as score_one and the runner build it, in the same order, with the normalised entries' z-scores.
        for r in results:
            total = 0.0
            for spec in self.order:
                value = r.normalized[spec.name] if spec.normalize != "none" else r.scores.get(spec.name, 0.0)
                total += spec.weight * value
            r.total = total

    def state_dict(self) -> dict[str, Any]:
        """The running windows, JSON-serialisable: ``{"windows": {name: {"window": N, "steps": [[n, mean, M2],
        ...]}}}``, oldest step first."""
        with self._lock:
            return {
                "windows": {
                    name: {"window": window.maxlen, "steps": [list(m) for m in window]}
                    for name, window in self.windows.items()
                }
            }

    def load_state_dict(self, state: dict[str, Any]) -> str | None:
        """Continue the windows of :meth:`state_dict`; an entry whose ``window`` changed keeps its newest steps.
        Returns a warning line when a ``running`` entry has no saved window (it starts empty)."""
        saved = state.get("windows", {}) if isinstance(state, dict) else None
        if not isinstance(saved, dict):
            raise ValueError(
                f"reward normalisation state {state!r:.200} is not a state_dict() of this runner"
            )
        fresh = []
        with self._lock:
            for name, window in self.windows.items():
                if name not in saved:
                    window.clear()
                    fresh.append(name)
                    continue
                try:
                    steps = [(int(n), float(mean), float(m2)) for n, mean, m2 in saved[name]["steps"]]
                except (KeyError, TypeError, ValueError):
                    raise ValueError(
                        f"reward normalisation state of {name!r} is not a state_dict() of this runner: "
                        f"{saved[name]!r:.200}"
                    ) from None
                window.clear()
                window.extend(steps)  # a deque of the configured maxlen: a shorter one keeps the newest steps
        if not fresh:
            return None
        return (
            f"kuberl: warning: the checkpoint holds no running reward statistics for {', '.join(fresh)} "
            "(normalize=running): their windows start empty, so their first steps are normalised by fewer scores"
        )


def normalization_metrics(rollouts: list) -> dict[str, float]:
    """``train/reward/<name>/norm_mean`` and ``.../norm_std`` for each normalised entry: the mean and std its scores
    were normalised with this step (``rollouts``: the step's, each with its ``reward``). A step whose rounds
    (dynamic sampling) were scored with statistics of their own reports their average over its samples."""
    used: dict[str, list[tuple[float, float]]] = {}
    for r in rollouts:
        for name, stats in r.reward.norm.items():
            used.setdefault(name, []).append(stats)
    out = {}
    for name, stats in used.items():
        mean, std = (
            stats[0]
            if len(set(stats)) == 1
            else (math.fsum(m for m, _ in stats) / len(stats), math.fsum(s for _, s in stats) / len(stats))
        )
        out[f"train/reward/{name}/norm_mean"], out[f"train/reward/{name}/norm_std"] = mean, std
    return out


# A task carries samples worth about this many seconds of scoring, at most MAX_TASK_ITEMS of them: Ray's
# per-task cost then stays a few percent, and a task's samples wait at most this long for each other. Not
# less: a chunk of cheap samples split over more tasks than there are idle workers makes Ray start workers,
# each about a second of CPU (on 2 cores, 4 instead of 3 per tiny run at 0.05 s), to save tens of ms.
TASK_TARGET_S = 0.2
MAX_TASK_ITEMS = 256
# Less than a task's worth of samples waits up to this long for more while other tasks are in flight: samples
# that arrive one at a time (a multi-turn rollout's episodes end one by one) then share a task, most often on
# the worker of the task just ended, instead of making Ray start a worker (about a second of CPU) for each.
HOLD_S = TASK_TARGET_S
# Reward tasks that have waited this long for a CPU to run on, while no other task ran, started or ended,
# say the cluster has none to give: every sample would score 0, so the run stops and says so instead.
START_TIMEOUT_S = 600.0
# The rewards that run the model's code, and the variable that names the Ray resource of the nodes where
# they may (the chart's sandbox group). A joining sandbox pod may take this long to appear (a cold pull).
CODE_REWARDS = frozenset({"code_unit_tests", "cpp_contest"})
SANDBOX_RESOURCE_ENV = "KUBERL_SANDBOX_RESOURCE"
SANDBOX_WAIT_S = 600.0


def sandbox_resource(names: list[str]) -> str | None:
    """The Ray resource the tasks of rewards ``names`` must ask for: the sandbox group's, when one of them
    runs code here (no sandbox service) and the cluster has such a group; else None (any CPU will do)."""
    resource = os.environ.get(SANDBOX_RESOURCE_ENV, "").strip()
    return resource if resource and CODE_REWARDS.intersection(names) and not remote.configured() else None


def _in_service(names: list[str]) -> bool:
    """Rewards ``names`` all run code, in the sandbox service: their samples may be scored on threads, and
    should be, so that their programs share requests. (Not beside other rewards: the math rewards' time limit
    is a timer signal, which only reaches the main thread.)"""
    return bool(names) and set(names) <= CODE_REWARDS and remote.concurrency() > 1


def _each(fn, items: list, names: list[str]) -> list:
    """``[fn(item) for item in items]``, on threads when the items' programs go to the sandbox service."""
    if len(items) < 2 or not _in_service(names):
        return [fn(item) for item in items]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(len(items), remote.concurrency()), thread_name_prefix="reward") as pool:
        return list(pool.map(fn, items))


def check_sandbox_nodes(resource: str, private: bool) -> None:
    """Wait until a node holds ``resource`` (at most SANDBOX_WAIT_S; not at all on a ``private`` local
    instance), or stop with one line: otherwise every code reward task would wait for ever."""
    deadline = time.monotonic() + (0.0 if private else SANDBOX_WAIT_S)
    while ray.cluster_resources().get(resource, 0) <= 0:
        if time.monotonic() >= deadline:
            raise ClusterError(
                f"{SANDBOX_RESOURCE_ENV}={resource}: no node of this Ray cluster has the resource {resource!r}, "
                f"so code rewards have nowhere to run; enable the chart's sandbox group (sandbox.enabled=true, "
                f"sandbox.replicas>=1) or unset {SANDBOX_RESOURCE_ENV}"
            )
        time.sleep(2.0)


@ray.remote(num_cpus=1, max_retries=0)
def _score_task(specs: list[RewardSpec], items: list[tuple]):
    """Yields None once running (the time limit starts), then the scored ``(ground_truth, response,
    question)`` items with the seconds they took together."""
    yield None
    from trainer import rewards

    for spec in specs:  # a fresh worker's imports (a user's reward module too) are not the samples' cost
        try:
            rewards.get(spec.name)
        except Exception:  # noqa: S110  (score_one says why, per sample)
            pass
    start = time.monotonic()
    yield (
        _each(lambda item: score_one(specs, *item), items, [s.name for s in specs]),
        time.monotonic() - start,
    )


@ray.remote(num_cpus=1, max_retries=0)
def _feedback_task(name: str, kwargs: dict, items: list[tuple]):
    """As :func:`_score_task`, for the environment's feedback."""
    yield None
    import trainer.rewards.feedback  # noqa: F401

    start = time.monotonic()
    scored = _each(lambda item: feedback_one(name, kwargs, item[0], item[1]), items, [name])
    yield scored, time.monotonic() - start


@dataclass
class _Task:
    ids: list[int]
    items: list[tuple]
    submitted: float
    started: float | None = None
    pool: str = ""  # a model-scored batch: its pool's entry name
    replica: int = 0  # and the replica it was sent to


class RewardRunner:
    """Scores (ground_truth, response) pairs; with ``feedback=True`` it asks the environment for the
    next turn instead (``RewardResult.feedback``; None when the attempt passed)."""

    def __init__(
        self,
        env: EnvConfig,
        feedback: bool = False,
        scorers: ModelPool | list[ModelPool] | None = None,
    ):
        from trainer import rewards
        from trainer.rewards.feedback import FEEDBACK

        # Checked here, on the driver: in the tasks a bad name would only cost every sample its score.
        if feedback:
            check_name("env.feedback", env.feedback, sorted(FEEDBACK))
        else:
            rewards.check_specs(env.reward_functions)
        self.env = env
        scored = registry.MODEL_SCORED
        self.specs = [spec for spec in env.reward_functions if feedback or spec.name not in scored]
        # The entries the models' actors score, in env.reward_functions' order, and their pools.
        self.model_specs = [] if feedback else [s for s in env.reward_functions if s.name in scored]
        given = [scorers] if isinstance(scorers, ModelPool) else list(scorers or [])
        self.scorers = scorers  # as given: a validation runner is built from the same pools
        self.pools: dict[str, ModelPool] = {}
        for spec in self.model_specs:
            pool = next((p for p in given if p.NAME == spec.name), None)
            if pool is None:
                raise ConfigError(
                    f"env.reward_functions names {spec.name}, which needs the run's {spec.name.replace('_', ' ')} "
                    f"actors (settings under {scored[spec.name]}); this runner has none"
                )
            self.pools[spec.name] = pool
        self._rm_running: dict[ray.ObjectRefGenerator, _Task] = {}
        # entry name -> id -> (score, raw score, note)
        self._rm_results: dict[str, dict[int, tuple[float, float | None, str]]] = {n: {} for n in self.pools}
        # Each distinct item a model reads is scored once: the id sent -> the ids of the same item left home,
        # which get its score, bit for bit (identical samples scored in different passes would differ by the
        # passes' padding and shapes, and GRPO would turn that rounding into advantages).
        self._rm_copies: dict[str, dict[int, list[int]]] = {n: {} for n in self.pools}
        self._rm_moved = 0.0
        # The entries' normalisation (none for a feedback runner, whose results carry no score), summed in the
        # order the scores are: the tasks' rewards, then the models'.
        self.normalizer = RewardNormalizer([] if feedback else [*self.specs, *self.model_specs])
        self._validating = False
        # A feedback runner's one name (check_name above refused a null env.feedback); None for a scoring one.
        feedback_name = env.feedback if feedback else None
        names = [feedback_name] if feedback_name is not None else [spec.name for spec in self.specs]
        self.resource = sandbox_resource(names)
        # A task's samples share the service's requests: at least a batch of them per task, once measured.
        self.min_task_items = remote.MAX_BATCH if _in_service(names) else 1
        if remote.configured() and CODE_REWARDS.intersection(names):
            remote.check(wait_s=0.0 if not os.environ.get("RAY_ADDRESS") else SANDBOX_WAIT_S)
        score, feedback_task = _score_task, _feedback_task
        if self.resource:
            check_sandbox_nodes(self.resource, private=not os.environ.get("RAY_ADDRESS"))
            score = _score_task.options(resources={self.resource: 1})
            feedback_task = _feedback_task.options(resources={self.resource: 1})
        if feedback_name is not None:
            name, kwargs = feedback_name, dict(env.feedback_kwargs)
            self._task = lambda items: feedback_task.remote(name, kwargs, items)
        else:
            self._task = lambda items: score.remote(self.specs, items)
        # (index, (ground truth, response, question), alone, when queued): not yet sent; ``alone`` after its
        # shared task failed
        self._pending: collections.deque[tuple[int, tuple, bool, float]] = collections.deque()
        # A task in flight -> its indices, its items, when it was submitted, when it started (None: not yet)
        self._running: dict[ray.ObjectRefGenerator, _Task] = {}
        self._results: dict[int, RewardResult] = {}
        self._next = 0
        self.item_s: float | None = None  # measured seconds to score one sample (a moving average)
        self._moved = 0.0  # when a task last started or ended: waiting tasks count their wait from here

    def submit(self, items: list[tuple]) -> list[int]:
        """Queue ``(ground_truth, response)``, ``(ground_truth, response, question)``, ``(ground_truth, response,
        question, messages)`` or ``(..., messages, environment_reward)`` items (the reward model reads the prompt's
        messages; the ``environment`` reward pays a multi-turn environment's own score); returns their indices
        for :meth:`results`."""
        ids = list(range(self._next, self._next + len(items)))
        self._next += len(items)
        # (ground truth, response, question, the environment's reward of a multi-turn episode)
        plain = [(gt, resp, *(rest + [None, None, None])[:3:2]) for gt, resp, *rest in items]
        now = time.monotonic()
        if self.specs:
            self._pending.extend((i, item, False, now) for i, item in zip(ids, plain))
        else:  # the reward model alone: no task to run
            self._results.update((i, RewardResult(0.0, True)) for i in ids)
        for name, pool in self.pools.items():
            # What the model reads, from the prompt's messages (or its question) and the response; once per
            # distinct item, in the order they came (a group's samples stay together).
            read = [pool.item(gt, resp, _conversation(rest)) for gt, resp, *rest in items]
            first: dict[str, int] = {}
            for i, item in zip(ids, read):
                key = json.dumps(item, sort_keys=True, default=str)
                if key in first:
                    self._rm_copies[name].setdefault(first[key], []).append(i)
                else:
                    first[key] = i
            sent = list(first.values())
            unique = [read[i - ids[0]] for i in sent]
            for part in pool.shares(len(unique)):
                r = pool.pick()
                self._rm_running[pool.call(unique[part], r)] = _Task(
                    sent[part], unique[part], now, pool=name, replica=r
                )
        self._pump()
        return ids

    def done(self, ids: list[int]) -> bool:
        """Whether :meth:`results` would return ``ids`` at once (all are scored); polls nothing."""
        return all(i in self._results for i in ids) and all(
            i in got for got in self._rm_results.values() for i in ids
        )

    def task_size(self) -> int:
        """How many samples the next task carries: about TASK_TARGET_S of measured scoring, 1 before any."""
        if not self.item_s:
            return 1 if self.item_s is None else MAX_TASK_ITEMS
        return max(self.min_task_items, min(MAX_TASK_ITEMS, int(TASK_TARGET_S / self.item_s)))

    def _pump(self) -> None:
        now = time.monotonic()
        while self._pending and len(self._running) < self.env.max_concurrent_rewards:
            if self.item_s is None and self._running:
                return  # one probe until a cost is known: a run's cheap rewards then start one worker, not dozens
            if self._pending[0][2]:  # a sample whose shared task failed: a task of its own
                i, item, _, _ = self._pending.popleft()
                ids, items = [i], [item]
            else:
                size = self.task_size()
                head = itertools.islice(self._pending, size)
                n = sum(1 for _ in itertools.takewhile(lambda pending: not pending[2], head))
                if n < size and self._running and now - self._pending[0][3] < HOLD_S:
                    return  # less than a task's worth: it waits for more samples, or for the tasks in flight
                taken = [self._pending.popleft() for _ in range(n)]
                ids, items = [t[0] for t in taken], [t[1] for t in taken]
            self._running[self._task(items)] = _Task(ids, items, time.monotonic())

    def _measured(self, seconds: float, n: int) -> None:
        per_item = seconds / n
        self.item_s = per_item if self.item_s is None else 0.7 * self.item_s + 0.3 * per_item

    def _failed_task(self, ids: list[int], items: list[tuple], why: str) -> None:
        """A task that timed out or died: its one sample scores 0; a shared one's samples go again, one per task."""
        if len(ids) == 1:
            self._results[ids[0]] = _failed(why)
        else:
            now = time.monotonic()
            self._pending.extendleft((i, item, True, now) for i, item in reversed(list(zip(ids, items))))

    def _rm_set(self, pool: str, ids: list[int], result: tuple[float, float | None, str]) -> None:
        """``result`` for each of ``ids`` and for every id of the same item that was not sent (``_rm_copies``)."""
        for i in ids:
            for j in (i, *self._rm_copies[pool].pop(i, ())):
                self._rm_results[pool][j] = result

    def _poll_reward_model(self, timeout: float) -> None:
        """Collect the models' finished batches and note started ones; a late batch's samples score 0.
        A replica that died raises (the run ends naming it)."""
        from ray.exceptions import RayActorError

        ready = set(ray.wait(list(self._rm_running), num_returns=len(self._rm_running), timeout=timeout)[0])
        now = time.monotonic()
        for gen, task in list(self._rm_running.items()):
            if gen not in ready:
                continue
            self._rm_moved = now
            try:
                out = ray.get(next(gen))
            except RayActorError:
                self._rm_running.pop(gen)
                raise
            except Exception as e:  # the replica raised on this batch (a template that failed on a message)
                self._rm_running.pop(gen)
                # Ray's RayTaskError holds the replica's traceback (in colour): the line is its cause's own
                cause = getattr(e, "cause", None) or e
                tail = " ".join(traceback.format_exception_only(type(cause), cause)[-1].split())[:300]
                why = f"{self.pools[task.pool].WHAT} raised {tail}"
                self._rm_set(task.pool, task.ids, (0.0, None, why))
                continue
            if task.started is None:
                task.started = now
                continue
            self._rm_running.pop(gen)
            scores, notes, _ = out
            pool = self.pools[task.pool]
            for i, raw, note in zip(task.ids, scores, notes):
                self._rm_set(task.pool, [i], pool.finish(raw, note))
        busy = any(task.started is not None for task in self._rm_running.values())
        for gen, task in list(self._rm_running.items()):
            if task.started is not None and now - task.started > self.env.reward_timeout_s:
                self._rm_running.pop(gen)
                self._rm_moved = now
                why = f"{self.pools[task.pool].WHAT} timed out after {self.env.reward_timeout_s:g}s"
                self._rm_set(task.pool, task.ids, (0.0, None, why))
                self._restart(task)
            elif (
                not busy
                and task.started is None
                and now - max(task.submitted, self._rm_moved) > START_TIMEOUT_S
            ):
                what = self.pools[task.pool].WHAT
                raise ClusterError(
                    f"a {what} batch has waited {now - task.submitted:.0f}s for a replica to start it, while "
                    f"none ran: the {what}'s replicas are stuck; check their logs, or raise env.reward_timeout_s"
                )

    def _restart(self, overdue: _Task) -> None:
        """Replace the replica stuck on ``overdue`` (:meth:`ModelPool.restart`: the only way to stop its call) and
        send the batches queued behind it again, to the replica in its place: they never started."""
        pool = self.pools[overdue.pool]
        queued = [
            (gen, task)
            for gen, task in self._rm_running.items()
            if task.pool == overdue.pool and task.replica == overdue.replica
        ]
        pool.restart(overdue.replica)
        log.warning(
            "%s replica %d was still on a batch after env.reward_timeout_s=%gs: restarted (it loads the model "
            "again); %d batch(es) queued on it sent again",
            pool.WHAT,
            overdue.replica,
            self.env.reward_timeout_s,
            len(queued),
        )
        for gen, task in queued:
            self._rm_running.pop(gen)
            task.started = None
            task.submitted = time.monotonic()
            self._rm_running[pool.call(task.items, task.replica)] = task

    def poll(self, timeout: float = 0.0) -> None:
        """Collect finished tasks, note started ones, cancel overdue ones, start queued ones."""
        if self._rm_running:  # batches run only with a reward model or a judge
            self._poll_reward_model(0.0 if self._running else timeout)
        if self._running:
            ready = set(ray.wait(list(self._running), num_returns=len(self._running), timeout=timeout)[0])
            now = time.monotonic()
            for gen, task in list(self._running.items()):
                if gen not in ready:
                    continue
                self._moved = now
                try:
                    out = ray.get(next(gen))
                except Exception as e:  # the worker died (e.g. a reward that killed its process)
                    self._running.pop(gen)
                    cause = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
                    self._failed_task(task.ids, task.items, f"reward task failed: {cause}")
                    continue
                if task.started is None:  # the first item: it runs from now on
                    task.started = now
                    continue
                self._running.pop(gen)
                results, seconds = out
                self._results.update(zip(task.ids, results))
                self._measured(seconds, len(task.ids))
            busy = any(task.started is not None for task in self._running.values())
            for gen, task in list(self._running.items()):
                if task.started is not None and now - task.started > self.env.reward_timeout_s:
                    ray.cancel(gen, force=True)
                    self._running.pop(gen)
                    self._moved = now
                    self._failed_task(
                        task.ids, task.items, f"reward timed out after {self.env.reward_timeout_s:g}s"
                    )
                elif (
                    not busy
                    and task.started is None
                    and now - max(task.submitted, self._moved) > START_TIMEOUT_S
                ):
                    waited = now - task.submitted
                    for stalled in self._running:
                        ray.cancel(stalled, force=True)
                    self._running.clear()
                    raise ClusterError(
                        f"a reward task has waited {waited:.0f}s to start: the Ray cluster has no CPU "
                        f"free for rewards (each task takes 1); give its nodes CPUs that the policy and generation "
                        f"placement groups do not reserve, or lower env.max_concurrent_rewards"
                    )
        self._pump()

    def results(self, ids: list[int]) -> list[RewardResult]:
        """Block until every id has a result (bounded by the timeout), then return them in order."""
        unknown = [i for i in ids if i >= self._next or i < 0]
        if unknown:
            raise KeyError(f"reward ids {unknown[:3]} were not submitted to this runner")
        while any(i not in self._results for i in ids) or any(
            i not in got for got in self._rm_results.values() for i in ids
        ):
            self.poll(timeout=0.05)
        out = [self._results.pop(i) for i in ids]
        failed: dict[int, str] = {}  # sample -> its first failure's cause
        for k, r in enumerate(out):
            for w in r.warnings:
                log.warning("%s; the sample scores 0 for it", w)
                cause = failure_cause(w)
                if cause is not None:
                    failed.setdefault(k, cause)
        for spec in self.model_specs:
            notes: collections.Counter[str] = collections.Counter()
            for k, (i, r) in enumerate(zip(ids, out)):
                score, raw, note = self._rm_results[spec.name].pop(i)
                self._join_model_score(spec, r, score, raw, note)
                cause = failure_cause(note) if note and not note.startswith(judge.PARSED) else None
                if cause is not None:
                    failed.setdefault(k, cause)
                    r.failed.append(spec.name)
                if note and not note.startswith(judge.PARSED):  # a verdict read is no warning
                    notes[note.split(":")[0].split(" (")[0]] += 1
            for what, n in notes.items():
                log.warning("%s (%d of %d samples)", what, n, len(ids))
        self._check_budget(failed, len(ids))
        # After the budget: a step that stops the run never reaches the windows.
        self.normalizer.apply(out, update=not self._validating)
        return out

    @contextlib.contextmanager
    def validating(self) -> Iterator[None]:
        """Within it, :meth:`results` normalises with the running statistics as they stand and never adds to
        them: a validation pass (greedy, other prompts) is not the training distribution they follow."""
        self._validating = True
        try:
            yield
        finally:
            self._validating = False

    def state_dict(self) -> dict[str, Any]:
        """The run state of the runner, JSON-serialisable: the ``normalize: running`` entries' windows (taken
        right after a step's :meth:`results`, it is the state a run resumed after that step continues)."""
        return {"normalize": self.normalizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> str | None:
        """Continue from :meth:`state_dict`; returns a warning line when a running entry has no saved window."""
        return self.normalizer.load_state_dict(state.get("normalize", {}))

    def _check_budget(self, failed: dict[int, str], total: int) -> None:
        """:class:`RewardFailureError` when more than ``env.reward_failure_budget`` of ``total`` samples failed."""
        budget = self.env.reward_failure_budget
        if not failed or len(failed) <= budget * total:
            return
        causes = collections.Counter(failed.values())
        cause, n = causes.most_common(1)[0]
        raise RewardFailureError(
            f"{len(failed)} of {total} samples lost their reward this step (env.reward_failure_budget={budget:g}), "
            f"{n} of them to: {cause[:300]}; fix that reward (or raise env.reward_timeout_s for a slow one), or "
            "raise env.reward_failure_budget to train on their zeros"
        )

    def _join_model_score(
        self, spec: RewardSpec, result: RewardResult, score: float, raw: float | None, note: str
    ) -> None:
        result.scores[spec.name] = score
        result.total += spec.weight * score
        result.model_notes[spec.name] = note  # the judge's: what its step metrics read (judge.step_metrics)
        if spec.weight <= 0:
            return
        alone = not any(s.weight > 0 for s in self.specs)  # no verifiable reward pays beside it
        if spec.name in (rm.NAME, registry.REWARD_SERVER):  # a reward model, in process or served: it pays
            result.rm_score = raw
            if alone:  # nothing says correct, and the reward model's score is the note
                result.correct = False
                result.answer_note = note or f"reward model: {raw:.3f}"
            return
        # The judge: full marks say correct; its output is the note when it comes first, or pays alone.
        result.correct = result.correct and score >= 1.0
        first = next(s for s in self.env.reward_functions if s.weight > 0)
        if first is spec or alone:
            result.answer = None if raw is None else f"{raw:.3g}"
            result.answer_note = note
