"""The vLLM engine's sleep mode and weight-update decisions, on any machine.

``vllm.LLM`` is replaced by a recorder (the engine's start is skipped), so these tests see exactly what the
engine asks of vLLM: on a colocated GPU engine, ``sleep(level=1)`` and ``wake_up(tags=...)`` in the refit's
order; on CPU, or an engine with its GPU alone (no sleep mode), nothing, while the engine answers the same
(the CPU twin). The real CPU engine takes the same calls in tests/generation/test_engine_contract.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from trainer.config import GenerationConfig
from trainer.generation.base import SamplingParams
from trainer.generation.vllm_engine import VLLMGenerationEngine, needs_layerwise_reload


class RecordingLLM:
    def __init__(self):
        self.calls: list[str] = []

    def sleep(self, level: int = 1):
        self.calls.append(f"sleep(level={level})")

    def wake_up(self, tags=None):
        self.calls.append(f"wake_up({tags})")

    def generate(self, prompts, sampling, use_tqdm=True, lora_request=None):  # vllm.LLM.generate's keywords
        self.calls.append("generate")
        return []


@pytest.fixture
def make_engine(monkeypatch):
    """``make_engine(gpu, colocated)``: an engine over a RecordingLLM, as if on a GPU or not."""

    def make(gpu: bool, colocated: bool) -> tuple[VLLMGenerationEngine, RecordingLLM]:
        llm = RecordingLLM()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
        monkeypatch.setattr(VLLMGenerationEngine, "_start", lambda self, *args: setattr(self, "_llm", llm))
        engine = VLLMGenerationEngine("some/model", GenerationConfig(backend="vllm"), "bfloat16", seed=0,
                                      max_model_len=128, colocated=colocated)
        return engine, llm

    return make


def _refit_and_generate(engine: VLLMGenerationEngine) -> list[tuple[str, ...]]:
    """A colocated step as the policy rank drives it, with a repeated call at each stage; the engine's
    ``asleep`` after each call."""
    states = []
    for call in (
        engine.sleep, engine.sleep,
        lambda: engine.wake_up(tags=["weights"]), lambda: engine.wake_up(tags=["weights"]),
        lambda: engine.wake_up(tags=["kv_cache"]),
        engine.sleep,
        lambda: engine.generate([[1, 2]], 1, SamplingParams(max_new_tokens=2)),  # asleep: wakes itself
    ):
        call()
        states.append(engine.asleep)
    return states


STATES = [
    ("weights", "kv_cache"), ("weights", "kv_cache"), ("kv_cache",), ("kv_cache",), (), ("weights", "kv_cache"), (),
]


@pytest.mark.vllm
def test_should_free_and_restore_through_vllm_in_the_refits_order_when_colocated_on_a_gpu(make_engine):
    engine, llm = make_engine(gpu=True, colocated=True)
    assert _refit_and_generate(engine) == STATES
    assert llm.calls == [
        "sleep(level=1)",  # once: sleeping twice is a no-op
        "wake_up(['weights'])",
        "wake_up(['kv_cache'])",
        "sleep(level=1)",
        "wake_up(['weights', 'kv_cache'])", "generate",  # asked to generate while asleep: weights, then KV cache
    ]


@pytest.mark.vllm
@pytest.mark.parametrize(("gpu", "colocated"), [(False, True), (False, False), (True, False)])
def test_should_answer_as_a_gpu_engine_but_leave_vllm_alone_when_the_engine_has_no_sleep_mode(
    make_engine, gpu, colocated
):
    engine, llm = make_engine(gpu=gpu, colocated=colocated)
    assert _refit_and_generate(engine) == STATES  # the same states as the colocated GPU engine
    assert llm.calls == ["generate"]  # vLLM without sleep mode would refuse sleep and wake_up


def test_should_refuse_a_tag_vllm_does_not_defer_when_asked_to_wake_it(make_engine):
    engine, _ = make_engine(gpu=True, colocated=True)
    engine.sleep()
    with pytest.raises(ValueError, match="^wake_up: unknown tag 'kv'; choose from weights, kv_cache$"):
        engine.wake_up(tags=["kv"])


# ----- layerwise reload ------------------------------------------------------------------------------------


def test_should_reload_layerwise_when_the_engine_has_a_quantization_config_on_any_device():
    model = torch.nn.Linear(4, 4)
    assert needs_layerwise_reload(model, SimpleNamespace(quantization="fp8"))
    assert needs_layerwise_reload(model, SimpleNamespace(quantization="fp8_per_channel"))
    assert not needs_layerwise_reload(model, SimpleNamespace(quantization=None))


def test_should_reload_layerwise_when_a_layer_kept_only_its_packed_weight():
    model = torch.nn.Linear(4, 4)
    model.weight = torch.nn.Parameter(torch.empty(0))  # what vLLM's CPU dispatch leaves behind a packed kernel
    assert needs_layerwise_reload(model, SimpleNamespace(quantization=None))
