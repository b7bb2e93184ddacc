"""A NCCL WeightSyncGroup between two processes, each with its own GPU: what a disaggregated refit rides on.

Rank 0 (the policy's rank 0) hosts the TCPStore and broadcasts; rank 1 (a generation actor) receives into
tensors of the same shapes and dtypes on its own GPU. Both then leave in the group's order (barrier,
group destroyed, check-out through the store) and exit 0 within the timeout: a hang here is what a
mismatched transport (gloo on one side, NCCL on the other) looks like. Needs only torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.leftovers import wait_all

from .conftest import REPO, free_port, needs_gpus

pytestmark = pytest.mark.gpu

RANK = """
import json, sys, time, torch
from trainer.generation.refit.group import WeightSyncGroup

rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.cuda.set_device(0)  # CUDA_VISIBLE_DEVICES gives each process one GPU, as Ray does an actor
device = torch.device("cuda", 0)
specs = [("embed", (1000, 64), torch.bfloat16), ("norm", (64,), torch.float32), ("ids", (7,), torch.int64),
         ("big", (64, 1024, 1024), torch.bfloat16)]  # 128 MiB: more than one NCCL chunk

def filled(i, shape, dtype):
    g = torch.Generator(device="cuda").manual_seed(i)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, device=device).to(dtype)
    return torch.randint(0, 1 << 40, shape, generator=g, device=device, dtype=dtype)

group = WeightSyncGroup("127.0.0.1", port, rank=rank, world_size=2, device=device)
got = {}
backend = type(group.pg).__name__
t0 = time.monotonic()
for i, (name, shape, dtype) in enumerate(specs):
    tensor = filled(i, shape, dtype) if rank == 0 else torch.empty(shape, dtype=dtype, device=device)
    received = group.broadcast(tensor)
    got[name] = bool(torch.equal(received, filled(i, shape, dtype)))
torch.cuda.synchronize()
seconds = time.monotonic() - t0
met = group.close()
with open(out, "w") as f:
    json.dump({"equal": got, "met": met, "backend": backend, "seconds": seconds}, f)
"""


@needs_gpus(2)
def test_should_broadcast_every_dtype_exactly_and_close_in_order_when_two_gpus_form_a_nccl_group(tmp_path):
    port = free_port()
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(RANK), str(r), str(port), str(outs[r])],
            cwd=REPO,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": str(r)},
        )
        for r in range(2)
    ]
    codes = wait_all(procs, timeout=240)
    assert codes == [0, 0], "a rank failed or hung (its output is above)"
    for out in outs:
        result = json.loads(out.read_text())
        assert result["backend"] == "ProcessGroupNCCL"
        assert result["equal"] == {"embed": True, "norm": True, "ids": True, "big": True}
        assert result["met"]  # both ranks met at the barrier and rank 1 checked out before the store went
