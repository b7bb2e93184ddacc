"""A policy rank's own generation engine (colocated generation): how the rank builds it and the order in
which a refit hands it the new weights. The rank copies its loaded model into an hf engine, or starts a
vLLM one on its device (:mod:`trainer.generation.factory`); each rank's engine samples from a stream of
its own. The memory order around generation (sleep before the policy's forwards, the refit's wake-ups)
is told in :mod:`trainer.policy.worker`'s docstring; :func:`refresh` is its step 3.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from trainer.config import Config, LoRAConfig
from trainer.generation.base import GenerationEngine


def rank_seed_offset(rank: int) -> int:
    """Each colocated engine samples from its own stream: the same seed on every rank would give
    the same samples to prompts that happen to share a position in their shards."""
    return 1 + rank


def build(
    cfg: Config,
    model_path: str,
    rank: int,
    device: torch.device,
    host: torch.nn.Module | None,
    lora: LoRAConfig | None,
) -> GenerationEngine:
    """The rank's engine; ``host``: the loaded model (with its adapters) an hf engine copies, before the
    policy's attention is set; ``lora``: the adapters' config, or None."""
    from trainer.generation.factory import EngineSpec, build_engine

    spec = EngineSpec(
        model_path=model_path,
        dtype=cfg.engine_dtype,
        seed=cfg.seed + rank_seed_offset(rank),
        max_model_len=cfg.policy.max_total_sequence_length,
        trust_remote_code=cfg.model.trust_remote_code,
        tokenizer_path=cfg.model.tokenizer,
        device=device,
        colocated=True,
        threads=torch.get_num_threads(),
        base_model=host,
        lora=lora,
        sequences=cfg.grpo.batch_size,  # a rank draws its share of the step's samples, at most all of them
    )
    return build_engine(cfg.generation, spec)


def refresh(
    engine: GenerationEngine, weights: Callable[[], Iterator[tuple[str, torch.Tensor]]], adapters: bool
) -> None:
    """Load the updated weights (``weights()`` gathers them: the trainable ones, or the adapters alone with
    ``adapters``; a frozen weight keeps what the engine was built with, unless the engine's sleep discarded
    it: then ``weights()`` brings the frozen ones too)
    into ``engine`` in the order that keeps the device's peak low: what training cached goes back to the device
    first, the engine's weights wake, the new ones load as they are gathered (the iterator is made
    here, on the stream the refit runs on), and only then does the KV cache wake. A vLLM engine that slept
    at level 2 (full weights: :func:`trainer.generation.vllm_engine.sleep_level`) wakes to fresh, undefined
    weight memory, which this load overwrites whole before anything generates; with LoRA it slept at
    level 1 and its base comes back from host memory."""
    torch.cuda.empty_cache()  # a no-op without CUDA: the same call on every device
    engine.wake_up(tags=["weights"])
    if adapters:
        engine.update_adapter(weights())
    else:
        engine.update_weights(weights())
    torch.cuda.empty_cache()  # the gathered units, freed: the KV cache's allocator cannot use the cache
    engine.wake_up(tags=["kv_cache"])
