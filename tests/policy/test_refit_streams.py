"""The refit's stream rule (trainer/policy/streams.py), checked on CPU with CUDA's stream API recorded.

vLLM's packed NCCL producer reads our iterator under a stream of its own and moves to its next stream
after every packed chunk. On a GPU a tensor read on one stream while its FSDP unit was gathered and
copied out on another, with nothing ordering the two, is a silent wrong weight. CPU tensors have no
streams, so this test replaces ``torch.cuda``'s stream calls with a recorder, makes the real
PolicyWorker (one gloo rank) take its CUDA branch, and drives ``iter_full_weights`` the way vLLM 0.32's
``packed_nccl_broadcast_producer`` does (a stream per chunk, one tensor a chunk). Every read must be on
the stream its unit was gathered on, or on a stream that waited for an event recorded there after the
gather, with the tensor's memory kept for that stream.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import pytest
import torch

from tests.policy import colocated
from tests.policy.colocated import train_step
from tests.policy.helpers import refit_samples

worker = colocated.worker  # the fixture: the real rank (one gloo process)


class _Stream:
    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def wait_event(self, event) -> None:
        self.log.append(("wait_event", self, event))

    def synchronize(self) -> None:
        pass

    def __repr__(self) -> str:
        return self.name


class _Event:
    def __init__(self, cuda: _Cuda):
        self.cuda, self.stream = cuda, None

    def record(self, stream=None) -> None:
        self.stream = stream or self.cuda.current
        self.cuda.log.append(("record", self.stream, self))


@dataclass
class _Cuda:
    """The recorded part of ``torch.cuda``: which stream is current, events, waits, record_stream."""

    log: list = field(default_factory=list)

    def __post_init__(self):
        self.current = self.default = _Stream(self.log, "default")

    def current_stream(self, device=None) -> _Stream:
        return self.current

    @contextlib.contextmanager
    def stream(self, s: _Stream):
        previous, self.current = self.current, s
        try:
            yield
        finally:
            self.current = previous

    def Event(self) -> _Event:  # noqa: N802 (torch.cuda.Event)
        return _Event(self)


@pytest.fixture
def recorded(worker, monkeypatch):
    """The worker with CUDA's stream API recorded and the rank's stream rule on its CUDA branch."""
    from torch.distributed.fsdp import FSDPModule

    cuda = _Cuda()
    for name in ("current_stream", "stream", "Event"):
        monkeypatch.setattr(torch.cuda, name, getattr(cuda, name))
    monkeypatch.setattr(
        torch.Tensor, "record_stream", lambda t, s: cuda.log.append(("keep", t, s)), raising=False
    )
    try:  # the one place that picks the rule by device (absent before the rule existed)
        from trainer.policy import streams

        monkeypatch.setattr(streams, "for_device", lambda device: streams.CudaStreams(device))
    except ImportError:
        pass
    unshard, reshard = FSDPModule.unshard, FSDPModule.reshard

    class Handle:
        def __init__(self, unit, inner):
            self.unit, self.inner = unit, inner

        def wait(self):
            cuda.log.append(("gathered", self.unit, cuda.current))
            if self.inner is not None:
                self.inner.wait()

    def recorded_unshard(self, async_op: bool = False):
        cuda.log.append(("unshard", self, cuda.current))
        handle = unshard(self, async_op=async_op)
        return Handle(self, handle) if async_op else handle

    def recorded_reshard(self):
        cuda.log.append(("reshard", self, cuda.current))
        return reshard(self)

    monkeypatch.setattr(FSDPModule, "unshard", recorded_unshard)
    monkeypatch.setattr(FSDPModule, "reshard", recorded_reshard)
    worker.cuda = cuda
    return worker


def _read_as_vllm_does(
    cuda: _Cuda, weights, num_streams: int = 2
) -> list[tuple[str, torch.Tensor, _Stream, int]]:
    """vLLM 0.32's packed_nccl_broadcast_producer with a one-byte buffer (every tensor is a chunk): each
    chunk is pulled from the iterator under its stream, then the producer moves to the next stream.
    Returns (name, tensor, the stream it was read on, the log position of the read)."""
    streams = [_Stream(cuda.log, f"producer-{i}") for i in range(num_streams)]
    reads, it, i = [], iter(weights), 0
    while True:
        with cuda.stream(streams[i]):
            try:
                name, tensor = next(it)
            except StopIteration:
                break
            reads.append((name, tensor, cuda.current, len(cuda.log)))
            cuda.log.append(("read", name, cuda.current))
        i = (i + 1) % num_streams
    return reads


def _violations(rank, log: list, reads) -> list[str]:
    owner = {name: unit for unit, names in rank._params_by_unit() for name in names}
    home = {e[2] for e in log if e[0] in ("unshard", "gathered", "reshard")}
    problems = [f"FSDP's calls ran on several streams: {sorted(map(repr, home))}"] if len(home) > 1 else []
    for name, tensor, reader, at in reads:
        gathered = [(i, e[2]) for i, e in enumerate(log[:at]) if e[0] == "gathered" and e[1] is owner[name]]
        assert gathered, f"{name} was read before its unit was gathered"
        since, on = gathered[-1]
        if reader is on:
            continue
        fenced = any(
            e[0] == "wait_event"
            and e[1] is reader
            and e[2].stream is on
            and any(r[0] == "record" and r[2] is e[2] and j > since for j, r in enumerate(log[:at]))
            for e in log[:at]
        )
        kept = any(e[0] == "keep" and e[1] is tensor and e[2] is reader for e in log[:at])
        if not (fenced and kept):
            problems.append(
                f"{name}: gathered on {on}, read on {reader} "
                f"({'no event between' if not fenced else 'its memory not kept for the reader'})"
            )
    return problems


def test_should_read_every_weight_behind_its_gather_when_vllms_producer_switches_streams_per_chunk(recorded):
    train_step(recorded, refit_samples())  # weights the step changed
    with recorded.cuda.stream(recorded.cuda.default):  # the refit starts on the rank's own stream
        reads = _read_as_vllm_does(recorded.cuda, recorded.iter_full_weights())
    units = len(recorded._fsdp_units())
    assert units >= 3 and len(reads) == len(dict(recorded.model.named_parameters()))
    problems = _violations(recorded, recorded.cuda.log, reads)
    assert not problems, (
        f"{len(problems)} of {len(reads)} weights read unordered after their gather:\n"
        + "\n".join(problems[:5])
    )
    for name, tensor in recorded.full_state_dict().items():  # and the values are the trained weights
        assert torch.equal(next(t for n, t, _, _ in reads if n == name), tensor), name


def test_should_run_every_fsdp_call_of_the_gather_on_the_stream_the_refit_started_on(recorded):
    with recorded.cuda.stream(recorded.cuda.default):
        _read_as_vllm_does(recorded.cuda, recorded.iter_full_weights(), num_streams=3)
    calls = [e for e in recorded.cuda.log if e[0] in ("unshard", "gathered", "reshard")]
    assert calls and {e[2].name for e in calls} == {"default"}, sorted({(e[0], e[2].name) for e in calls})
