"""The vLLM engine's sleep mode, refit and weight-update decisions, on any machine.

``vllm.LLM`` is replaced by a recorder (the engine's start is skipped), so these tests see exactly what the
engine asks of vLLM: on a colocated GPU engine, ``sleep(level=2)`` (``level=1`` with LoRA) and
``wake_up(tags=...)`` in the refit's order; on CPU, or an engine with its GPU alone (no sleep mode),
nothing, while the engine answers the same (the CPU twin). After every refit the prefix and encoder caches
are reset; a received update that fails is not finished. The real CPU engine takes the same calls in
tests/generation/test_engine_contract.py and tests/generation/test_weight_transport.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from trainer.config import GenerationConfig, LoRAConfig
from trainer.generation.base import SamplingParams
from trainer.generation.vllm_engine import VLLMGenerationEngine, needs_layerwise_reload


class RecordingLLM:
    """What the engine calls of ``vllm.LLM`` (and of its ``llm_engine``), in order; ``fail`` names a call that
    raises, as vLLM's worker re-raises a failed update."""

    def __init__(self, fail: str | None = None):
        self.calls: list[str] = []
        self.fail = fail
        self.llm_engine = SimpleNamespace(
            reset_encoder_cache=lambda: self._call("llm_engine.reset_encoder_cache")
        )

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name == self.fail:
            raise ValueError("There is no module or parameter named 'model.bogus' in LlamaForCausalLM")

    def sleep(self, level: int = 1):
        self.calls.append(f"sleep(level={level})")

    def wake_up(self, tags=None):
        self.calls.append(f"wake_up({tags})")

    def generate(self, prompts, sampling, use_tqdm=True, lora_request=None):  # vllm.LLM.generate's keywords
        self.calls.append("generate")
        return []

    def start_weight_update(self):
        self._call("start_weight_update")

    def update_weights(self, request):
        self._call("update_weights")

    def finish_weight_update(self, weight_version=None):
        self._call("finish_weight_update")

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self._call(f"collective_rpc({method.__name__})")
        return []

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self._call("reset_prefix_cache")


class RecordingModel(torch.nn.Module):
    """The worker's model as update_weights sees it: ``load_weights`` records itself and reports what it
    loaded (vLLM's contract), here every name it was given."""

    def __init__(self, calls: list[str]):
        super().__init__()
        self.calls = calls
        self.a = torch.nn.Linear(2, 2)
        self.b = torch.nn.Linear(2, 2, bias=False)

    def load_weights(self, weights) -> set[str]:
        self.calls.append("load_weights")
        return {name for name, _ in weights}


ALL_WEIGHTS = ["a.weight", "a.bias", "b.weight"]


@pytest.fixture
def make_engine(monkeypatch):
    """``make_engine(gpu, colocated, lora, fail)``: an engine over a RecordingLLM (and a RecordingModel in its
    worker), as if on a GPU or not."""

    def make(
        gpu: bool,
        colocated: bool,
        lora: bool = False,
        fail: str | None = None,
    ) -> tuple[VLLMGenerationEngine, RecordingLLM]:
        llm = RecordingLLM(fail)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
        monkeypatch.setattr(VLLMGenerationEngine, "_start", lambda self, *args: setattr(self, "_llm", llm))
        engine = VLLMGenerationEngine(
            "some/model",
            GenerationConfig(backend="vllm"),
            "bfloat16",
            seed=0,
            max_model_len=128,
            colocated=colocated,
            lora=LoRAConfig(rank=8) if lora else None,
        )
        engine._tied = False
        model = RecordingModel(llm.calls)
        worker = SimpleNamespace(
            vllm_config=SimpleNamespace(model_config=SimpleNamespace(quantization=None)),
            model_runner=SimpleNamespace(get_model=lambda: model),
        )
        monkeypatch.setattr(engine, "_worker", lambda: worker)
        return engine, llm

    return make


def _refit(engine: VLLMGenerationEngine, names=ALL_WEIGHTS) -> None:
    engine.update_weights((name, torch.zeros(1)) for name in names)


def _refit_and_generate(engine: VLLMGenerationEngine) -> list[tuple[str, ...]]:
    """Two colocated steps as the policy rank drives them (trainer/policy/colocated.py), with repeated
    calls; the engine's ``asleep`` after each call."""
    states = []
    for call in (
        engine.sleep,
        engine.sleep,
        lambda: engine.wake_up(tags=["weights"]),
        lambda: engine.wake_up(tags=["weights"]),
        lambda: _refit(engine),
        lambda: engine.wake_up(tags=["kv_cache"]),
        engine.sleep,
        lambda: _refit(engine),  # asleep: the weights wake, the KV cache stays asleep
        lambda: engine.generate([[1, 2]], 1, SamplingParams(max_new_tokens=2)),  # wakes the KV cache itself
    ):
        call()
        states.append(engine.asleep)
    return states


STATES = [
    ("weights", "kv_cache"),
    ("weights", "kv_cache"),
    ("kv_cache",),
    ("kv_cache",),
    ("kv_cache",),
    (),
    ("weights", "kv_cache"),
    ("kv_cache",),
    (),
]
REFIT = [
    "load_weights",
    "reset_prefix_cache",
    "llm_engine.reset_encoder_cache",
]  # the caches: after every refit


@pytest.mark.vllm
@pytest.mark.parametrize(("lora", "level"), [(False, 2), (True, 1)], ids=["full-weights", "lora"])
def test_should_free_and_restore_through_vllm_in_the_refits_order_when_colocated_on_a_gpu(
    make_engine, lora, level
):
    engine, llm = make_engine(gpu=True, colocated=True, lora=lora)
    assert engine.sleep_level == level  # full-weight refits overwrite the weights; LoRA's base must survive
    assert _refit_and_generate(engine) == STATES
    assert llm.calls == [
        f"sleep(level={level})",  # once: sleeping twice is a no-op
        "wake_up(['weights'])",
        *REFIT,
        "wake_up(['kv_cache'])",
        f"sleep(level={level})",
        "wake_up(['weights'])",
        *REFIT,
        "wake_up(['kv_cache'])",
        "generate",  # asked to generate with the KV cache asleep: it wakes first
    ]


@pytest.mark.vllm
@pytest.mark.parametrize(("gpu", "colocated"), [(False, True), (False, False), (True, False)])
def test_should_answer_as_a_gpu_engine_but_leave_vllm_alone_when_the_engine_has_no_sleep_mode(
    make_engine, gpu, colocated
):
    engine, llm = make_engine(gpu=gpu, colocated=colocated)
    assert _refit_and_generate(engine) == STATES  # the same states as the colocated GPU engine
    assert llm.calls == [*REFIT, *REFIT, "generate"]  # vLLM without sleep mode would refuse sleep and wake_up


@pytest.mark.vllm
@pytest.mark.parametrize("gpu", [True, False], ids=["gpu", "cpu-twin"])
def test_should_refuse_to_generate_after_a_level_2_sleep_until_a_refit_loaded_every_weight(make_engine, gpu):
    engine, llm = make_engine(gpu=gpu, colocated=True)
    engine.sleep()
    with pytest.raises(
        RuntimeError, match="^vLLM engine asked to generate after a level-2 sleep, before a refit"
    ):
        engine.generate([[1, 2]], 1, SamplingParams(max_new_tokens=2))
    with pytest.raises(
        RuntimeError,
        match=r"^refit after a level-2 sleep left 1 weight\(s\) of the engine unloaded "
        r"\(b.weight\)",
    ):
        _refit(engine, ALL_WEIGHTS[:2])
    _refit(engine)
    engine.generate([[1, 2]], 1, SamplingParams(max_new_tokens=2))
    assert "generate" in llm.calls


@pytest.mark.vllm
def test_should_wake_itself_and_generate_after_a_level_1_sleep_when_it_serves_lora(make_engine):
    engine, llm = make_engine(gpu=True, colocated=True, lora=True)
    engine.sleep()
    engine.generate([[1, 2]], 1, SamplingParams(max_new_tokens=2))  # the base weights came back from the host
    assert llm.calls == ["sleep(level=1)", "wake_up(['weights', 'kv_cache'])", "generate"]


# ----- a disaggregated refit (vLLM's weight-transfer API) ------------------------------------------------


@pytest.mark.vllm
def test_should_finish_the_update_then_reset_the_prefix_and_encoder_caches_when_weights_are_received(
    make_engine,
):
    engine, llm = make_engine(gpu=False, colocated=False)
    engine.receive_weights({"names": [], "dtype_names": [], "shapes": []})
    assert llm.calls == [
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
        "collective_rpc(_check_fused_names)",  # what was sent, against the fused weights (check_fused_shards)
        "reset_prefix_cache",
        "llm_engine.reset_encoder_cache",
    ]


@pytest.mark.vllm
def test_should_raise_the_updates_own_error_and_not_finish_it_when_receiving_weights_fails(make_engine):
    engine, llm = make_engine(gpu=False, colocated=False, fail="update_weights")
    with pytest.raises(ValueError, match="^There is no module or parameter named 'model.bogus'"):
        engine.receive_weights({"names": ["model.bogus"], "dtype_names": ["float32"], "shapes": [[1]]})
    # vLLM's worker closed the failed update itself; finishing it would raise in place of the cause
    assert llm.calls == ["start_weight_update", "update_weights"]


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
    model.weight = torch.nn.Parameter(
        torch.empty(0)
    )  # what vLLM's CPU dispatch leaves behind a packed kernel
    assert needs_layerwise_reload(model, SimpleNamespace(quantization=None))


# ----- what the sleep level costs the node: make plan ---------------------------------------------------


@pytest.mark.parametrize(
    ("exp", "level1_engines"), [("lora-gemma3-27b-gsm8k-h200", 8), ("gemma3-1b-math-b200", 0)]
)
def test_should_plan_host_memory_for_the_sleeping_engines_weights_only_when_they_sleep_at_level_1(
    exp, level1_engines
):
    from trainer.tools import plan

    result = plan.plan_for(exp, [])
    (host,) = [d for d in result.devices if d.role == "training node, host memory"]
    weights = result.shape.params * plan.BYTES["bfloat16"]  # both engines serve bf16 weights
    assert host.terms == {plan.SLEEPING_TERM: level1_engines * weights}
    assert host.capacity == 1500 * 2**30  # the values file's (LoRA) or the chart's request
    assert f"sleep at level {1 if level1_engines else 2}" in host.notes[0]
