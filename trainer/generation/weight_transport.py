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
        """Broadcast every tensor, then the end marker. Tensors are read one at a time, as they come."""
        stats, t0 = TransferStats(), time.perf_counter()
        pending: list[tuple[str, torch.Tensor]] = []
        used = 0
        for name, tensor in named_tensors:
            size = _aligned(tensor.numel() * tensor.element_size())
            if pending and used + size > self.bucket_bytes:
                self._send_bucket(pending, stats)
                pending, used = [], 0
            pending.append((name, tensor))
            used += size
        if pending:
            self._send_bucket(pending, stats)
        self._header(*_END)
        stats.seconds = time.perf_counter() - t0
        return stats

    def _send_bucket(self, items: list[tuple[str, torch.Tensor]], stats: TransferStats) -> None:
        table, offset = [], 0
        for name, tensor in items:
            nbytes = tensor.numel() * tensor.element_size()
            table.append([name, str(tensor.dtype), list(tensor.shape), offset, nbytes])
            offset += _aligned(nbytes)
        if self._buffer is None or self._buffer.numel() < offset:
            self._buffer = torch.empty(offset, dtype=torch.uint8)
        data = self._buffer[:offset]  # (offset,) bytes: only the used part travels
        for (_name, tensor), (_, _, _, start, nbytes) in zip(items, table):
            data[start : start + nbytes].copy_(_bytes_of(tensor.cpu()))  # .cpu(): a no-op for host tensors
        meta = json.dumps(table).encode()
        self._header(len(meta), offset)
        self.group.broadcast(torch.frombuffer(bytearray(meta), dtype=torch.uint8))
        self.group.broadcast(data)
        stats.tensors += len(items)
        stats.buckets += 1
        stats.bytes += offset

    def _header(self, meta_bytes: int, data_bytes: int) -> None:
        self.group.broadcast(torch.tensor([meta_bytes, data_bytes], dtype=torch.int64))


class BucketReceiver:
    """Receiving side: yields what the sender broadcast, bucket by bucket, until its end marker."""

    def __init__(self, group: Broadcaster):
        self.group = group

    @torch.no_grad()
    def buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Each bucket's tensors (views into a fresh buffer, so a consumer may keep them)."""
        while True:
            header = self.group.broadcast(torch.zeros(2, dtype=torch.int64))
            meta_bytes, data_bytes = (int(v) for v in header.tolist())
            if (meta_bytes, data_bytes) == _END:
                return
            meta = self.group.broadcast(torch.empty(meta_bytes, dtype=torch.uint8))
            table = json.loads(bytes(meta.numpy()).decode())
            data = self.group.broadcast(torch.empty(data_bytes, dtype=torch.uint8))
            bucket = []
            for name, dtype, shape, start, nbytes in table:
                flat = data[start : start + nbytes].view(_dtype(dtype))
                bucket.append((name, flat.view(shape)))
            yield bucket

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The same stream one tensor at a time, for an engine's ``update_weights``."""
        for bucket in self.buckets():
            yield from bucket
