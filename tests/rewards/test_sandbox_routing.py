"""Code reward tasks on a cluster with a sandbox group: a real Ray cluster of two nodes on this machine
(``ray.cluster_utils.Cluster``), a head with one CPU and a sandbox node (127.0.0.2) with two CPUs and
the Ray resource ``kuberl_sandbox``, as the chart's sandbox group declares it. With
``KUBERL_SANDBOX_RESOURCE`` set (the chart sets it on every Ray container when ``sandbox.enabled``) a run
with a code reward sends every reward task there; naming a resource no node has stops the run with one
line. The drivers are processes of their own: this one may already drive the session's Ray instance."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.ray_process import ray_process

pytestmark = pytest.mark.slow

SANDBOX_IP = "127.0.0.2"


def _where(ground_truth, response, **kwargs):
    """A reward that says which Ray node scored it (its answer), beside the code reward."""
    import ray

    return 1.0, True, ray.get_runtime_context().get_node_id()


@pytest.fixture(scope="module")
def cluster():
    start = (
        "from ray.cluster_utils import Cluster\n"
        "c = Cluster(initialize_head=True, head_node_args={'num_cpus': 1, 'include_dashboard': False})\n"
        f"c.add_node(num_cpus=2, resources={{'kuberl_sandbox': 2}}, node_ip_address={SANDBOX_IP!r})\n"
        "c.wait_for_nodes()\n"
        "address = c.address"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with ray_process(start, "c.shutdown()", env, "the two-node cluster") as address:
        yield address


DRIVER = """
import json, sys, ray
from trainer.cluster import ClusterError
from trainer.config import EnvConfig, RewardSpec
from trainer.rewards import runner

ray.init(address=sys.argv[1], log_to_driver=False)
runner.SANDBOX_WAIT_S = 0  # the cluster is up: a missing resource will not join later
sandbox = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("kuberl_sandbox")]
specs = [RewardSpec("tests.rewards.test_sandbox_routing:_where"), RewardSpec("code_unit_tests", 0.5)]
try:
    r = runner.RewardRunner(EnvConfig(specs, max_concurrent_rewards=4))
except ClusterError as e:
    print(json.dumps({"refused": str(e)}))
    sys.exit(0)
ids = r.submit([({"inputs": ["1"], "outputs": ["1"]}, f"no program {i}") for i in range(12)])
nodes = [res.answer for res in r.results(ids)]
print(json.dumps({"sandbox": sandbox, "nodes": nodes, "resource": r.resource}))
"""


def _drive(address: str, resource: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "KUBERL_SANDBOX_RESOURCE")}
    env["RAY_ADDRESS"] = address
    if resource:
        env["KUBERL_SANDBOX_RESOURCE"] = resource
    out = subprocess.run([sys.executable, "-c", DRIVER, address], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_should_run_every_code_reward_task_on_the_sandbox_node_when_the_cluster_names_its_resource(cluster):
    found = _drive(cluster, "kuberl_sandbox")
    assert found["resource"] == "kuberl_sandbox" and len(found["sandbox"]) == 1
    assert len(found["nodes"]) == 12 and set(found["nodes"]) == set(found["sandbox"])


def test_should_refuse_in_one_line_when_no_node_has_the_sandbox_resource(cluster):
    found = _drive(cluster, "kuberl_nosuch")
    message = found["refused"]
    assert "\n" not in message
    assert message.startswith(
        "KUBERL_SANDBOX_RESOURCE=kuberl_nosuch: no node of this Ray cluster has the resource"
    )
    assert "sandbox.enabled=true" in message


def test_should_ask_for_no_resource_when_no_reward_runs_code(monkeypatch):
    from trainer.rewards.runner import sandbox_resource

    monkeypatch.setenv("KUBERL_SANDBOX_RESOURCE", "kuberl_sandbox")
    assert sandbox_resource(["math", "format"]) is None
    assert sandbox_resource(["math", "cpp_contest"]) == "kuberl_sandbox"
    monkeypatch.delenv("KUBERL_SANDBOX_RESOURCE")
    assert sandbox_resource(["code_unit_tests"]) is None  # make up, tests: nothing changes
