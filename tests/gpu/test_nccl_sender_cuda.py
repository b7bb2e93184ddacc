"""The vLLM engine's disaggregated refit end to end on GPUs, without an engine: two policy ranks and one
receiver, each a process with its own GPU (``CUDA_VISIBLE_DEVICES``, as Ray gives each actor its GPUs).

The policy ranks shard a plain-torch model with FSDP2 over NCCL and run the real ``broadcast_weights``:
both gather unit by unit (``iter_full_weights``, the stream rule of trainer/policy/streams.py), rank 0
sends with :class:`~trainer.generation.refit.vllm_nccl.NcclSender` (vLLM's ``trainer_init`` and
``packed_nccl_broadcast_producer``). The receiver joins as vLLM's ``NCCLWeightTransferEngine`` does
(``stateless_init_process_group`` at rank ``rank_offset``, then ``packed_nccl_broadcast_consumer`` with
the trainer's buffer geometry) and keeps what arrives. Buckets of 1 MiB over about 40 MiB of bf16 weights:
many chunks, each on the producer's next stream. Every tensor must arrive bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.leftovers import wait_all

from .conftest import REPO, free_port, need, needs_gpus

pytestmark = pytest.mark.gpu

BUFFER_BYTES = 1 << 20

POLICY_RANK = """
import os, sys, torch, torch.distributed as dist
from trainer.config import Config
from trainer.generation.refit.transport import init_info
from trainer.policy.worker import PolicyWorker, shard_model
from tests.gpu.torch_lm import TorchLM

rank, port, transfer_port, out, meta_file = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
                                            sys.argv[5])
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
torch.manual_seed(0)
model = TorchLM(vocab=8192, width=1024, depth=4).cuda()  # the same weights on both ranks, then sharded
shard_model(model, reshard_after_forward=True, mp_dtype=torch.bfloat16)
w = PolicyWorker.__new__(PolicyWorker)  # the real refit methods over this model (a rank without set-up)
w.cfg, w.model, w.rank, w.lora = Config(), model, rank, None
w.cfg.generation.backend, w.cfg.generation.dtype = "vllm", "bfloat16"
update_info = w.weight_metadata()  # names, dtypes, shapes in the gather's order, without gathering
if rank == 0:
    from trainer.generation.refit.vllm_nccl import NcclSender

    torch.save(update_info, meta_file + ".tmp")  # what the driver hands the engines, before the rendezvous
    os.replace(meta_file + ".tmp", meta_file)
    w.sender = NcclSender(init_info("127.0.0.1", transfer_port, 0, 2, BUFFER_BYTES))
stats = w.broadcast_weights(update_info)
full = {n: p.full_tensor().detach().to(torch.bfloat16).cpu() for n, p in model.named_parameters()}
if rank == 0:
    torch.save({"expected": full, "update_info": update_info, "buckets": stats["buckets"]}, out)
    w.close_weight_sync()
dist.destroy_process_group()
"""

RECEIVER = """
import os, sys, time, torch
from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group
from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_consumer
from trainer.generation.refit.transport import WeightMeta, dtype_of, init_info

transfer_port, meta_file, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.cuda.set_device(0)
deadline = time.monotonic() + 240
while not os.path.exists(meta_file):  # the update info, from policy rank 0
    assert time.monotonic() < deadline, "no update info from policy rank 0"
    time.sleep(0.2)
info = init_info("127.0.0.1", transfer_port, 1, 2, BUFFER_BYTES)
group = stateless_init_process_group(info["master_address"], info["master_port"], info["rank_offset"],
                                     info["world_size"], device=0)
meta = WeightMeta.from_update_info(torch.load(meta_file))
received = {}

def keep(chunk):
    for name, tensor in chunk:
        received[name] = tensor.clone().cpu()

packed_nccl_broadcast_consumer(
    iterator=((n, (s, dtype_of(d))) for n, d, s in zip(meta.names, meta.dtype_names, meta.shapes)),
    group=group, src=0, post_unpack_func=keep, buffer_size_bytes=info["packed_buffer_size_bytes"],
    num_buffers=info["packed_num_buffers"], device=torch.device("cuda", 0),
)
torch.cuda.synchronize()
torch.save(received, out)
group.destroy()
"""


@needs_gpus(3)
def test_should_deliver_every_weight_bit_for_bit_when_two_fsdp_ranks_send_through_vllms_packed_nccl_producer(
    tmp_path,
):
    need("vllm", "the job image's [vllm] extra (vLLM's NCCL weight transfer)")
    preamble = f"BUFFER_BYTES = {BUFFER_BYTES}\n"
    port, transfer_port = free_port(), free_port()
    sent, got, meta = tmp_path / "sent.pt", tmp_path / "received.pt", str(tmp_path / "update_info.pt")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                preamble + textwrap.dedent(POLICY_RANK),
                str(r),
                str(port),
                str(transfer_port),
                str(sent),
                meta,
            ],
            cwd=REPO,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": str(r)},
        )
        for r in range(2)
    ] + [
        subprocess.Popen(
            [sys.executable, "-c", preamble + textwrap.dedent(RECEIVER), str(transfer_port), meta, str(got)],
            cwd=REPO,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": "2"},
        )
    ]
    codes = wait_all(procs, timeout=300)
    assert codes == [0, 0, 0], "a process failed (its output is above)"
    sender, received = torch.load(sent), torch.load(got)
    assert sender["buckets"] > 10
    expected = sender["expected"]
    assert sorted(received) == sorted(expected)
    wrong = [n for n in expected if not torch.equal(received[n], expected[n])]
    assert not wrong, f"{len(wrong)} of {len(expected)} weights arrived wrong: {wrong[:5]}"
