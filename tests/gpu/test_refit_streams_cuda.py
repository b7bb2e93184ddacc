"""The refit's stream rule on a real GPU (trainer/policy/streams.py; its CPU twin is
tests/policy/test_refit_streams.py, which records the calls).

Policy rank 0's sender on GPUs is vLLM's ``packed_nccl_broadcast_producer``: it pulls our iterator inside
``torch.cuda.stream(streams[i])`` and moves to its next stream after every packed chunk, synchronising
only the stream it is about to reuse. vLLM is not needed to reproduce that:
:func:`_gather_through_the_producer` does the same (vLLM 0.32's loop and ``pack_tensors``), with the
broadcast replaced by a copy to the host on the chunk's stream, and one of the two streams held back by
a sleep kernel at the start of each of its chunks (as a broadcast still queued there would): whatever
runs on that stream runs late, while the host and the other stream go on. A unit copied out on the late
stream and read on the other reads memory not yet written; a tensor read late must keep its memory
while the home stream frees and reuses. The weights must arrive exactly, over units several times the
packed buffer.
"""

from __future__ import annotations

import pytest
import torch

from .conftest import free_port, needs_gpus
from .torch_lm import TorchLM

pytestmark = pytest.mark.gpu


def _gather_through_the_producer(rank, buffer_bytes: int) -> dict[str, torch.Tensor]:
    """What arrives when vLLM's producer loop sends ``rank.iter_full_weights()`` (module docstring)."""
    received: dict[str, torch.Tensor] = {}
    streams = [torch.cuda.Stream() for _ in range(2)]
    chunks: list = []
    iterator = iter(rank.iter_full_weights())  # made on the home (default) stream, as broadcast_weights does
    i = 0
    while True:
        streams[i].synchronize()
        with torch.cuda.stream(streams[i]):
            if i == 0:  # this stream is still busy (a broadcast queued there): whatever runs on it runs late
                torch.cuda._sleep(20_000_000)
            tensors, meta, size = [], [], 0
            for name, t in iterator:
                tensors.append(t.contiguous().view(-1).view(torch.uint8))
                meta.append((name, t.shape, t.dtype, tensors[-1].numel()))
                size += tensors[-1].numel()
                if size > buffer_bytes:
                    break
            if not tensors:
                break
            packed = torch.cat(tensors)
            del tensors
            host = torch.empty(packed.numel(), dtype=torch.uint8, pin_memory=True)
            host.copy_(packed, non_blocking=True)  # the "broadcast": read on this stream
            chunks.append((streams[i], packed, host, meta))
            i = (i + 1) % 2
    torch.cuda.synchronize()
    for _, _, host, meta in chunks:
        offset = 0
        for name, shape, dtype, n in meta:
            received[name] = host[offset : offset + n].view(dtype).view(shape).clone()
            offset += n
    return received


@needs_gpus(1)
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep-gathered"])
def test_should_send_exactly_the_trained_weights_when_the_sender_reads_each_chunk_on_a_stream_of_its_own(
    reshard,
):
    import torch.distributed as dist

    from trainer.config import Config
    from trainer.policy.worker import PolicyWorker, adamw, shard_model

    if dist.is_initialized():
        pytest.skip("this process already has a torch.distributed world")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = TorchLM(vocab=4096, width=512, depth=4).cuda()  # a block: 8 MiB of fp32, 8x the buffer
        shard_model(model, reshard_after_forward=reshard, mp_dtype=torch.bfloat16)
        optimizer = adamw(model.parameters(), lr=1e-2)
        ids = torch.randint(0, 4096, (4, 64), device="cuda")
        torch.nn.functional.cross_entropy(
            model(ids[:, :-1]).reshape(-1, 4096).float(), ids[:, 1:].reshape(-1)
        ).backward()
        optimizer.step()
        expected = {n: p.full_tensor().detach().to(torch.bfloat16).cpu() for n, p in model.named_parameters()}
        rank = PolicyWorker.__new__(PolicyWorker)  # the real gather over this model (a rank without set-up)
        rank.cfg, rank.model = Config(), model
        rank.cfg.policy.reshard_after_forward = reshard
        for attempt in range(3):  # the race, where there is one, need not show on the first pass
            received = _gather_through_the_producer(rank, buffer_bytes=1 << 20)
            assert sorted(received) == sorted(expected)
            wrong = [n for n in expected if not torch.equal(received[n], expected[n])]
            assert not wrong, (
                f"pass {attempt}: {len(wrong)} of {len(expected)} weights arrived wrong: {wrong[:5]}"
            )
    finally:
        dist.destroy_process_group()
