"""The one place generation engines are built: training (both placements), evaluation and the benchmarks.

``generation.backend`` names the engine. The registry below checks the name when an engine is built,
with a one-line error listing the valid ones; vLLM is imported only when it is chosen.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trainer.config import ConfigError, GenerationConfig, LoRAConfig
from trainer.generation.base import GenerationEngine


@dataclass
class EngineSpec:
    """What an engine needs besides ``generation.*``: the model and how it is placed."""

    model_path: str
    dtype: str  # float32 | bfloat16 | float16 (``auto`` already resolved)
    seed: int = 0
    max_model_len: int | None = None  # prompt + completion tokens; None: the model's own limit
    trust_remote_code: bool = False
    tokenizer_path: str | None = None
    device: torch.device | None = None
    colocated: bool = False  # shares its device and cores with a policy rank
    threads: int | None = None  # CPU threads the engine may use (None: all of this process's)
    base_model: torch.nn.Module | None = (
        None  # hf: copy these already loaded weights instead of reading the files
    )
    weights_from_another_process: bool = False  # disaggregated: vLLM opens its weight-transfer receiver
    # policy.lora when enabled: the engine serves the base with the policy's adapters, and refits take the
    # adapters alone (update_adapter / receive_adapter). hf: base_model comes with them already injected.
    lora: LoRAConfig | None = None
    # the most sequences one generate call holds (a step's samples): with max_model_len, a CPU vLLM engine's
    # KV cache is sized to hold them and no more (trainer.generation.vllm_cpu.step_kv_bytes); None: its default
    sequences: int | None = None


def _build_hf(gen: GenerationConfig, spec: EngineSpec) -> GenerationEngine:
    from trainer.generation.hf import HFGenerationEngine
    from trainer.models import DTYPES, load_model, load_tokenizer

    device = spec.device or torch.device("cpu")
    if spec.base_model is not None:
        # A plain copy: FSDP forward passes are collectives, and ranks decode different prompts for
        # different numbers of steps, so they cannot share the sharded model.
        model = copy.deepcopy(spec.base_model).to(device, dtype=DTYPES[spec.dtype])
    else:
        model = load_model(spec.model_path, spec.dtype, spec.trust_remote_code).to(device)
        if spec.lora is not None:
            from trainer.models.lora import apply

            apply(model, spec.lora)  # B = 0: the base until the first refit brings the policy's adapters
    tokenizer = load_tokenizer(spec.tokenizer_path or spec.model_path, spec.trust_remote_code)
    return HFGenerationEngine(model, tokenizer, gen.batch_size)


def _build_vllm(gen: GenerationConfig, spec: EngineSpec) -> GenerationEngine:
    from trainer.generation.vllm_engine import VLLMGenerationEngine

    return VLLMGenerationEngine(
        spec.model_path,
        gen,
        spec.dtype,
        spec.seed,
        spec.max_model_len,
        spec.threads,
        weight_transfer=spec.weights_from_another_process,
        colocated=spec.colocated,
        lora=spec.lora,
        sequences=spec.sequences,
    )


ENGINES: dict[str, Callable[[GenerationConfig, EngineSpec], GenerationEngine]] = {
    "hf": _build_hf,
    "vllm": _build_vllm,
}


def build_engine(gen: GenerationConfig, spec: EngineSpec) -> GenerationEngine:
    """The engine ``gen.backend`` names, over the model of ``spec``."""
    try:
        build = ENGINES[gen.backend]
    except KeyError:
        raise ConfigError(
            f"generation.backend={gen.backend!r} is not an engine; choose one of: {', '.join(ENGINES)}"
        ) from None
    return build(gen, spec)
