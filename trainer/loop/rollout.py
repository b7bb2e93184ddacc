"""Rollouts: sample completions and score them, with scoring overlapped with generation.

Generation is split over the generator's workers; as soon as one worker returns its completions,
their reward tasks start, while the other workers are still decoding. :func:`generate` returns with
rewards still running, so the caller can start the policy's logprob passes before it waits on them.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import ray

from trainer.data.prompts import TurnEncoder
from trainer.envs.base import Environment, Episode, RolloutEnvironment, chain
from trainer.generation.base import Completion, SamplingParams
from trainer.generation.placement import Generator
from trainer.models import moe
from trainer.rewards.runner import RewardResult, RewardRunner, question_of

log = logging.getLogger(__name__)


@dataclass
class Rollout:
    example: dict  # the dataset example (messages, ground_truth, prompt_ids, ...)
    completion: Completion  # the final attempt: it is what the reward judges
    reward: RewardResult | None = None  # None until :func:`finish` attaches it (read: :func:`rewards_of`)
    turns: int = 1
    # Every token after the prompt and which of them the model wrote (1) or the environment did (0):
    # a single turn's are its completion's; a multi-turn episode appends its attempts and feedback turns.
    response_ids: list[int] = field(init=False)
    response_mask: list[int] = field(init=False)
    response_logprobs: list[float] = field(init=False)  # the engine's, 0.0 on environment tokens
    # A multi-turn episode's environment counters, summed over its turns (tool_calls, tool_errors, tool_s).
    env_info: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.response_ids = list(self.completion.token_ids)
        self.response_mask = [1] * len(self.completion.token_ids)
        self.response_logprobs = list(self.completion.logprobs)

    @property
    def prompt_ids(self) -> list[int]:
        return self.example["prompt_ids"]

    @property
    def tokens(self) -> list[int]:
        return self.response_ids

    @property
    def logprobs(self) -> list[float]:
        """(L,) the engine's logprob of each token of :attr:`tokens` (the behaviour policy)."""
        return self.response_logprobs

    @property
    def routes(self) -> Any:
        """An MoE engine's routes over the sample's positions (:attr:`Completion.routes`) when one engine call
        computed all of them: a single turn. A multi-turn episode's later turns were routed by calls of their own
        over a longer context, so it has none (trained with the trainer's own routing)."""
        c = self.completion
        if c.routes is None or self.turns != 1 or self.response_ids != list(c.token_ids):
            return None
        return moe.sample_routes(c.routes, len(self.prompt_ids), len(self.response_ids))

    @property
    def model_tokens(self) -> int:
        return sum(self.response_mask)


def rewards_of(rollouts: list[Rollout]) -> list[RewardResult]:
    """The rewards of scored rollouts (those :func:`finish` returned), in order."""
    out = []
    for i, r in enumerate(rollouts):
        if r.reward is None:
            raise RuntimeError(f"rollout {i} was never scored: pass its batch through rollout.finish first")
        out.append(r.reward)
    return out


@dataclass
class PendingRollouts:
    rollouts: list[Rollout]  # group-contiguous: rows [i*n:(i+1)*n] belong to example i
    reward_ids: list[int]
    generation_s: float


def generate(
    generator: Generator, rewards: RewardRunner, examples: list[dict], n: int, params: SamplingParams
) -> PendingRollouts:
    start = time.monotonic()
    prompts = [ex["prompt_ids"] for ex in examples]
    chunks = dict((ref, idx) for ref, idx in generator.submit(prompts, n, params))
    slots: list[Rollout | None] = [None] * (len(examples) * n)
    reward_ids: list[int | None] = [None] * len(slots)
    remaining = list(chunks)
    while remaining:
        done, remaining = ray.wait(remaining, num_returns=1, timeout=0.1)
        for ref in done:
            rows, items = [], []  # a chunk's samples go to the reward runner together (it batches them)
            for prompt_index, group in zip(chunks[ref], ray.get(ref)):
                example, question = examples[prompt_index], question_of(examples[prompt_index])
                for row, completion in zip(range(prompt_index * n, (prompt_index + 1) * n), group):
                    slots[row] = Rollout(example, completion)
                    rows.append(row)
                    items.append(
                        (example["ground_truth"], completion.text, question, example.get("messages"))
                    )
            for row, rid in zip(rows, rewards.submit(items)):
                reward_ids[row] = rid
        rewards.poll()
    rollouts = [r for r in slots if r is not None]
    ids = [i for i in reward_ids if i is not None]
    if len(rollouts) != len(slots) or len(ids) != len(slots):
        raise RuntimeError(f"the generator answered {len(rollouts)} of the {len(slots)} samples asked for")
    return PendingRollouts(rollouts, ids, time.monotonic() - start)


@dataclass
class _Live:
    """An episode in progress: its rollout, the environment's side of it, and what it has said so far."""

    rollout: Rollout
    episode: Episode
    info: dict[str, float] = field(default_factory=dict)
    environment_reward: float | None = None
    cohort: Any = None  # the _Cohort of the generation call that returned its last turn


def generate_episodes(
    generator: Generator,
    rewards: RewardRunner,
    env: Environment,
    turns: TurnEncoder,
    examples: list[dict],
    n: int,
    params: SamplingParams,
    max_turns: int,
    max_context: int,
) -> PendingRollouts:
    """Episodes of up to ``max_turns`` model turns, ``n`` per example, with ``env`` answering between them.

    After each turn the episode's environment step (tools, feedback) runs in a thread of its own; its
    messages are rendered through the chat template as glue (mask 0) after the model's exact tokens, and the
    episode's next turn goes to the engines as soon as it is ready, with the samples the same generation call
    returned beside it when they are ready too: they wait for each other at most :data:`LINGER_S`, so a long
    episode or a slow tool holds back no other sample for longer than that, while samples that step together
    still reach the engines in one batch. An episode ends
    when the environment says so, at ``max_turns``, or when its next turn might not fit in ``max_context``
    tokens; its final turn is what the rewards judge, submitted as soon as it ends. The first turn follows
    ``params.seed``; each later turn has a seed of its own (:func:`turn_seed`), whichever call timing puts it
    in, so a run's episodes repeat with its seed (unseeded with ``params.seed`` None).
    """
    start = time.monotonic()
    live = [
        _Live(Rollout(ex, Completion([], [], "", "length"), turns=0), env.episode(ex))
        for ex in examples
        for _ in range(n)
    ]
    reward_ids: list[int | None] = [None] * len(live)
    # A generation call in flight -> for each of its prompts, the rows its completions belong to.
    calls: dict[Any, list[list[int]]] = {}
    cohorts: dict[int, _Cohort] = {}  # the rows one call returned, stepping in the environment
    steps: dict[Future, int] = {}
    keys = itertools.count()

    def launch(rows: list[int], prompts: list[list[int]], k: int, call: SamplingParams) -> None:
        for ref, idx in generator.submit(prompts, k, call):
            calls[ref] = [[rows[j]] if k == 1 else list(range(rows[j] * k, (rows[j] + 1) * k)) for j in idx]

    def end(row: int) -> None:
        ep = live[row]
        ep.episode.close()
        r, ex = ep.rollout, ep.rollout.example
        item = (
            ex["ground_truth"],
            r.completion.text,
            question_of(ex),
            ex.get("messages"),
            ep.environment_reward,
        )
        reward_ids[row] = rewards.submit([item])[0]

    launch(list(range(len(examples))), [ex["prompt_ids"] for ex in examples], n, params)
    with ThreadPoolExecutor(max_workers=min(32, len(live)), thread_name_prefix="kuberl-env") as pool:
        while calls or steps:
            if calls:
                done, _ = ray.wait(list(calls), num_returns=len(calls), timeout=0.01 if steps else 0.1)
                for ref in done:
                    cohort = _Cohort(next(keys))
                    for rows, group in zip(calls.pop(ref), ray.get(ref)):
                        for row, c in zip(rows, group):
                            r = live[row].rollout
                            r.completion, r.turns = c, r.turns + 1
                            r.response_ids += c.token_ids
                            r.response_mask += [1] * len(c.token_ids)
                            r.response_logprobs += c.logprobs
                            # The last turn is stepped too: an environment that scores its episodes sees it.
                            text = c.raw_text if c.raw_text is not None else c.text  # tool markers kept
                            steps[pool.submit(live[row].episode.step, text)] = row
                            cohort.waiting.add(row)
                            live[row].cohort = cohort
                    cohorts[cohort.key] = cohort
            for fut in [f for f in steps if f.done()]:
                row = steps.pop(fut)
                ep = live[row]
                ep.cohort.waiting.discard(row)
                if _apply_step(ep, fut, env, turns, params, max_context, ep.rollout.turns >= max_turns):
                    ep.cohort.ready.append(row)
                    ep.cohort.since = ep.cohort.since or time.monotonic()
                else:
                    end(row)
            now, go = time.monotonic(), []
            for key, cohort in list(cohorts.items()):
                if cohort.ready and (not cohort.waiting or now - cohort.since >= LINGER_S):
                    go += cohort.ready
                    cohort.ready, cohort.since = [], 0.0
                if not cohort.waiting and not cohort.ready:
                    del cohorts[key]
            if go:
                contexts = [live[row].rollout.prompt_ids + live[row].rollout.response_ids for row in go]
                seeds = None
                if params.seed is not None:
                    seeds = [turn_seed(params.seed, row // n, row % n, live[row].rollout.turns) for row in go]
                launch(go, contexts, 1, replace(params, seed=None, seeds=seeds))
            rewards.poll()
    for ep in live:
        ep.rollout.env_info = ep.info
    ids = [i for i in reward_ids if i is not None]
    if len(ids) != len(live):
        raise RuntimeError(f"the generator answered {len(ids)} of the {len(live)} episodes asked for")
    return PendingRollouts([ep.rollout for ep in live], ids, time.monotonic() - start)


def turn_seed(seed: int, prompt: int, sample: int, turn: int) -> int:
    """The seed of model turn ``turn`` (0: the first) of sample ``sample`` of prompt ``prompt`` in episodes
    whose first turn was seeded ``seed`` (the run's seed and the step). Hashed, not added up: vLLM draws a
    step's first turns from ``seed + sample`` and the next step's from ``seed + 1 + sample``, so sums of small
    numbers would hand one episode's stream to another."""
    digest = hashlib.blake2b(f"{seed}:{prompt}:{sample}:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2  # 62 bits: room for ``seed + j`` in a torch or vLLM seed


# Samples one generation call returned wait for each other's environment steps at most this long before
# their next turns go to the engines without the slow ones: long enough for steps that finish together
# (a batch of calculator calls) to make one batch, short against a generation round.
LINGER_S = 1.0


@dataclass
class _Cohort:
    key: int
    waiting: set[int] = field(default_factory=set)  # rows whose environment step is running
    ready: list[int] = field(default_factory=list)  # rows whose next turn can go
    since: float = 0.0  # when the first of ``ready`` became ready (0: none is)


def _apply_step(
    ep: _Live,
    fut: Future,
    env: Environment,
    turns: TurnEncoder,
    params: SamplingParams,
    max_context: int,
    last: bool,
) -> bool:
    """Apply a finished environment step to ``ep``: True when its next turn goes (the glue appended), False
    when the episode ends here (the environment said so, it raised, the token budget is spent, or this was
    its ``last`` turn, whose step counts only for its reward and counters)."""
    try:
        step = fut.result()
    except Exception as e:  # an environment's bug ends its episode, not the run
        log.warning("environment %r raised on a model turn, ending the episode: %s", env.name, e)
        return False
    for k, v in step.info.items():
        ep.info[k] = ep.info.get(k, 0.0) + v
    ep.environment_reward = step.reward  # the last step's stands, however the episode ends
    if step.done or not step.messages or last:
        return False
    r = ep.rollout
    try:  # the turn's sampled ids, not its finish reason, say whether its end-of-turn token is there
        glue = turns.continuation(r.example["messages"], step.messages, r.completion.token_ids)
    except Exception as e:  # a template that refuses this answer (checked at start-up): the episode ends
        log.warning(
            "the chat template cannot render environment %r's answer, ending the episode: %s", env.name, e
        )
        return False
    if len(r.prompt_ids) + len(r.response_ids) + len(glue) + params.max_new_tokens > max_context:
        return False  # the token budget is spent: the last turn stands as the answer
    r.response_ids += glue
    r.response_mask += [0] * len(glue)
    r.response_logprobs += [0.0] * len(glue)  # masked out of the loss and the metrics
    return True


def generate_by_environment(
    env: RolloutEnvironment, rewards: RewardRunner, examples: list[dict], n: int, params: SamplingParams
) -> PendingRollouts:
    """Rollouts an environment runs itself through the generation endpoint (``env.verifiers``), ``n`` per
    example: each becomes one sample of the turns the endpoint sampled (:func:`trainer.envs.base.chain`), its
    prompt the ids the endpoint rendered, and the environment's score goes to the ``environment`` reward.
    Unseeded: the environment sends every request of a call with the same sampling arguments, so one seed
    would give a group's alike requests the same draws (:func:`generate_episodes` seeds each sample and turn
    of its own)."""
    start = time.monotonic()
    sampling: dict[str, Any] = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "max_tokens": params.max_new_tokens,
    }
    if params.stop_strings:
        sampling["stop"] = list(params.stop_strings)
    trajectories = env.run(examples, n, sampling)
    rollouts, items = [], []
    for row, t in enumerate(trajectories):
        example = examples[row // n]
        sample = chain(t.turns)
        last = t.turns[sample.turns - 1]
        r = Rollout(
            {**example, "prompt_ids": sample.prompt_ids},
            Completion(last.completion_ids, last.logprobs, t.text, last.finish_reason),
            turns=sample.turns,
        )
        r.response_ids, r.response_mask, r.response_logprobs = (
            sample.response_ids,
            sample.response_mask,
            sample.response_logprobs,
        )
        r.env_info = {
            **t.info,
            "turns": float(sample.turns),
            "turns_dropped": float(len(t.turns) - sample.turns),
        }
        rollouts.append(r)
        items.append(
            (example["ground_truth"], t.text, question_of(example), example.get("messages"), t.reward)
        )
    ids = rewards.submit(items)
    return PendingRollouts(rollouts, ids, time.monotonic() - start)


def finish(pending: PendingRollouts, rewards: RewardRunner) -> list[Rollout]:
    """Wait for the rewards (each bounded by env.reward_timeout_s) and attach them (once)."""
    if all(r.reward is not None for r in pending.rollouts):
        return pending.rollouts
    for rollout, result in zip(pending.rollouts, rewards.results(pending.reward_ids)):
        rollout.reward = result
    return pending.rollouts
