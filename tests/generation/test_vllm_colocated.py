"""A vLLM engine inside processes that already form a torch.distributed world, as colocated policy ranks do.

Two real processes join a gloo world (the FSDP ranks' stand-in), each starts an in-process engine,
generates, and runs a collective after the engine started and after it shut down: vLLM's engine core
destroys the default process group at shutdown unless the engine keeps it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.leftovers import wait_all
from trainer.ports import free_port

RANK = """
    import json, sys, torch, torch.distributed as dist
    from trainer.config import GenerationConfig
    from trainer.generation.base import SamplingParams
    from trainer.generation.vllm_engine import VLLMGenerationEngine
    from trainer.models import resolve_model

    rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    engine = VLLMGenerationEngine(resolve_model("builtin:tiny"), GenerationConfig(), "float32", seed=rank,
                                  max_model_len=128, threads=1)
    try:
        (samples,) = engine.generate([[2, 5, 6]], 2, SamplingParams(max_new_tokens=4, seed=rank))
        during = torch.tensor([rank + 1.0])
        dist.all_reduce(during)
    finally:
        engine.shutdown()
    after = torch.tensor([rank + 1.0])
    dist.all_reduce(after)  # the world outlives the engine
    with open(out, "w") as f:
        json.dump({"tokens": [c.token_ids for c in samples], "during": during.item(), "after": after.item()}, f)
    dist.destroy_process_group()
"""


@pytest.mark.vllm
def test_should_keep_the_training_world_when_a_colocated_engine_starts_and_stops(tiny_model_path, tmp_path):
    port = free_port("127.0.0.1")  # outside the ephemeral range (trainer.ports)
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [
        subprocess.Popen([sys.executable, "-c", textwrap.dedent(RANK), str(r), str(port), str(outs[r])])
        for r in range(2)
    ]
    codes = wait_all(procs, timeout=400)
    assert codes == [0, 0], "a rank failed (its output is above)"
    for out in outs:
        got = json.loads(out.read_text())
        assert got["during"] == got["after"] == 3.0
        assert len(got["tokens"]) == 2 and all(len(t) == 4 for t in got["tokens"])
