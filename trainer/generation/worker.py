"""Disaggregated generation: a Ray actor that owns one engine on its own device (or cores).

After every optimizer step the policy's rank 0 broadcasts the new weights over a
:class:`~trainer.weight_sync.WeightSyncGroup`; each actor receives them tensor by tensor, in the
model's parameter order, straight into its engine.
"""

from __future__ import annotations

import os

import torch

from trainer.cluster import node_address, setup_cpu_process
from trainer.config import Config
from trainer.generation.base import Completion, SamplingParams
from trainer.generation.factory import EngineSpec, build_engine
from trainer.models import DTYPES


class GenerationWorker:
    """Wrapped with ``ray.remote`` by :class:`~trainer.generation.placement.DisaggregatedGenerator`."""

    def __init__(self, cfg: Config, model_path: str, rank: int, threads: int | None = None):
        self.cfg, self.rank, self.model_path = cfg, rank, model_path
        self.device = torch.device("cuda", 0) if cfg.cluster.use_gpus else torch.device("cpu")
        if not cfg.cluster.use_gpus:
            threads = threads or (os.cpu_count() or 1)
            setup_cpu_process(cfg, threads)
        spec = EngineSpec(
            model_path=model_path,
            dtype=cfg.engine_dtype,
            seed=cfg.seed + 1000 * (rank + 1),  # distinct from every policy rank's
            max_model_len=cfg.policy.max_total_sequence_length,
            trust_remote_code=cfg.model.trust_remote_code,
            tokenizer_path=cfg.model.tokenizer,
            device=self.device,
            threads=threads,
        )
        self.engine = build_engine(cfg.generation, spec)

    def address(self) -> tuple[str, int]:
        return node_address()

    def init_weight_sync(self, host: str, port: int, world_size: int) -> None:
        from trainer.weight_sync import WeightSyncGroup

        self.sync = WeightSyncGroup(host, port, rank=1 + self.rank, world_size=world_size, device=self.device)

    @torch.no_grad()
    def receive_weights(self) -> None:
        dtype = DTYPES[self.cfg.engine_dtype]  # what rank 0 sends
        # Shapes and order of the policy's parameters, from the model's config (no weights loaded).
        names_shapes = _parameter_shapes(self.model_path, self.cfg.model.trust_remote_code)

        def received():
            for name, shape in names_shapes:
                buf = torch.empty(shape, dtype=dtype, device=self.device)
                yield name, self.sync.broadcast(buf)

        self.engine.update_weights(received())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The hf engine's weights, for tests (other engines keep theirs in their own layout)."""
        return {name: p.detach().cpu().clone() for name, p in self.engine.model.named_parameters()}

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
        return self.engine.generate(prompts, n, params)

    def shutdown(self) -> None:
        self.engine.shutdown()


def _parameter_shapes(model_path: str, trust_remote_code: bool) -> list[tuple[str, torch.Size]]:
    """(name, shape) of the policy model's parameters, in ``named_parameters`` order, from a model
    built on the meta device (no memory, no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return [(name, p.shape) for name, p in model.named_parameters()]

