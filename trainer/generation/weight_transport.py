"""Weights from one process to engines in others, in buckets that carry their own names, dtypes and shapes.

The sender (the policy's rank 0, root of a :class:`~trainer.weight_sync.WeightSyncGroup`) packs full
tensors into byte buckets of at most ``generation.refit_bucket_mb`` and broadcasts each bucket as three
messages: a header ``(meta_bytes, data_bytes)``, the bucket's table of contents as JSON (name, dtype,
shape, byte offset per tensor), then the bytes. A header of ``(0, 0)`` ends the stream. So the receiver
sizes every buffer from what the sender says, never from its own module tree: the sender's layout (Hugging
Face names, unfused q/k/v) is what moves, and the engine maps it (vLLM fuses q/k/v itself in
``load_weights``). Neither side holds more than one bucket beyond the model it already has; a tensor
larger than a bucket travels alone in a bucket of its own size.

Few large messages instead of one per tensor: a 135M-parameter model is 272 tensors, and on gloo each
broadcast costs a round trip. The vLLM side of the receiver is
:mod:`trainer.generation.vllm_weight_transfer`; :meth:`BucketReceiver.tensors` feeds any engine's
``update_weights``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

_ALIGN = 64  # byte alignment of each tensor in a bucket, so every dtype can be viewed in place
_END = (0, 0)


class Broadcaster(Protocol):
    """What the transport needs from a group: rank 0 sends ``tensor``, the others receive into it."""

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor: ...


@dataclass
class TransferStats:
    tensors: int = 0
    buckets: int = 0
    bytes: int = 0
    seconds: float = 0.0


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight transport: unknown dtype {name!r} in a bucket header")
    return dtype


def _device(group: Broadcaster) -> torch.device:
    """Where the group's messages live: the GPU for NCCL, else the host."""
    return getattr(group, "device", None) or torch.device("cpu")


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 view (a contiguous copy first if it is not contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


class BucketSender:
    """Root side: packs and broadcasts buckets of at most ``bucket_mb`` MiB."""

    def __init__(self, group: Broadcaster, bucket_mb: float = 256):
        if bucket_mb <= 0:
            raise ValueError(f"generation.refit_bucket_mb={bucket_mb} must be > 0")
        self.group = group
        self.bucket_bytes = int(bucket_mb * 2**20)
        self._buffer: torch.Tensor | None = None  # reused across buckets and updates

    @torch.no_grad()
    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> TransferStats:
        """Broadcast every tensor, then the end marker.

        Each tensor is copied into the bucket buffer as it arrives and no reference to it is kept: the
        caller's tensors may be gone once it yields the next one (FSDP frees the gathered weights when
        its iterator ends), and the sender never holds more than one bucket.
        """
        stats, t0 = TransferStats(), time.perf_counter()
        table: list[list] = []  # [name, dtype, shape, byte offset, bytes] per tensor of the bucket
        used = 0
        for name, tensor in named_tensors:
            nbytes = tensor.numel() * tensor.element_size()
            if table and used + _aligned(nbytes) > self.bucket_bytes:
                self._send_bucket(table, used, stats)
                table, used = [], 0
            buffer = self._room(used, used + _aligned(nbytes), _device(self.group))
            buffer[used : used + nbytes].copy_(_bytes_of(tensor.to(buffer.device)))
            table.append([name, str(tensor.dtype), list(tensor.shape), used, nbytes])
            used += _aligned(nbytes)
        if table:
            self._send_bucket(table, used, stats)
        self._header(*_END)
        stats.seconds = time.perf_counter() - t0
        return stats

    def _room(self, used: int, needed: int, device: torch.device) -> torch.Tensor:
        """The bucket buffer, at least ``needed`` bytes, keeping its first ``used`` (a tensor larger
        than a bucket travels alone in a buffer of its own size)."""
        if self._buffer is None or self._buffer.numel() < needed or self._buffer.device != device:
            grown = torch.empty(max(needed, self.bucket_bytes), dtype=torch.uint8, device=device)
            if used:
                grown[:used].copy_(self._buffer[:used])
            self._buffer = grown
        return self._buffer

    def _send_bucket(self, table: list[list], used: int, stats: TransferStats) -> None:
        meta = json.dumps(table).encode()
        self._header(len(meta), used)
        self.group.broadcast(torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(self._buffer.device))
        self.group.broadcast(self._buffer[:used])  # (used,) bytes: only the filled part travels
        stats.tensors += len(table)
        stats.buckets += 1
        stats.bytes += used

    def _header(self, meta_bytes: int, data_bytes: int) -> None:
        self.group.broadcast(torch.tensor([meta_bytes, data_bytes], dtype=torch.int64, device=_device(self.group)))


class BucketReceiver:
    """Receiving side: yields what the sender broadcast, bucket by bucket, until its end marker."""

    def __init__(self, group: Broadcaster):
        self.group = group

    @torch.no_grad()
    def buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Each bucket's tensors (views into a fresh buffer, so a consumer may keep them)."""
        while True:
            device = _device(self.group)
            header = self.group.broadcast(torch.zeros(2, dtype=torch.int64, device=device))
            meta_bytes, data_bytes = (int(v) for v in header.tolist())
            if (meta_bytes, data_bytes) == _END:
                return
            meta = self.group.broadcast(torch.empty(meta_bytes, dtype=torch.uint8, device=device))
            table = json.loads(bytes(meta.cpu().numpy()).decode())
            data = self.group.broadcast(torch.empty(data_bytes, dtype=torch.uint8, device=device))
            bucket = []
            for name, dtype, shape, start, nbytes in table:
                flat = data[start : start + nbytes].view(_dtype(dtype))
                bucket.append((name, flat.view(shape)))
            yield bucket

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The same stream one tensor at a time, for an engine's ``update_weights``."""
        for bucket in self.buckets():
            yield from bucket
