"""Rollouts: sample completions and score them, with scoring overlapped with generation.

Generation is split over the generator's workers; as soon as one worker returns its completions,
their reward tasks start, while the other workers are still decoding. :func:`generate` returns with
rewards still running, so the caller can start the policy's logprob passes before it waits on them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import ray

from trainer.data.prompts import TurnEncoder
from trainer.generation.base import Completion, SamplingParams
from trainer.generation.placement import Generator
from trainer.rewards.runner import RewardResult, RewardRunner, question_of


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


def generate_multi_turn(
    generator: Generator,
    rewards: RewardRunner,
    feedback: RewardRunner,
    turns: TurnEncoder,
    examples: list[dict],
    n: int,
    params: SamplingParams,
    max_turns: int,
    max_context: int,
) -> PendingRollouts:
    """Episodes of up to ``max_turns`` attempts: after a failing attempt the environment's feedback
    becomes the next user turn; an episode ends on success, at the turn limit, or when the context
    would exceed ``max_context`` tokens. The final attempt is what gets rewarded."""
    start = time.monotonic()
    episodes = [Rollout(ex, Completion([], [], "", "length"), turns=0) for ex in examples for _ in range(n)]
    active = list(range(len(episodes)))
    for turn in range(max_turns):
        contexts = [episodes[i].prompt_ids + episodes[i].response_ids for i in active]
        turn_params = replace(params, seed=None if params.seed is None else params.seed + 7919 * turn)
        outputs: list[Completion | None] = [None] * len(active)
        for ref, idx in generator.submit(contexts, 1, turn_params):
            for k, group in zip(idx, ray.get(ref)):
                outputs[k] = group[0]
        done = [c for c in outputs if c is not None]
        if len(done) != len(active):
            raise RuntimeError(f"turn {turn + 1}: the generator answered {len(done)} of {len(active)} asked")
        for i, c in zip(active, done):
            ep = episodes[i]
            ep.completion, ep.turns = c, ep.turns + 1
            ep.response_ids += c.token_ids
            ep.response_mask += [1] * len(c.token_ids)
            ep.response_logprobs += c.logprobs
        if turn == max_turns - 1:
            break
        results = feedback.results(
            feedback.submit(
                [(episodes[i].example["ground_truth"], episodes[i].completion.text) for i in active]
            )
        )
        still = []
        for i, result in zip(active, results):
            ep = episodes[i]
            if result.feedback is None:  # passed (or the environment had nothing to say): done
                continue
            ended = ep.completion.finish_reason == "stop" and bool(ep.completion.token_ids)
            glue = turns.continuation(ep.example["messages"], result.feedback, ended)
            if len(ep.prompt_ids) + len(ep.response_ids) + len(glue) + params.max_new_tokens > max_context:
                continue
            ep.response_ids += glue
            ep.response_mask += [0] * len(glue)
            ep.response_logprobs += [0.0] * len(glue)  # masked out of the loss and the metrics
            still.append(i)
        active = still
        if not active:
            break
    ids = rewards.submit(
        [
            (
                ep.example["ground_truth"],
                ep.completion.text,
                question_of(ep.example),
                ep.example.get("messages"),
            )
            for ep in episodes
        ]
    )
    return PendingRollouts(episodes, ids, time.monotonic() - start)


def finish(pending: PendingRollouts, rewards: RewardRunner) -> list[Rollout]:
    """Wait for the rewards (each bounded by env.reward_timeout_s) and attach them (once)."""
    if all(r.reward is not None for r in pending.rollouts):
        return pending.rollouts
    for rollout, result in zip(pending.rollouts, rewards.results(pending.reward_ids)):
        rollout.reward = result
    return pending.rollouts
