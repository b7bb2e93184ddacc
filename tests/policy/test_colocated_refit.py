"""The colocated engine's memory order, driven through the real PolicyWorker (one gloo rank, in this process).

The engine is a stand-in that records every call the worker makes; ``torch.cuda.empty_cache`` records
itself too. The order checked is the GPU one, and the worker makes the same calls on CPU (the CPU twin):
generation (several calls: rollout turns, dynamic-sampling rounds) -> the engine sleeps before the first
logprob pass -> training -> empty_cache -> wake the weights -> load -> empty_cache -> wake the KV cache
-> generation. The policy's forwards and optimizer steps are recorded beside the engine's calls (hooks on
the real modules), so the record shows where the engine sleeps relative to them. It also checks the refit's gather: at most two FSDP units unsharded at once, and tensors
that stay valid after the gather moved on.
"""

from __future__ import annotations

import fnmatch

import pytest
import torch

from tests.policy import colocated
from tests.policy.colocated import train_step
from tests.policy.helpers import refit_samples
from trainer.generation.base import SamplingParams
from trainer.policy.batch import Sample

worker = colocated.worker  # the fixture: the real rank with its recording engine


def _a_step(w, samples: list[Sample]) -> None:
    """What the GRPO loop asks of a colocated rank in one step (trainer/loop/grpo.py): a two-turn
    rollout, the old and reference logprob passes, training, then the refit."""
    params = SamplingParams(max_new_tokens=2, seed=0)
    w.generate([s.prompt_ids for s in samples], 1, params)  # turn 1
    w.generate([s.prompt_ids for s in samples], 1, params)  # turn 2 (or a second dynamic-sampling round)
    for s, lp in zip(samples, w.compute_logprobs(samples)):
        s.old_logprobs = lp
    for s, lp in zip(samples, w.compute_logprobs(samples, reference=True)):
        s.ref_logprobs = lp
    train_step(w, samples)
    w.refresh_engine()


REFIT = ["empty_cache", "wake_up(weights)", "update_weights", "empty_cache", "wake_up(kv_cache)"]


@pytest.mark.parametrize("worker", [{"kl": 0.01}], indirect=True)  # a reference model: two logprob passes
def test_should_sleep_before_the_logprob_passes_and_wake_weights_then_kv_cache_when_a_colocated_rank_refits(
    worker,
):
    samples = refit_samples()
    _a_step(worker, samples)
    _a_step(worker, samples)
    one_step = [
        "generate",
        "generate",  # nothing between the turns: the engine stays awake through a rollout
        "sleep",  # once, before the first logprob pass
        "policy forward",
        "reference forward",  # the old and reference logprob passes
        "policy forward",
        "optimizer step",  # training
        *REFIT,
    ]
    assert worker.calls == one_step + one_step


def test_should_sleep_when_training_comes_first_when_no_logprob_pass_runs(worker):
    samples = refit_samples()
    worker.generate([s.prompt_ids for s in samples], 1, SamplingParams(max_new_tokens=2))
    train_step(worker, samples)
    worker.refresh_engine()
    worker.generate([s.prompt_ids for s in samples], 1, SamplingParams(max_new_tokens=2))  # e.g. validation
    assert worker.calls == ["generate", "sleep", "policy forward", "optimizer step", *REFIT, "generate"]


def test_should_sleep_again_when_the_engine_generated_after_sleeping_without_a_refit(worker):
    samples = refit_samples()
    prompts = [s.prompt_ids for s in samples]
    worker.generate(prompts, 1, SamplingParams(max_new_tokens=2))
    worker.compute_logprobs(samples)
    worker.generate(prompts, 1, SamplingParams(max_new_tokens=2))  # the engine wakes itself (its contract)
    worker.compute_logprobs(samples)
    assert worker.calls == ["generate", "sleep", "policy forward", "generate", "sleep", "policy forward"]


def test_should_load_the_trained_weights_when_the_refit_gathers_unit_by_unit(worker):
    samples = refit_samples()
    worker.generate([s.prompt_ids for s in samples], 1, SamplingParams(max_new_tokens=2))
    train_step(worker, samples)
    worker.refresh_engine()
    expected = worker.full_state_dict()
    assert sorted(worker.engine.loaded) == sorted(expected)
    for name, tensor in expected.items():  # tensors kept past their unit's reshard are still the weights
        assert torch.equal(worker.engine.loaded[name], tensor.to(worker.engine_dtype)), name


FROZEN = "model.layers.0.*"


@pytest.mark.parametrize(
    "worker",
    [{"freeze": [FROZEN], "reloads": True}, {"freeze": [FROZEN], "reloads": False}],
    indirect=True,
    ids=["engine-discards-weights-asleep", "engine-keeps-weights-asleep"],
)
def test_should_send_frozen_weights_only_when_the_engine_discarded_its_weights_in_sleep(worker):
    """vLLM's level-2 sleep frees the weights: its refit must bring the frozen ones back too; an engine
    that keeps them (level 1, hf) gets the trainable ones alone."""
    samples = refit_samples()
    worker.generate([s.prompt_ids for s in samples], 1, SamplingParams(max_new_tokens=2))
    train_step(worker, samples)
    worker.refresh_engine()
    frozen = {n for n in worker.full_state_dict() if fnmatch.fnmatch(n, FROZEN)}
    assert frozen
    sent_frozen = frozen & set(worker.engine.loaded)
    assert sent_frozen == (frozen if worker.engine.reloads_every_weight else set())


def test_should_gather_at_most_two_fsdp_units_at_once_and_keep_yielded_tensors_valid_when_iterating(
    worker, monkeypatch
):
    from torch.distributed.fsdp import FSDPModule

    gathered: set[int] = set()
    peak = 0
    unshard, reshard = FSDPModule.unshard, FSDPModule.reshard

    def counting_unshard(self, *args, **kwargs):
        nonlocal peak
        gathered.add(id(self))
        peak = max(peak, len(gathered))
        return unshard(self, *args, **kwargs)

    def counting_reshard(self):
        gathered.discard(id(self))
        return reshard(self)

    monkeypatch.setattr(FSDPModule, "unshard", counting_unshard)
    monkeypatch.setattr(FSDPModule, "reshard", counting_reshard)
    units = len(worker._fsdp_units())
    assert units >= 3  # the root and at least two blocks: "two at once" is then less than all of them
    kept = list(worker.iter_full_weights())  # every tensor held until the end, as a bucketing sender may
    assert peak == 2 and not gathered
    # A tensor that shared its unit's gathered buffer has lost its memory at the reshard (reading it crashes).
    freed = [name for name, t in kept if t.untyped_storage().nbytes() < t.numel() * t.element_size()]
    assert not freed, f"yielded tensors whose memory FSDP freed: {freed}"
    for name, tensor in worker.full_state_dict().items():
        assert torch.equal(dict(kept)[name], tensor), name
