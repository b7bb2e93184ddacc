"""Where the GRPO loop's batches come from: generated on demand, or ahead of the policy.

A weight *version* counts optimizer steps: version v is the policy after v steps. Step t trains the
policy at version t - 1, so a batch that version v generated is ``(t - 1) - v`` steps stale.

- :class:`SyncRollouts` (``grpo.async.max_staleness: 0``, and every colocated run): step t's batch is
  generated when step t asks for it, by version t - 1 (staleness 0). Its rewards may still be running
  when it is handed over, so the loop can start the logprob passes first.
- :class:`AsyncRollouts` (disaggregated, ``max_staleness: k >= 1``): a producer thread in the driver
  generates and scores the next batches on the generation actors while the policy trains, as in
  NeMo-RL's async GRPO and verl's one-step off-policy mode. Before each generation round for step t
  it waits until the engines hold at least version t - 1 - k, so no batch is ever trained on more
  than k steps stale. Weight pushes go between generation rounds, never inside one: the trainer
  takes the engines (:meth:`AsyncRollouts.engines`) once the current round ends, and the producer
  starts no round while the trainer is waiting for them. Preferring the push keeps staleness low.

Both apply DAPO's dynamic sampling when it is on (``grpo.dynamic_sampling``): groups whose rewards
are all equal carry no policy gradient, so more prompts are drawn until the batch holds
``num_prompts_per_step`` informative groups, in at most ``max_rounds`` rounds.

Every batch carries the prompt loader's position after its prompts, and a checkpoint stores that of
the last batch trained on: batches generated ahead are discarded at a stop and generated again after
resume, from the same prompts and seeds, so no prompt is skipped or replayed.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from trainer.config import Config, ConfigError
from trainer.generation.base import SamplingParams
from trainer.loop import rollout
from trainer.loop.rollout import PendingRollouts, Rollout
from trainer.loop.state import LoopState

if TYPE_CHECKING:
    from trainer.rewards.runner import RewardRunner

# Seeds of later dynamic-sampling rounds: far from seed + step, so no round repeats another step's draw.
ROUND_SEED_STRIDE = 1_000_003


def informative_groups(rewards: Tensor, group_size: int) -> Tensor:
    """Groups with a policy gradient: not all rewards equal. rewards: (N*G,) -> (N,) bool."""
    grouped = rewards.view(-1, group_size)  # (N, G)
    return (grouped != grouped[:, :1]).any(dim=1)


@dataclass
class RolloutBatch:
    step: int
    pending: PendingRollouts  # group-contiguous; rewards may still be running (sync, one round)
    versions: list[int]  # per rollout: the weight version that generated it
    loader_state: dict[str, Any]  # the prompt loader's position right after this batch's prompts
    rounds: int = 1  # generation rounds (dynamic sampling draws more prompts)
    prompts_drawn: int = 0
    informative: int | None = None  # groups with unequal rewards among those drawn (dynamic sampling)
    wait_s: float = 0.0  # how long the trainer waited for it
    engine_wait_s: float = 0.0  # how long generation waited for newer weights (async)
    # The reward runner's state right after this batch was scored (its running normalisation): what a checkpoint
    # of this step holds; None until it is scored.
    reward_state: dict[str, Any] | None = None

    @property
    def generation_s(self) -> float:
        """Time the engines spent on it (all rounds)."""
        return self.pending.generation_s

    def staleness(self) -> list[int]:
        return [self.step - 1 - v for v in self.versions]

    def metrics(self) -> dict[str, float]:
        stale = self.staleness()
        m = {
            "train/staleness_mean": sum(stale) / len(stale),
            "train/staleness_max": float(max(stale)),
            "timing/generation_wait_s": self.wait_s,
            "timing/train_wait_s": self.engine_wait_s,
        }
        if self.informative is not None:
            m["train/dynamic_sampling_rounds"] = float(self.rounds)
            m["train/dynamic_sampling_prompts"] = float(self.prompts_drawn)
            m["train/informative_group_frac"] = self.informative / max(self.prompts_drawn, 1)
        return m


class _Producer:
    """Generates and scores the batch of one step (all its dynamic-sampling rounds)."""

    def __init__(self, cfg: Config, state: LoopState, rewards: RewardRunner):
        self.cfg, self.state, self.rewards = cfg, state, rewards

    def _round(self, examples: list[dict], params: SamplingParams) -> PendingRollouts:
        g, s = self.cfg.grpo, self.state
        by_env = getattr(s, "rollout_env", None)  # the rollout stream's tests pass states without one
        if by_env is not None:
            return rollout.generate_by_environment(
                by_env, self.rewards, examples, g.num_generations_per_prompt, params
            )
        if g.max_rollout_turns > 1:
            if s.environment is None:
                raise ConfigError(
                    f"grpo.max_rollout_turns={g.max_rollout_turns} needs an environment (env.environment, or "
                    "env.feedback) between turns, and this run was built without one; set grpo.max_rollout_turns=1"
                )
            return rollout.generate_episodes(
                s.generator,
                self.rewards,
                s.environment,
                s.turns,
                examples,
                g.num_generations_per_prompt,
                params,
                g.max_rollout_turns,
                self.cfg.policy.max_total_sequence_length,
            )
        return rollout.generate(s.generator, self.rewards, examples, g.num_generations_per_prompt, params)

    def produce(self, step: int, engines: Callable[[int], Any], params: SamplingParams) -> RolloutBatch:
        """``engines(step)`` is a context manager held while the engines generate; it yields the
        weight version they hold."""
        g, loader = self.cfg.grpo, self.state.loader
        if not g.dynamic_sampling.enabled:
            examples = loader.next_batch()
            with engines(step) as version:
                pending = self._round(examples, params)
            return RolloutBatch(
                step,
                pending,
                [version] * len(pending.rollouts),
                loader.state_dict(),
                prompts_drawn=len(examples),
            )
        n, want = g.num_generations_per_prompt, g.num_prompts_per_step
        kept: list[tuple[list[Rollout], int]] = []  # (group, version), informative
        spare: list[tuple[list[Rollout], int]] = []  # all rewards equal: used only to fill a short batch
        rounds = drawn = 0
        generation_s = 0.0
        while len(kept) < want and rounds < g.dynamic_sampling.max_rounds:
            examples = loader.next_batch()
            round_params = replace(
                params, seed=None if params.seed is None else params.seed + ROUND_SEED_STRIDE * rounds
            )
            with engines(step) as version:
                pending = self._round(examples, round_params)
            done = rollout.finish(pending, self.rewards)
            rewards = torch.tensor([r.total for r in rollout.rewards_of(done)], dtype=torch.float32)  # (P*G,)
            for i, useful in enumerate(informative_groups(rewards, n).tolist()):
                (kept if useful else spare).append((done[i * n : (i + 1) * n], version))
            rounds, drawn, generation_s = (
                rounds + 1,
                drawn + len(examples),
                generation_s + pending.generation_s,
            )
        informative = len(kept)
        groups = (kept + spare)[:want]  # informative first; extra informative groups are dropped, as in DAPO
        rollouts = [r for group, _ in groups for r in group]
        versions = [v for group, v in groups for _ in group]
        return RolloutBatch(
            step,
            PendingRollouts(rollouts, [], generation_s),
            versions,
            loader.state_dict(),
            rounds,
            drawn,
            informative,
        )


class SyncRollouts:
    """Each step's batch generated when the step asks for it, by the weights of the step before."""

    def __init__(self, cfg: Config, state: LoopState, params: Callable[[int], SamplingParams]):
        self.cfg, self.state, self.params = cfg, state, params
        self.producer = _Producer(cfg, state, state.rewards)
        self.version = state.progress.step
        self.val_rewards = state.rewards

    @contextmanager
    def _engines(self, step: int) -> Iterator[int]:
        yield self.version

    def next(self, step: int) -> RolloutBatch:
        return self.producer.produce(step, self._engines, self.params(step))

    @contextmanager
    def engines(self) -> Iterator[float]:
        """The engines to push weights into or validate with; yields how long that waited (0 here)."""
        yield 0.0

    def push_weights(self, step: int) -> tuple[float, float]:
        """Refit the engines; (seconds waited for them (none here), seconds the refit took)."""
        t0 = time.monotonic()
        self.state.generator.update_weights()
        self.version = step
        return 0.0, time.monotonic() - t0

    def close(self) -> None:
        pass


@dataclass
class _Failed:
    error: BaseException


@dataclass
class _Gate:
    """Who has the generation engines: the producer (one round at a time) or the trainer."""

    version: int
    cond: threading.Condition = field(default_factory=threading.Condition)
    generating: bool = False
    trainer_waiting: bool = False
    trainer_has: bool = False
    closed: bool = False
    engine_wait_s: float = 0.0  # the producer's waits for newer weights since the trainer last read it


class Closed(Exception):
    """The stream was closed while the producer waited."""


class AsyncRollouts:
    """Batches generated ahead by a producer thread, each at most ``max_staleness`` steps stale."""

    def __init__(
        self,
        cfg: Config,
        state: LoopState,
        params: Callable[[int], SamplingParams],
        on_wait: Callable[[], None] = lambda: None,
    ):
        from trainer.rewards.runner import RewardRunner

        self.cfg, self.state, self.params, self.on_wait = cfg, state, params, on_wait
        self.max_staleness = cfg.grpo.async_.max_staleness
        self.gate = _Gate(version=state.progress.step)
        # The producer owns the training RewardRunner (it is not thread-safe); validation gets its own.
        self.producer = _Producer(cfg, state, state.rewards)
        self.val_rewards = RewardRunner(cfg.env, scorers=state.rewards.scorers)
        self.batches: queue.Queue[RolloutBatch | _Failed] = queue.Queue()
        self.thread: threading.Thread | None = None

    # ----- producer side ------------------------------------------------------------------------------
    @contextmanager
    def _engines(self, step: int) -> Iterator[int]:
        gate, floor = self.gate, step - 1 - self.max_staleness  # the oldest weights step may train on
        with gate.cond:
            t0 = time.monotonic()
            gate.cond.wait_for(
                lambda: (
                    gate.closed
                    or (gate.version >= floor and not gate.trainer_waiting and not gate.trainer_has)
                )
            )
            gate.engine_wait_s += time.monotonic() - t0
            if gate.closed:
                raise Closed
            gate.generating = True
            version = gate.version
        try:
            yield version
        finally:
            with gate.cond:
                gate.generating = False
                gate.cond.notify_all()

    def _run(self, first: int, last: int) -> None:
        try:
            for step in range(first, last + 1):
                batch = self.producer.produce(step, self._engines, self.params(step))
                rollout.finish(
                    batch.pending, self.producer.rewards
                )  # scored here: the runner is this thread's
                batch.reward_state = self.producer.rewards.state_dict()  # not the batches scored after it
                with self.gate.cond:
                    batch.engine_wait_s, self.gate.engine_wait_s = self.gate.engine_wait_s, 0.0
                self.batches.put(batch)
        except Closed:
            pass
        except BaseException as e:  # handed to the trainer, which raises it in the driver's thread
            self.batches.put(_Failed(e))

    # ----- trainer side -------------------------------------------------------------------------------
    def start(self) -> None:
        first, last = self.state.progress.step + 1, self.cfg.grpo.max_num_steps
        self.thread = threading.Thread(
            target=self._run, args=(first, last), name="kuberl-rollouts", daemon=True
        )
        self.thread.start()

    def next(self, step: int) -> RolloutBatch:
        if self.thread is None:  # on the first request, so validation at start has the engines to itself
            self.start()
        t0 = time.monotonic()
        while True:
            try:
                item = self.batches.get(timeout=0.2)
                break
            except queue.Empty:
                self.on_wait()  # a safe point: e.g. stop here after SIGTERM
        if isinstance(item, _Failed):
            raise item.error
        item.wait_s = time.monotonic() - t0
        if item.step != step or max(item.staleness()) > self.max_staleness or min(item.staleness()) < 0:
            raise RuntimeError(  # the gate makes this impossible; a bug must not train on stale data
                f"rollout stream out of order: step {step} got the batch of step {item.step} generated by "
                f"versions {sorted(set(item.versions))} (grpo.async.max_staleness={self.max_staleness})"
            )
        return item

    @contextmanager
    def engines(self) -> Iterator[float]:
        """Take the engines from the producer once its current round ends; yields how long that took."""
        gate = self.gate
        with gate.cond:
            gate.trainer_waiting = True
            t0 = time.monotonic()
            gate.cond.wait_for(lambda: not gate.generating)
            gate.trainer_waiting, gate.trainer_has = False, True
        try:
            yield time.monotonic() - t0
        finally:
            with gate.cond:
                gate.trainer_has = False
                gate.cond.notify_all()

    def push_weights(self, step: int) -> tuple[float, float]:
        """Refit the engines once the round in flight ends; (seconds waited for them, seconds the refit took)."""
        with self.engines() as waited:
            t0 = time.monotonic()
            self.state.generator.update_weights()
            refit_s = time.monotonic() - t0
            with self.gate.cond:
                self.gate.version = step
        return waited, refit_s

    def close(self) -> None:
        with self.gate.cond:
            self.gate.closed = True
            self.gate.cond.notify_all()
        if self.thread is not None:
            # A round in flight ends with the engines' reply, or fails quietly when the run shuts them
            # down: not worth a preemption's grace seconds.
            self.thread.join(timeout=1)


def make_rollout_stream(
    cfg: Config, state: LoopState, params: Callable[[int], SamplingParams]
) -> SyncRollouts | AsyncRollouts:
    """``params(step)``: the sampling parameters (and seed) of step's batch."""
    if cfg.grpo.async_.max_staleness >= 1:
        return AsyncRollouts(cfg, state, params, on_wait=state.preemption_point)
    return SyncRollouts(cfg, state, params)
