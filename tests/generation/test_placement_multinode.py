"""The flagship's placement on a Ray cluster of several nodes, simulated on this machine.

``gemma3-27b-gsm8k`` runs policy ranks on two training nodes and a tensor-parallel vLLM engine on a
third; policy rank 0 hosts the rendezvous the engine's workers join for every refit. Here the same shape,
scaled down: Ray's own ``ray.cluster_utils.Cluster`` starts a head and three worker raylets, each worker
on an address of its own (127.0.0.2-4: one machine, several node addresses, as several hosts would have),
every node with one CPU, so each holds one bundle as a GPU node holds its GPUs' (the CPU no bundle takes
runs the reward tasks). Which nodes the bundles take is Ray's choice, as on a cluster of equal GPU nodes. ``experiment=tiny`` then trains with ``cluster.num_nodes=3`` (two training nodes of one
rank each, one generation node) and a disaggregated vLLM engine at TP 2 (vLLM's CPU workers, on the
engine's node). The run says where every actor ran; the actor table must agree, the three actors must be
on three different nodes, the rendezvous must be rank 0's node address (not the engine's, not loopback's
127.0.0.1), and the run must learn as the single-node runs do (``tests/test_train_tiny.py``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.ray_process import ray_process
from tests.tiny_run import LEARN_STEPS, assert_learned, needs_vllm, read_scalars

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

NODES = {"train-a": "127.0.0.2", "train-b": "127.0.0.3", "generation": "127.0.0.4"}


@pytest.fixture
def cluster(tmp_path):
    """A head (one CPU: the reward tasks) and three one-CPU worker raylets on their own addresses;
    everything it started ends on exit."""
    start = (
        "from ray.cluster_utils import Cluster\n"
        "c = Cluster(initialize_head=True, head_node_args={'num_cpus': 1, 'include_dashboard': False})\n"
        f"for ip in {list(NODES.values())!r}:\n"
        "    c.add_node(num_cpus=1, node_ip_address=ip)\n"
        "c.wait_for_nodes()\n"
        "address = c.address"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with ray_process(start, "c.shutdown()", env, "the simulated cluster") as address:
        yield address, {**env, "RAY_ADDRESS": address}


def _actor_nodes(address: str) -> tuple[dict[str, list[str]], set[str]]:
    """Class name -> the node addresses its actors ran on, from the cluster's actor table; and the addresses
    of all its nodes. Read by a process of its own: this test process may already be a driver of the
    session's Ray instance (``ray_local``), and a process connects to one Ray cluster at a time."""
    code = (
        "import json, sys, ray\n"
        "from ray._private import state\n"
        "ray.init(address=sys.argv[1], log_to_driver=False)\n"
        "ips = {n['NodeID']: n['NodeManagerAddress'] for n in ray.nodes()}\n"
        "found = {}\n"
        "for actor in state.actors().values():\n"
        "    found.setdefault(actor['ActorClassName'], []).append(ips[actor['Address']['NodeID']])\n"
        "print(json.dumps([found, sorted(set(ips.values()))]))\n"
        "ray.shutdown()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run(
        [sys.executable, "-c", code, address], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    found, ips = json.loads(out.stdout.strip().splitlines()[-1])
    return found, set(ips)


def test_should_place_policy_ranks_on_two_nodes_and_the_engine_on_a_third_and_learn_when_the_cluster_has_three(
    cluster, tmp_path
):
    needs_vllm()
    address, env = cluster
    logs, ckpt = tmp_path / "logs", tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", "experiment=tiny", f"logger.log_dir={logs}", "checkpointing.enabled=false",
         f"checkpointing.checkpoint_dir={ckpt}", f"grpo.max_num_steps={LEARN_STEPS}",
         "cluster.num_nodes=3", "cluster.cpu_workers_per_node=1", "generation.resources.num_nodes=1",
         "generation.backend=vllm", "generation.placement=disaggregated", "generation.tensor_parallel_size=2"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = re.search(r"^kuberl: placement: (.*)$", proc.stdout, re.M)
    assert line, proc.stdout[-3000:]
    print(line.group(0))  # where each actor ran, in the test's output
    hosts = re.fullmatch(
        r"policy rank 0 on (\S+), rank 1 on (\S+); generation worker 0 on (\S+) \(tensor parallel 2 each\); "
        r"weights from policy rank 0 at (\S+)",
        line.group(1),
    )
    assert hosts, line.group(1)
    rank0, rank1, engine, rendezvous = hosts.groups()
    actors, nodes = _actor_nodes(address)
    assert len({rank0, rank1, engine}) == 3 and {rank0, rank1, engine} <= nodes, "three actors, three nodes"
    # The engine's workers joined rank 0's address: another node's, and not a loopback only rank 0 could reach.
    assert rendezvous == rank0 != engine
    assert sorted(actors["PolicyWorker"]) == sorted([rank0, rank1])
    assert actors["GenerationWorker"] == [engine]
    scalars = read_scalars(next((logs / "tiny").iterdir()))
    print("reward per step:", " ".join(f"{r:.3f}" for r in scalars["train/reward_mean"]))
    assert_learned(scalars["train/reward_mean"])
    # Every step sampled with the weights of the refit before it, received across nodes.
    assert all(g < 0.05 for g in scalars["train/gen_logprob_abs_diff"]), scalars["train/gen_logprob_abs_diff"]
