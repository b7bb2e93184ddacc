"""A killed generation actor takes its vLLM engine's processes with it (trainer/generation/vllm_lifetime.py).

The actor is the real :class:`~trainer.generation.worker.GenerationWorker` with a tensor-parallel 2 vLLM
engine on CPU: vLLM's multiproc executor spawns its two workers, each joining the driver's weight-transfer
group through the ``kuberl_gloo`` twin. The driver then starts a refit and sends nothing, so both workers
are blocked in a broadcast (where vLLM's own parent-death pipe cannot reach them), and SIGKILLs the actor's
process, as the kernel's OOM killer would: every process the actor started must be gone within seconds,
not when gloo's own timeout (10 minutes) or the pod's end would release them.

On a Ray instance with Ray's own clean-ups off, so that what is tested is the engine's: Ray 2.60's raylet
kills a dead worker's process group (``RAY_process_group_cleanup_enabled``), which holds vLLM's spawned
workers too, and ``ray.kill`` has the worker kill its direct children on its way out
(``RAY_kill_child_processes_on_worker_exit``). Neither covers an owner outside Ray (``trainer.tools.eval``), a
raylet configured otherwise, or a process that leaves the group.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from ..conftest import REPO, _ray_instance

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

GONE_WITHIN_S = 30
RAY_CLEANUPS_OFF = {"RAY_process_group_cleanup_enabled": "0", "RAY_kill_child_processes_on_worker_exit": "0"}

# The driver: argv = Ray address, model path, seconds to wait for the processes to go. Prints one JSON line.
DRIVER = """
import json, os, signal, sys, tempfile, time
import psutil, ray, torch
from trainer.config import load
from trainer.generation.refit.group import WeightSyncGroup
from trainer.generation.refit.transport import WeightMeta, init_info
from trainer.generation import vllm_lifetime
from trainer.generation.worker import GenerationWorker
from trainer.ports import free_port

address, model, within = sys.argv[1], sys.argv[2], float(sys.argv[3])
tmp = tempfile.gettempdir()
in_tmp = set(os.listdir(tmp))
ray.init(address=address, log_to_driver=False)
cfg = load(["experiment=tiny", f"model.name={model}", "generation.backend=vllm", "generation.placement=disaggregated",
            "generation.tensor_parallel_size=2", "cluster.cpu_workers_per_node=2"])
actor = ray.remote(num_cpus=0)(GenerationWorker).remote(cfg, model, 0, 2)
children, group, out = [], None, {}
try:
    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=600)  # the engine is built
    children = psutil.Process(pid).children(recursive=True)
    out["children"] = len(children)
    private = ray.get(actor.__ray_call__.remote(lambda self: self.engine._private_dir))
    out["private"] = os.path.dirname(private) == tmp and os.path.basename(private).startswith("kuberl-vllm-")
    port = free_port("127.0.0.1")
    joined = actor.init_weight_sync.remote(init_info("127.0.0.1", port, rank_offset=1, world_size=3))
    group = WeightSyncGroup("127.0.0.1", port, rank=0, world_size=3, device=torch.device("cpu"))
    ray.get(joined, timeout=120)
    meta = WeightMeta(["model.embed_tokens.weight"], ["float32"], [[64, 32]])
    receiving = actor.receive_weights.remote(meta.update_info())  # both workers wait for a broadcast never sent
    ended, _ = ray.wait([receiving], timeout=5)
    out["receiving"] = not ended
    # What the engine wrote outside its memory, read while its owner lives: from the kill on, the next engine
    # to start on this host (this test's, or another test's beside it) may sweep the directory.
    out["files"] = sorted(os.listdir(private))
    stores = [f for f in out["files"] if f.startswith("vllm_dist_")]
    shared = lambda: sorted(f for f in os.listdir("/dev/shm") if any(f.startswith(s + "-") for s in stores))
    out["shared"] = shared()  # the tensor-parallel workers' shared memory (vLLM's CPU communicator)
    out["outside"] = sorted(set(os.listdir(tmp)) - in_tmp)
    os.kill(pid, signal.SIGKILL)  # no __del__, no atexit in the actor
    deadline = time.monotonic() + within
    while True:
        alive = [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    out["alive"] = [" ".join(p.cmdline())[:120] for p in alive]
    # The killed owner left its directory and shared memory behind; a sweep (this one, or that of an engine
    # started beside this test since the kill) removes both.
    vllm_lifetime.sweep()
    out["swept"] = not os.path.exists(private)
    out["shared_after"] = shared()
finally:
    for p in children:  # whatever the test finds, nothing outlives it
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    if group is not None:
        group.abandon()
    print(json.dumps(out), flush=True)
"""


def test_should_leave_no_engine_process_when_a_tensor_parallel_generation_actors_process_is_killed_mid_refit(
    tiny_model_path, tmp_path
):
    pytest.importorskip("vllm")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with _ray_instance({**env, **RAY_CLEANUPS_OFF}, num_cpus=4) as address:
        proc = subprocess.run(
            [sys.executable, "-c", DRIVER, address, tiny_model_path, str(GONE_WITHIN_S)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=840,
        )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["children"] >= 2, out  # the two tensor-parallel workers, at least
    assert out["receiving"], "the refit ended without a byte sent"
    assert not out["alive"], (
        f"{len(out['alive'])} process(es) of the killed actor still running {GONE_WITHIN_S} s after the kill: "
        + "; ".join(out["alive"])
    )
    assert out["private"], out

    # The message queues' ZeroMQ sockets (uuid-named, two per queue) and the file store of vLLM's own
    # torch.distributed group, all in the engine's directory; the temporary directory got nothing else.
    def vllms(names):
        return [
            f for f in names if re.fullmatch(r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}|vllm_dist_\w+", f)
        ]

    assert len(vllms(out["files"])) >= 5 and any(f.startswith("vllm_dist_") for f in out["files"]), out[
        "files"
    ]
    assert not vllms(out["outside"]), out["outside"]  # (the other tests' engines keep theirs in theirs too)
    assert out["swept"], "the sweep left the killed engine's directory"
    assert len(out["shared"]) == 2 and not out["shared_after"], out  # one segment per worker, then none
