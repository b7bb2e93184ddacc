"""vLLM's weight-transfer contract on both devices: vLLM's ``nccl`` backend on GPUs, its CPU twin here.

On GPUs a disaggregated engine receives with vLLM's own ``NCCLWeightTransferEngine`` and policy rank 0
sends with vLLM's own trainer-side pieces (:class:`NcclSender`: ``nccl_common.trainer_init`` and
``packed_nccl_broadcast_producer``). None of that runs without CUDA, so on CPU the engine uses
:class:`GlooWeightTransferEngine`, registered as ``kuberl_gloo``: the same init info and update info
(vLLM's own dataclasses, :class:`NCCLWeightTransferInitInfo` and :class:`NCCLWeightTransferUpdateInfo`),
the same rank of each tensor-parallel worker (``rank_offset`` + its rank in the engine), the same packed
chunks (:mod:`trainer.generation.refit.transport`), over a gloo group instead of NCCL. The CPU tests
therefore run the GPU's protocol, with only the backend name and the transport different; which one an
engine gets is decided in one place, :func:`trainer.generation.refit.transport.vllm_transfer_backend`.

The twin is registered in every vLLM process, spawned tensor-parallel workers included, through vLLM's
plugin mechanism: the ``vllm.general_plugins`` entry point ``kuberl`` (pyproject.toml) calls
:func:`register`, which vLLM runs in the engine process and in each worker it starts; it also ties each
worker to the process that owns the engine (:mod:`trainer.generation.vllm_lifetime`).

An update runs the same steps as the colocated refit's (:func:`~trainer.generation.vllm_engine.begin_weight_update`,
:func:`~trainer.generation.vllm_engine.finish_weight_update`): vLLM's layerwise reload wherever a layer's weight
processing is not the identity, as vLLM's NCCL engine does for every update, and in place otherwise. Two
things the twin does beyond vLLM's base class, both for CPU engines: ``finish_weight_update`` rebuilds the
packed CPU kernels from the new weights, a tied ``lm_head``'s and the experts' included; and ``update_weights``
synchronizes the device only when it has one (vLLM's base class calls ``torch.accelerator.synchronize()``,
which raises without an accelerator; gloo itself is synchronous).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine
from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

from trainer.generation import vllm_cpu
from trainer.generation.refit.transport import (
    GLOO_TRANSFER_BACKEND,
    TransferStats,
    WeightMeta,
    checked,
    chunks,
    receive_packed,
    worker_rank,
)
from trainer.generation.vllm_engine import (
    RELOAD_LOGGER,
    WeightUpdate,
    begin_weight_update,
    check_whole_layers,
    finish_weight_update,
    quiet,
)

if TYPE_CHECKING:
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

    from trainer.generation.refit.group import WeightSyncGroup


class _LoadsWeights(Protocol):
    """A weight-update target: a vLLM model, or vllm_engine's collector of adapters. vLLM annotates the target
    as a plain torch.nn.Module, though every one it loads into has this method."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[str] | None: ...


class GlooWeightTransferEngine(
    WeightTransferEngine[NCCLWeightTransferInitInfo, NCCLWeightTransferUpdateInfo]
):
    """The CPU twin of vLLM's ``NCCLWeightTransferEngine`` (module docstring)."""

    init_info_cls = NCCLWeightTransferInitInfo
    update_info_cls = NCCLWeightTransferUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: WeightSyncGroup | None = None
        self.rank: int | None = None
        self.buffer_bytes = 0
        self.update: WeightUpdate | None = None  # the update between start_weight_update and finish
        self.loaded: set[str] = set()  # what its load_weights calls reported
        self.on_cpu = self.device.type == "cpu"

    def init_transfer_engine(self, init_info: NCCLWeightTransferInitInfo) -> None:
        from trainer.generation.refit.group import WeightSyncGroup

        if not init_info.packed or init_info.master_address is None or init_info.master_port is None:
            raise ValueError(f"{GLOO_TRANSFER_BACKEND}: needs packed=True and master_address/master_port")
        pc = self.parallel_config
        self.rank = rank = worker_rank(init_info.rank_offset, pc.data_parallel_index, pc.world_size, pc.rank)
        self.buffer_bytes = init_info.packed_buffer_size_bytes
        # The group's tensors are host tensors whatever the engine's device: gloo is the CPU transport.
        self.group = WeightSyncGroup(
            init_info.master_address,
            init_info.master_port,
            rank,
            init_info.world_size,
            torch.device("cpu"),
        )

    def start_weight_update(self) -> None:
        # Layer by layer wherever processing matters, as vLLM's NCCL engine reloads every update.
        self.update = begin_weight_update(self.model, self.model_config)
        self.loaded = set()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if not self.on_cpu:  # the copies to the device are non-blocking: they must land first
            torch.accelerator.synchronize()

    @torch.no_grad()
    def receive_weights(self, update_info: NCCLWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("receive_weights before init_weight_transfer_engine")
        meta = WeightMeta(
            list(update_info.names), list(update_info.dtype_names), [list(s) for s in update_info.shapes]
        )
        # Layerwise processing runs as each layer fills. No update open: the target is a collector of
        # adapters (trainer.generation.vllm_engine._receive_adapter), which processes nothing.
        update = self.update
        processing = (
            vllm_cpu.weight_processing(self.model, update.plain) if update else contextlib.nullcontext()
        )
        target = cast(_LoadsWeights, self.model)  # vLLM annotates it as a plain module: see _LoadsWeights
        with quiet(RELOAD_LOGGER), processing:
            for chunk in receive_packed(self.group, meta, self.buffer_bytes):
                if not self.on_cpu:
                    chunk = [(name, t.to(self.device, non_blocking=True)) for name, t in chunk]
                self.loaded |= set(target.load_weights(iter(chunk)) or ())

    def finish_weight_update(self) -> None:
        update, self.update = self.update, None
        if update is None:
            raise RuntimeError("finish_weight_update before start_weight_update")
        with quiet(RELOAD_LOGGER):
            finish_weight_update(update)
        if update.layerwise:  # as the colocated refit checks
            check_whole_layers(update.expected, self.loaded)

    def shutdown(self) -> None:
        """vLLM's ``shutdown_weight_transfer_engine``: leave the group in order, with the sender."""
        group, self.group = self.group, None
        if group is not None:
            group.close()


class NcclSender:
    """Policy rank 0's end of vLLM's ``nccl`` backend (GPUs): vLLM's rendezvous and packed producer."""

    def __init__(self, info: dict):
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.buffer_bytes = int(info["packed_buffer_size_bytes"])
        self.num_buffers = int(info["packed_num_buffers"])
        self.comm: PyNcclCommunicator | None = trainer_init(info, rank=0)

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], meta: WeightMeta) -> TransferStats:
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        if self.comm is None:
            raise RuntimeError("weight sender used after close()")
        t0 = time.perf_counter()
        packed_nccl_broadcast_producer(
            iterator=checked(named_tensors, meta),
            group=self.comm,
            src=0,
            post_iter_func=lambda item: item[1],
            buffer_size_bytes=self.buffer_bytes,
            num_buffers=self.num_buffers,
        )
        torch.cuda.current_stream().synchronize()
        return TransferStats(
            tensors=len(meta.names),
            buckets=len(chunks(meta, self.buffer_bytes)),
            bytes=sum(meta.nbytes(i) for i in range(len(meta.names))),
            seconds=time.perf_counter() - t0,
        )

    def close(self) -> None:
        comm, self.comm = self.comm, None
        if comm is not None:
            comm.destroy()


def register() -> None:
    """kuberl's vLLM plugin: the ``vllm.general_plugins`` entry point, which vLLM calls in its engine process
    and in every worker it spawns (and may call more than once). Makes ``kuberl_gloo`` known to vLLM in
    this process, and ties a process the engine's owner spawned to its owner's life
    (:func:`trainer.generation.vllm_lifetime.follow_owner`)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from trainer.generation.vllm_lifetime import follow_owner

    follow_owner()

    try:
        WeightTransferEngineFactory.register_engine(GLOO_TRANSFER_BACKEND, GlooWeightTransferEngine)
    except ValueError:  # already registered in this process
        pass
