"""kuberl's gloo weight-transfer backend for vLLM: weights from the policy's rank 0 into an engine in
another process, on CPU, through vLLM's own weight-transfer API.

vLLM ships transfer engines for GPUs (``nccl``, ``ipc``, ...); none runs without an accelerator. This one
is registered as ``kuberl_gloo`` with ``WeightTransferEngineFactory`` before the engine starts (the engine
lives in this process, see :mod:`trainer.generation.vllm_engine`), so the generation side drives it with
vLLM's calls: ``init_weight_transfer_engine`` -> per update ``start_weight_update``,
``update_weights``, ``finish_weight_update``. The bytes and their names/dtypes/shapes come from a
:class:`~trainer.generation.weight_transport.BucketSender` on the other end, bucket by bucket, and each
bucket goes straight into ``model.load_weights``.

Two departures from vLLM's base class, both for CPU: ``update_weights`` does not end in
``torch.accelerator.synchronize()`` (it raises with no accelerator; gloo is synchronous anyway), and
``finish_weight_update`` rebuilds the packed CPU kernels from the new weights, a tied ``lm_head``'s
included (:func:`~trainer.generation.vllm_engine.finish_weight_update`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from trainer.generation.vllm_engine import (
    GLOO_TRANSFER_BACKEND,
    RELOAD_LOGGER,
    begin_weight_update,
    finish_weight_update,
    quiet,
    weights_packed,
)
from trainer.generation.weight_transport import BucketReceiver


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Where the sender's group is: its TCPStore (host, port), this engine's rank in it, and its size."""

    host: str
    port: int
    rank: int
    world_size: int


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """Nothing: the names, dtypes and shapes ride the stream with each bucket."""


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = None
        self.packed = False
        self.on_cpu = self.device.type == "cpu"
        hf = self.model_config.hf_config
        self.tied = bool(getattr(getattr(hf, "text_config", None) or hf, "tie_word_embeddings", False))

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        from trainer.weight_sync import WeightSyncGroup

        # The group's tensors are host tensors whatever the engine's device: gloo is the CPU transport.
        self.group = WeightSyncGroup(
            init_info.host, init_info.port, init_info.rank, init_info.world_size, torch.device("cpu")
        )

    def start_weight_update(self) -> None:
        self.packed = weights_packed(self.model)
        begin_weight_update(self.model, self.packed)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))

    @torch.no_grad()
    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("receive_weights before init_weight_transfer_engine")
        with quiet(RELOAD_LOGGER):
            for bucket in BucketReceiver(self.group).buckets():
                if not self.on_cpu:
                    bucket = [(name, t.to(self.device, non_blocking=True)) for name, t in bucket]
                self.model.load_weights(iter(bucket))

    def finish_weight_update(self) -> None:
        with quiet(RELOAD_LOGGER):
            finish_weight_update(self.model, self.model_config, self.packed, self.tied)

    def shutdown(self) -> None:
        """vLLM's ``shutdown_weight_transfer_engine``: leave the group in order, with the sender."""
        group, self.group = self.group, None
        if group is not None:
            group.close()


def register() -> None:
    """Make ``kuberl_gloo`` known to vLLM in this process (before an engine that uses it starts)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(GLOO_TRANSFER_BACKEND, GlooWeightTransferEngine)
    except ValueError:  # already registered by an earlier engine in this process
        pass
