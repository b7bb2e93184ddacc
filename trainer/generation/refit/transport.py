"""Weights from the policy's rank 0 to engines in other processes: vLLM's weight-transfer contract, for
any group (gloo on CPU, NCCL on GPUs).

The contract is vLLM's ``nccl`` backend's (``vllm/distributed/weight_transfer/nccl_engine.py`` and
``packed_tensor.py``, 0.32.0), so that on GPUs a vLLM engine receives with vLLM's own code and on CPU
the twin (:mod:`trainer.generation.refit.vllm_nccl`, and the hf engine's receiver) runs the same
protocol:

- **init info**: ``master_address``, ``master_port`` (rank 0 hosts the rendezvous), ``rank_offset``
  (the engine's first rank), ``world_size`` (1 + every engine's tensor-parallel workers), ``packed``,
  ``packed_buffer_size_bytes``, ``packed_num_buffers`` (:func:`init_info`);
- **update info**: ``names``, ``dtype_names``, ``shapes``, known to every receiver before the bytes
  move (:class:`WeightMeta`), so no metadata rides the stream;
- **packing**: tensors go in the order of the update info, as raw bytes, concatenated into chunks; a
  chunk closes after the tensor that takes it past ``packed_buffer_size_bytes`` (vLLM's rule in
  ``pack_tensors``; so a tensor larger than the buffer travels in a chunk of its own size), and each
  chunk is one broadcast from rank 0. Both ends derive the chunks from the update info alone
  (:func:`chunks`).

Few large messages instead of one per tensor: a 135M-parameter model is 272 tensors, and on gloo each
broadcast costs a round trip.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch

# The registry name of the CPU twin of vLLM's ``nccl`` backend (trainer.generation.refit.vllm_nccl).
GLOO_TRANSFER_BACKEND = "kuberl_gloo"
# vLLM's defaults for the packed NCCL transfer (packed_tensor.py): 1 GiB buffers, double-buffered.
DEFAULT_BUFFER_BYTES = 1024**3
DEFAULT_NUM_BUFFERS = 2


class Broadcaster(Protocol):
    """What the transport needs from a group: rank 0 sends ``tensor``, the others receive into it."""

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor: ...


@dataclass
class TransferStats:
    tensors: int = 0
    buckets: int = 0
    bytes: int = 0
    seconds: float = 0.0


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight transport: unknown dtype {name!r} in the update info")
    return dtype


@dataclass
class WeightMeta:
    """The update info of vLLM's NCCL backend: what every receiver is told before a transfer."""

    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)

    @classmethod
    def of(cls, named: Iterable[tuple[str, torch.Size | list[int], torch.dtype]]) -> WeightMeta:
        meta = cls()
        for name, shape, dtype in named:
            meta.names.append(name)
            meta.dtype_names.append(str(dtype).removeprefix("torch."))
            meta.shapes.append([int(s) for s in shape])
        return meta

    @classmethod
    def from_update_info(cls, info: dict) -> WeightMeta:
        meta = cls(list(info["names"]), list(info["dtype_names"]), [list(s) for s in info["shapes"]])
        if not len(meta.names) == len(meta.dtype_names) == len(meta.shapes):
            raise ValueError("weight transport: names, dtype_names and shapes differ in length")
        return meta

    def update_info(self) -> dict:
        return asdict(self)

    def nbytes(self, i: int) -> int:
        return math.prod(self.shapes[i]) * dtype_of(self.dtype_names[i]).itemsize


def init_info(
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    num_buffers: int = DEFAULT_NUM_BUFFERS,
) -> dict:
    """The init info an engine's ``init_weight_transfer_engine`` gets (vLLM's NCCL field names)."""
    return dict(
        master_address=master_address,
        master_port=master_port,
        rank_offset=rank_offset,
        world_size=world_size,
        packed=True,
        packed_buffer_size_bytes=int(buffer_bytes),
        packed_num_buffers=int(num_buffers),
    )


def worker_rank(
    rank_offset: int, data_parallel_index: int, world_size_per_dp: int, rank_within_dp: int
) -> int:
    """A receiving worker's rank in the transfer group: vLLM's ``worker_init_process_group`` rule."""
    return data_parallel_index * world_size_per_dp + rank_within_dp + rank_offset


def chunks(meta: WeightMeta, buffer_bytes: int) -> list[range]:
    """The tensor indices of each chunk: a chunk closes after the tensor that takes it past
    ``buffer_bytes`` (vLLM's ``pack_tensors``/``packed_nccl_broadcast_consumer`` rule)."""
    if buffer_bytes <= 0:
        raise ValueError(f"weight transport: buffer of {buffer_bytes} bytes; it must be > 0")
    out, start, used = [], 0, 0
    for i in range(len(meta.names)):
        used += meta.nbytes(i)
        if used > buffer_bytes:
            out.append(range(start, i + 1))
            start, used = i + 1, 0
    if start < len(meta.names):
        out.append(range(start, len(meta.names)))
    return out


def _device(group: Broadcaster) -> torch.device:
    """Where the group's messages live: the GPU for NCCL, else the host."""
    return getattr(group, "device", None) or torch.device("cpu")


def checked(
    named_tensors: Iterable[tuple[str, torch.Tensor]], meta: WeightMeta
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors, each checked against the update info the receivers were given: a mismatch would
    split the stream differently on the two ends (a hang or garbage), so it is an error naming it."""
    i = -1
    for i, (name, tensor) in enumerate(named_tensors):
        if i >= len(meta.names):
            raise ValueError(f"weight transport: {name!r} is beyond the {len(meta.names)} tensors announced")
        want = (meta.names[i], meta.dtype_names[i], meta.shapes[i])
        got = (name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape))
        if got != want:
            raise ValueError(f"weight transport: tensor {i} is {got}, the update info announced {want}")
        yield name, tensor
    if i + 1 != len(meta.names):
        raise ValueError(f"weight transport: {i + 1} tensors sent, {len(meta.names)} announced")


@torch.no_grad()
def send_packed(
    group: Broadcaster, named_tensors: Iterable[tuple[str, torch.Tensor]], meta: WeightMeta, buffer_bytes: int
) -> TransferStats:
    """Rank 0: broadcast the tensors in :func:`chunks`; each is copied into the chunk as it arrives and
    no reference to it is kept (FSDP frees the gathered weights when its iterator ends)."""
    stats, t0 = TransferStats(), time.perf_counter()
    device = _device(group)
    plan = chunks(meta, buffer_bytes)
    tensors = checked(named_tensors, meta)
    buffer: torch.Tensor | None = None
    for part in plan:
        size = sum(meta.nbytes(i) for i in part)
        if buffer is None or buffer.numel() < size:
            buffer = torch.empty(max(size, min(buffer_bytes, 2 * size)), dtype=torch.uint8, device=device)
        at = 0
        for _ in part:
            _, tensor = next(tensors)
            flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            buffer[at : at + flat.numel()].copy_(flat)
            at += flat.numel()
        group.broadcast(buffer[:size])
        stats.tensors += len(part)
        stats.buckets += 1
        stats.bytes += size
    for _ in tensors:  # the end of the stream: checks that nothing was left over
        pass
    stats.seconds = time.perf_counter() - t0
    return stats


@torch.no_grad()
def receive_packed(
    group: Broadcaster, meta: WeightMeta, buffer_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Every other rank: each chunk's tensors (views into a fresh buffer, so a consumer may keep them)."""
    device = _device(group)
    for part in chunks(meta, buffer_bytes):
        sizes = [meta.nbytes(i) for i in part]
        data = group.broadcast(torch.empty(sum(sizes), dtype=torch.uint8, device=device))
        out = []
        for i, flat in zip(part, data.split(sizes)):
            dtype = dtype_of(meta.dtype_names[i])
            if flat.storage_offset() % dtype.itemsize:  # after a tensor of a smaller dtype: realign
                flat = flat.clone()
            out.append((meta.names[i], flat.view(dtype).view(meta.shapes[i])))
        yield out


def receive_tensors(
    group: Broadcaster, meta: WeightMeta, buffer_bytes: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """The same stream one tensor at a time, for an engine's ``update_weights``."""
    for chunk in receive_packed(group, meta, buffer_bytes):
        yield from chunk


# ----- which transport: the one place where the devices differ ---------------------------------------


def vllm_transfer_backend(on_gpu: bool) -> str:
    """The weight-transfer backend of a vLLM engine that gets its weights from policy rank 0: vLLM's own
    ``nccl`` on GPUs, its CPU twin elsewhere. Both take the same init and update info."""
    return "nccl" if on_gpu else GLOO_TRANSFER_BACKEND


class Sender(Protocol):
    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], meta: WeightMeta) -> TransferStats: ...

    def close(self) -> None: ...


class GroupSender:
    """Rank 0 of a :class:`~trainer.generation.refit.group.WeightSyncGroup` (gloo on CPU, torch's NCCL for the hf
    engine on GPUs), speaking the packed protocol above."""

    def __init__(self, info: dict, device: torch.device):
        from trainer.generation.refit.group import WeightSyncGroup

        self.buffer_bytes = int(info["packed_buffer_size_bytes"])
        self.group = WeightSyncGroup(
            info["master_address"], info["master_port"], 0, info["world_size"], device
        )

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], meta: WeightMeta) -> TransferStats:
        return send_packed(self.group, named_tensors, meta, self.buffer_bytes)

    def close(self) -> None:
        """Leave in order with the receivers (:meth:`~trainer.generation.refit.group.WeightSyncGroup.close`)."""
        self.group.close()
