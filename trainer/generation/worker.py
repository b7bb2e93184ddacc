"""Disaggregated generation: a Ray actor that owns one engine on its own device (or cores).

After every optimizer step the policy's rank 0 sends the new weights to every actor under vLLM's
weight-transfer contract (:mod:`trainer.generation.refit.transport`: the receivers know the names,
dtypes and shapes beforehand, the bytes move in packed chunks over one group rooted at rank 0). A vLLM
engine takes them through its weight-transfer API, on every tensor-parallel worker: vLLM's ``nccl``
backend on GPUs, its CPU twin elsewhere (:mod:`trainer.generation.refit.vllm_nccl`); the hf engine
joins a :class:`~trainer.generation.refit.group.WeightSyncGroup` and takes the stream in ``update_weights``.

With ``generation.endpoint.enabled`` the actor also serves its engine over an OpenAI-compatible endpoint
(:mod:`trainer.generation.endpoint`): it starts it once the engine is built and stops it before the
engine, and the trainer's own generation and refits pass through the same gate as the endpoint's requests,
so the engine never runs two calls at once and never samples from half-loaded weights.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from trainer import heap
from trainer.cluster import node_address, setup_cpu_process
from trainer.config import Config
from trainer.generation.base import Completion, SamplingParams, WeightReceiver
from trainer.generation.endpoint import ChatEndpoint, EngineGate
from trainer.generation.factory import EngineSpec, build_engine

if TYPE_CHECKING:
    from trainer.generation.refit.group import WeightSyncGroup


class GenerationWorker:
    """Wrapped with ``ray.remote`` by :class:`~trainer.generation.placement.DisaggregatedGenerator`."""

    def __init__(
        self,
        cfg: Config,
        model_path: str,
        rank: int,
        threads: int | None = None,
        endpoint_token: str | None = None,
    ):
        """``endpoint_token``: the driver's token for generation.endpoint (:func:`~trainer.generation.endpoint.
        read_token`); None: the actor's own ``$token_env``."""
        self.cfg, self.rank, self.model_path = cfg, rank, model_path
        self._endpoint_token = endpoint_token
        self.device = torch.device("cuda", 0) if cfg.cluster.use_gpus else torch.device("cpu")
        if not cfg.cluster.use_gpus:
            threads = threads or (os.cpu_count() or 1)
            # pinned: the cores after the policy ranks' (cluster.cpu_pinning)
            setup_cpu_process(cfg, threads, slot=max(1, cfg.cluster.cpu_workers_per_node) + rank)
            threads = torch.get_num_threads()
        # What every engine's build imports anyway, imported before the actor freezes its heap (trainer.heap).
        # Not vllm: the engine sets its environment before that import (trainer.generation.vllm_engine).
        heap.settle("transformers.modeling_utils")
        spec = EngineSpec(
            model_path=model_path,
            weights_from_another_process=True,
            dtype=cfg.engine_dtype,
            seed=cfg.seed + 1000 * (rank + 1),  # distinct from every policy rank's
            max_model_len=cfg.policy.max_total_sequence_length,
            trust_remote_code=cfg.model.trust_remote_code,
            tokenizer_path=cfg.model.tokenizer,
            device=self.device,
            threads=threads,
            lora=cfg.policy.lora if cfg.policy.lora.enabled else None,
            sequences=cfg.grpo.batch_size,  # a step's samples; a call with more runs them in turns
        )
        self.lora = spec.lora is not None
        ep = cfg.generation.endpoint
        self.gate = EngineGate(ep.max_waiting, ep.wait_timeout_s)
        self.endpoint: ChatEndpoint | None = None
        self.engine = build_engine(cfg.generation, spec)
        if ep.enabled:
            self._start_endpoint(cfg, spec)

    def _start_endpoint(self, cfg: Config, spec: EngineSpec) -> None:
        from trainer.models import load_tokenizer

        tokenizer = load_tokenizer(spec.tokenizer_path or spec.model_path, spec.trust_remote_code)
        self.endpoint = ChatEndpoint(
            self.engine,
            tokenizer,
            cfg.generation,
            model_name=cfg.model.name,
            max_model_len=spec.max_model_len,
            gate=self.gate,
            token=self._endpoint_token,
            tool_parser=cfg.env.tool_parser,  # the calls in its answers are read in the family's format
        )
        try:
            self.endpoint.start()
        except BaseException:
            self.engine.shutdown()  # the actor's constructor fails: nothing it started may stay behind
            raise

    def ready(self) -> bool:
        """Answers once the engine is built (the actor's constructor has returned): the driver opens the
        weight-transfer group only after every engine has (:mod:`trainer.generation.placement`)."""
        return True

    def address(self) -> tuple[str, int]:
        return node_address()

    def init_weight_sync(self, init_info: dict) -> None:
        """Join policy rank 0's transfer group (``init_info``: vLLM's NCCL init info, for every engine)."""
        if isinstance(self.engine, WeightReceiver):
            self.engine.init_weight_receiver(init_info)
            self.sync = None
        else:
            from trainer.generation.refit.group import WeightSyncGroup
            from trainer.generation.refit.transport import worker_rank

            rank = worker_rank(init_info["rank_offset"], 0, 1, 0)  # the hf engine is one process
            self.buffer_bytes = int(init_info["packed_buffer_size_bytes"])
            self.sync = WeightSyncGroup(
                init_info["master_address"],
                init_info["master_port"],
                rank,
                init_info["world_size"],
                self.device,
            )

    @torch.no_grad()
    def receive_weights(self, update_info: dict) -> None:
        """One refit: the full weights, or with LoRA the adapters alone (``update_info`` names them), over
        the same transport and in buckets of their own. Endpoint requests wait until it is done."""
        with self.gate.trainer():
            self._receive_weights(update_info)

    def _receive_weights(self, update_info: dict) -> None:
        if self.sync is None:
            engine = self.engine
            assert isinstance(engine, WeightReceiver)  # init_weight_sync opened no group: the engine's own
            (engine.receive_adapter if self.lora else engine.receive_weights)(update_info)
            return
        from trainer.generation.refit.transport import WeightMeta, receive_tensors

        meta = WeightMeta.from_update_info(update_info)
        tensors = receive_tensors(self.sync, meta, self.buffer_bytes)
        (self.engine.update_adapter if self.lora else self.engine.update_weights)(tensors)

    def close_weight_sync(self) -> None:
        """Leave the weight group together with the policy's rank 0 (the driver calls both at once)."""
        if isinstance(self.engine, WeightReceiver):
            self.engine.close_weight_receiver()
        else:
            sync: WeightSyncGroup | None = getattr(self, "sync", None)  # None before init_weight_sync
            if sync is not None:
                sync.close()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The hf engine's weights, for tests (other engines keep theirs in their own layout)."""
        from trainer.generation.hf import HFGenerationEngine

        assert isinstance(self.engine, HFGenerationEngine), "state_dict: reads an hf engine's weights"
        return {name: p.detach().cpu().clone() for name, p in self.engine.model.named_parameters()}

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
        with self.gate.trainer():
            return self.engine.generate(prompts, n, params)

    def endpoint_address(self) -> tuple[str, int] | None:
        """Where this actor's endpoint listens (host, port); None when generation.endpoint is off."""
        return self.endpoint.address if self.endpoint is not None else None

    def drain_requests(self) -> list[dict]:
        """The endpoint's requests since the last drain, oldest first (:meth:`ChatEndpoint.drain_requests`)."""
        return self.endpoint.drain_requests() if self.endpoint is not None else []

    def shutdown(self) -> None:
        """Stop listening first (no request reaches an engine going away), then the engine."""
        if self.endpoint is not None:
            self.endpoint.shutdown()
        self.engine.shutdown()
