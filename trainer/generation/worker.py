"""Disaggregated generation: actors in their own placement group, each with a full model copy.

After every optimizer step the policy's rank 0 broadcasts the new weights over a
:class:`~trainer.weight_sync.WeightSyncGroup`; each actor receives them tensor by tensor, in the
model's parameter order, straight into its engine.
"""

from __future__ import annotations

import os

import torch

from trainer.cluster import setup_cpu_process
from trainer.config import Config
from trainer.generation.base import Completion, SamplingParams
from trainer.policy.worker import _DTYPES


def build_engine(cfg: Config, model_path: str, device: torch.device):
    """The configured backend over a freshly loaded model (vllm is imported only when chosen)."""
    if cfg.generation.backend == "vllm":
        from trainer.generation.vllm_engine import VLLMGenerationEngine

        return VLLMGenerationEngine(cfg, model_path)
    from trainer.generation.hf import HFGenerationEngine
    from trainer.policy.worker import load_model, load_tokenizer

    model = load_model(model_path, cfg.engine_dtype, cfg.model.trust_remote_code).to(device)
    return HFGenerationEngine(model, load_tokenizer(model_path, cfg.model.trust_remote_code), cfg.generation.batch_size)


class GenerationWorker:
    """Wrapped with ``ray.remote`` by the driver."""

    def __init__(self, cfg: Config, model_path: str, rank: int, threads: int | None = None):
        self.cfg, self.rank = cfg, rank
        self.device = torch.device("cuda", 0) if cfg.cluster.use_gpus else torch.device("cpu")
        if not cfg.cluster.use_gpus:
            setup_cpu_process(cfg, threads or (os.cpu_count() or 1))
        self.engine = build_engine(cfg, model_path, self.device)

    def address(self) -> tuple[str, int]:
        from trainer.policy.worker import node_address

        return node_address()

    def init_weight_sync(self, host: str, port: int, world_size: int) -> None:
        from trainer.weight_sync import WeightSyncGroup

        self.sync = WeightSyncGroup(host, port, rank=1 + self.rank, world_size=world_size, device=self.device)

    @torch.no_grad()
    def receive_weights(self) -> None:
        model = self.engine.model

        dtype = _DTYPES[self.cfg.engine_dtype]  # what rank 0 sends

        def received():
            for name, param in model.named_parameters():
                buf = torch.empty(param.shape, dtype=dtype, device=self.device)
                yield name, self.sync.broadcast(buf)

        self.engine.update_weights(received())

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().cpu().clone() for name, p in self.engine.model.named_parameters()}

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
        return self.engine.generate(prompts, n, params)
