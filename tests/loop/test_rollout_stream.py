"""The rollout stream: the staleness bound of async GRPO and DAPO's dynamic sampling.

The producer's generation rounds are replaced by timed fakes (no Ray, no model), so the tests drive
the real gate, thread and queue under many interleavings: generation faster or slower than training,
and a slow reward between generation and the trainer.
"""

from __future__ import annotations

import random
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from trainer.config import load
from trainer.data.loader import PromptLoader
from trainer.generation.base import Completion, SamplingParams
from trainer.loop import rollout_stream
from trainer.loop.rollout import PendingRollouts, Rollout
from trainer.loop.rollout_stream import AsyncRollouts, SyncRollouts, informative_groups
from trainer.rewards.runner import RewardResult

PROMPTS, SAMPLES = 2, 2


def _cfg(*overrides: str):
    return load(
        [
            "experiment=tiny",
            f"grpo.num_prompts_per_step={PROMPTS}",
            f"grpo.num_generations_per_prompt={SAMPLES}",
            *overrides,
        ]
    )


class FakeEngines:
    """Generation rounds that take a while and rewards that are known up front; weight pushes that
    fail the test if they land in the middle of a round."""

    def __init__(self, gen_s: tuple[float, float] = (0.0, 0.0), reward=lambda ex: float(ex["id"] % 2)):
        self.gen_s, self.reward = gen_s, reward
        self.in_round = threading.Event()
        self.pushes: list[int] = []
        self.rng = random.Random(0)

    def round(self, producer, examples, params):
        self.in_round.set()
        try:
            time.sleep(self.rng.uniform(*self.gen_s))
        finally:
            self.in_round.clear()
        rollouts = []
        for ex in examples:
            for j in range(SAMPLES):
                r = Rollout(ex, Completion([1], [0.0], "x", "stop"))
                # the group's rewards are all equal unless reward() says "mixed" (-1)
                value = self.reward(ex)
                r.reward = RewardResult(float(j % 2) if value < 0 else value, False)
                rollouts.append(r)
        return PendingRollouts(rollouts, [], 0.01)

    def update_weights(self):
        assert not self.in_round.is_set(), "weights pushed in the middle of a generation round"


def _state(cfg, engines: FakeEngines, step: int = 0):
    examples = [{"id": i, "prompt_ids": [i]} for i in range(64)]
    return SimpleNamespace(
        progress=SimpleNamespace(step=step),
        loader=PromptLoader(examples, cfg.grpo.num_prompts_per_step, cfg.seed, shuffle=False),
        rewards=SimpleNamespace(scorers=None, state_dict=lambda: {}),
        feedback=None,
        environment=None,
        turns=None,
        generator=engines,
    )


def _params(step: int) -> SamplingParams:
    return SamplingParams(seed=step)


def test_should_flag_groups_whose_rewards_differ():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5])  # (4 groups x 2)
    assert informative_groups(rewards, 2).tolist() == [False, True, False, False]


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize(
    ("gen_s", "train_s", "reward_s"),
    [
        ((0.0, 0.005), (0.02, 0.04), 0.0),  # generation fast: the producer runs k steps ahead
        ((0.02, 0.04), (0.0, 0.005), 0.0),  # training fast: the trainer waits for batches
        ((0.0, 0.005), (0.0, 0.01), 0.03),  # a slow reward between generation and the trainer
    ],
)
def test_should_never_train_on_a_batch_staler_than_the_bound(monkeypatch, k, gen_s, train_s, reward_s):
    cfg = _cfg("generation.placement=disaggregated", f"grpo.async.max_staleness={k}", "grpo.max_num_steps=15")
    engines = FakeEngines(gen_s)
    monkeypatch.setattr(rollout_stream._Producer, "_round", lambda self, ex, p: engines.round(self, ex, p))
    real_finish = rollout_stream.rollout.finish

    def slow_finish(pending, rewards):
        time.sleep(reward_s)
        return real_finish(pending, rewards)

    monkeypatch.setattr(rollout_stream.rollout, "finish", slow_finish)
    stream = AsyncRollouts(cfg, _state(cfg, engines), _params)
    rng, versions, stale = random.Random(1), [], []
    try:
        for step in range(1, 16):
            batch = stream.next(step)
            assert batch.step == step and batch.loader_state["position"] == step * PROMPTS
            assert [r.example["id"] for r in batch.pending.rollouts[::SAMPLES]] == [
                (step - 1) * PROMPTS + i for i in range(PROMPTS)
            ]
            stale += batch.staleness()
            versions.append(min(batch.versions))
            time.sleep(rng.uniform(*train_s))
            stream.push_weights(step)
    finally:
        stream.close()
    assert max(stale) <= k and min(stale) >= 0
    assert versions == sorted(versions)  # the weights that generated the batches never go back
    if gen_s[1] < train_s[0]:
        assert max(stale) == k  # not vacuous: generation really ran ahead of the policy


def test_should_hand_the_producers_error_to_the_trainer(monkeypatch):
    cfg = _cfg("generation.placement=disaggregated", "grpo.async.max_staleness=1")

    def broken(self, examples, params):
        raise RuntimeError("engine died")

    monkeypatch.setattr(rollout_stream._Producer, "_round", broken)
    stream = AsyncRollouts(cfg, _state(cfg, FakeEngines()), _params)
    with pytest.raises(RuntimeError, match="engine died"):
        stream.next(1)
    stream.close()


def test_should_stop_at_the_wait_callback_while_waiting_for_a_batch(monkeypatch):
    cfg = _cfg("generation.placement=disaggregated", "grpo.async.max_staleness=1")
    engines = FakeEngines((5.0, 5.0))
    monkeypatch.setattr(rollout_stream._Producer, "_round", lambda self, ex, p: engines.round(self, ex, p))

    class Stop(Exception):
        pass

    def on_wait():
        raise Stop

    stream = AsyncRollouts(cfg, _state(cfg, engines), _params, on_wait=on_wait)
    t0 = time.monotonic()
    with pytest.raises(Stop):
        stream.next(1)
    stream.close()
    assert time.monotonic() - t0 < 3  # a preemption is not held up by the 5 s generation round


def test_should_start_from_the_resumed_step(monkeypatch):
    cfg = _cfg("generation.placement=disaggregated", "grpo.async.max_staleness=1", "grpo.max_num_steps=8")
    engines = FakeEngines()
    monkeypatch.setattr(rollout_stream._Producer, "_round", lambda self, ex, p: engines.round(self, ex, p))
    state = _state(cfg, engines, step=5)
    state.loader.load_state_dict({"epoch": 0, "position": 5 * PROMPTS})
    stream = AsyncRollouts(cfg, state, _params)
    try:
        batch = stream.next(6)
        assert batch.versions == [5] * PROMPTS * SAMPLES and batch.staleness() == [0] * PROMPTS * SAMPLES
        assert batch.pending.rollouts[0].example["id"] == 10  # the prompts after the checkpoint's position
    finally:
        stream.close()


# ----- dynamic sampling ------------------------------------------------------------------------------


def _dynamic(monkeypatch, max_rounds: int, reward):
    cfg = _cfg("grpo.dynamic_sampling.enabled=true", f"grpo.dynamic_sampling.max_rounds={max_rounds}")
    engines = FakeEngines(reward=reward)
    seeds = []

    def round_(self, examples, params):
        seeds.append(params.seed)
        return engines.round(self, examples, params)

    monkeypatch.setattr(rollout_stream._Producer, "_round", round_)
    return SyncRollouts(cfg, _state(cfg, engines), _params), seeds


def test_should_sample_more_prompts_until_the_batch_is_informative(monkeypatch):
    # even ids: mixed rewards (informative); odd ids: all 1.0
    stream, seeds = _dynamic(monkeypatch, 4, lambda ex: -1.0 if ex["id"] % 2 == 0 else 1.0)
    batch = stream.next(3)
    ids = [r.example["id"] for r in batch.pending.rollouts[::SAMPLES]]
    assert ids == [0, 2]  # two rounds of two prompts, one informative group each
    assert (batch.rounds, batch.prompts_drawn, batch.informative) == (2, 4, 2)
    assert len(set(seeds)) == 2 and seeds[0] == 3  # each round samples with its own seed
    m = batch.metrics()
    assert m["train/dynamic_sampling_rounds"] == 2 and m["train/informative_group_frac"] == 0.5
    assert batch.loader_state["position"] == 4


def test_should_fill_with_uninformative_groups_after_max_rounds(monkeypatch):
    stream, _ = _dynamic(monkeypatch, 1, lambda ex: -1.0 if ex["id"] == 1 else 0.0)
    batch = stream.next(1)
    ids = [r.example["id"] for r in batch.pending.rollouts[::SAMPLES]]
    assert ids == [1, 0]  # the informative group first, then one that is not
    assert (batch.rounds, batch.prompts_drawn, batch.informative) == (1, 2, 1)
    assert len(batch.pending.rollouts) == PROMPTS * SAMPLES
