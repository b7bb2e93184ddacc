"""Every values/*.yaml: `helm lint --strict` passes, every rendered object validates against the
strict schemas in ../shared/schemas, its worker groups supply exactly the nodes and GPUs that
its Hydra experiment's cluster config asks for (the reward model's group: its replicas' GPUs), and every
pod it renders fits the node pool it selects (GKE's allocatable of the machine type)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from chartlib import CHART, groups, ray_resources, render, run_helm, schema_errors, values_files

FILES = values_files()


@pytest.fixture(params=FILES, ids=[p.stem for p in FILES])
def values_file(request) -> Path:
    return request.param


@pytest.mark.parametrize("sets", [(), ("--set", "job.enabled=true")], ids=["raycluster", "rayjob"])
def test_should_pass_helm_lint_strict_when_linting_each_values_file(values_file: Path, sets) -> None:
    out = run_helm("lint", "--strict", str(CHART), "-f", str(values_file), *sets)
    assert out.returncode == 0, out.stdout + out.stderr


def test_should_validate_every_rendered_object_against_the_schemas_when_templating_each_values_file(
    values_file: Path,
) -> None:
    docs = render(values=(str(values_file),))
    assert {d["kind"] for d in docs} >= {"RayCluster", "Pod"}
    errors = [e for d in docs for e in schema_errors(d)]
    assert not errors, "\n".join(errors)


def test_should_supply_the_nodes_and_gpus_of_its_experiment_when_rendered(values_file: Path) -> None:
    from trainer.config import load

    experiment = (yaml.safe_load(values_file.read_text()) or {}).get("experiment")
    assert experiment, f"{values_file.name} names no Hydra experiment (experiment: NAME)"
    cfg = load([f"experiment={experiment}"])
    rendered = groups(render(values=(str(values_file),)))
    # the groups that offer the reward model's resource are outside the experiment's GPU layout (checked
    # below); the sandbox service (sandbox.enabled) is no Ray group at all
    rm = cfg.reward_model
    serving = {n: g for n, g in rendered.items() if rm.resource and rm.resource in ray_resources(g)}
    workers = {n: g for n, g in rendered.items() if n not in serving}
    per_pod = {name: _gpus(g) for name, g in workers.items()}
    nodes = {name: g["replicas"] for name, g in workers.items()}
    assert sum(nodes.values()) == cfg.cluster.num_nodes, (
        f"worker pods {nodes} != cluster.num_nodes={cfg.cluster.num_nodes}"
    )
    for name, gpus in per_pod.items():
        assert gpus == cfg.cluster.gpus_per_node, (
            f"group {name}: {gpus} GPUs per pod != cluster.gpus_per_node={cfg.cluster.gpus_per_node}"
        )
    if cfg.disaggregated:
        res = cfg.generation.resources
        assert "generation" in workers, "disaggregated placement needs a `generation` worker group"
        assert nodes["generation"] == res.num_nodes and per_pod["generation"] == res.gpus_per_node
        assert sum(n for g, n in nodes.items() if g != "generation") == cfg.train_nodes
    else:
        assert "generation" not in workers, "colocated placement: generation shares the training GPUs"
    uses_rm = any(r.name == "reward_model" for r in cfg.env.reward_functions)
    if uses_rm and rm.resource:
        assert serving, f"reward_model.resource={rm.resource}: no worker group offers it (rayResources)"
        gpus = sum(g["replicas"] * _gpus(g) for g in serving.values())
        units = sum(g["replicas"] * ray_resources(g)[rm.resource] for g in serving.values())
        assert gpus == rm.replicas * rm.num_gpus, (
            f"groups {sorted(serving)} hold {gpus} GPUs != reward_model.replicas x num_gpus = "
            f"{rm.replicas} x {rm.num_gpus}"
        )
        assert units == rm.replicas, f"{units} units of {rm.resource} != reward_model.replicas={rm.replicas}"
    else:
        assert not serving, f"groups {sorted(serving)} serve a reward model that {experiment} does not use"
    if not cfg.cluster.use_gpus:
        rc = next(d for d in render(values=(str(values_file),)) if d["kind"] == "RayCluster")
        assert rc["spec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"


def _gpus(group: dict) -> int:
    return int(
        group["template"]["spec"]["containers"][0]["resources"].get("limits", {}).get("nvidia.com/gpu", 0)
    )


def _gpu_containers(docs: list[dict]) -> list[dict]:
    specs = [d["spec"] for d in docs if d["kind"] == "RayCluster"]
    specs += [d["spec"]["rayClusterSpec"] for d in docs if d["kind"] == "RayJob"]
    templates = [
        t
        for s in specs
        for t in [s["headGroupSpec"]["template"], *(g["template"] for g in s["workerGroupSpecs"])]
    ]
    return [
        c for t in templates for c in t["spec"]["containers"]
        if int(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0)) > 0
    ]  # fmt: skip


@pytest.mark.parametrize("job", [False, True], ids=["raycluster", "rayjob"])
def test_should_find_cuda_on_every_gpu_container_when_rendering_each_values_file(
    values_file: Path, job: bool
) -> None:
    docs = render(*(["job.enabled=true"] if job else []), values=(str(values_file),))
    gpu_type = (yaml.safe_load(values_file.read_text()).get("gpu") or {}).get("type", "b200")
    containers = _gpu_containers(docs)
    assert containers or gpu_type == "none"
    for c in containers:
        env = {e["name"]: e.get("value", "") for e in c["env"]}
        assert "/usr/local/nvidia/lib64" in env.get("LD_LIBRARY_PATH", "").split(":"), c["name"]


def test_should_validate_the_rayjob_against_its_schema_when_job_enabled_in_each_values_file(
    values_file: Path,
) -> None:
    docs = render("job.enabled=true", values=(str(values_file),))
    errors = [e for d in docs for e in schema_errors(d)]
    assert not errors, "\n".join(errors)
    assert [d["kind"] for d in docs if d["kind"].startswith("Ray")] == ["RayJob"]


def test_should_put_the_head_on_a_node_with_at_least_16_vcpus_when_the_values_use_gpus(
    values_file: Path,
) -> None:
    docs = render(values=(str(values_file),))
    if (yaml.safe_load(values_file.read_text()).get("gpu") or {}).get("type") == "none":
        pytest.skip("a CPU-only cluster on one machine")
    spec = next(d for d in docs if d["kind"] == "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]
    machine = spec.get("nodeSelector", {}).get("node.kubernetes.io/instance-type", "")
    assert machine, "the head needs a node selector for the CPU head pool"
    assert int(machine.rsplit("-", 1)[-1]) >= 16, f"{machine} has fewer than 16 vCPUs"
    cpu = spec["containers"][0]["resources"]["requests"]["cpu"]
    assert float(cpu) > 8, f"head requests {cpu} CPUs: it would also fit a node with 8 vCPUs"


CODE_REWARDS = ("code_unit_tests", "cpp_contest")  # what trainer/run.py checks the sandbox for


def test_should_give_code_rewards_a_sandbox_that_starts_when_its_experiment_runs_model_code(
    values_file: Path,
) -> None:
    from trainer.config import load

    values = yaml.safe_load(values_file.read_text())
    cfg = load([f"experiment={values['experiment']}"])
    runs_code = any(r.name in CODE_REWARDS for r in cfg.env.reward_functions)
    sandbox = values.get("sandbox") or {}
    assert bool(sandbox.get("enabled")) == runs_code, (
        f"{values_file.name}: sandbox.enabled must be {runs_code}: its experiment "
        + ("runs code rewards, which refuse to run without bubblewrap" if runs_code else "runs no model code")
    )
    assert sandbox.get("backend", "bwrap") == "bwrap", "code rewards never fall back on the cluster"
    assert "containerSecurityContext" not in values, "sandbox.enabled sets what bubblewrap needs"


# ----- pods and the pools they select -------------------------------------------------------------------
# (vCPUs, memory in GiB) of the machine types the values files select (Compute Engine's machine families).
MACHINES = {"n2-standard-16": (16, 64), "a4-highgpu-8g": (224, 3968), "a3-ultragpu-8g": (224, 2952)}
# What GKE's own DaemonSets ask of every node (kube-proxy, fluentbit, gke-metadata-server, CSI nodes, netd):
# about half a CPU and 1 GiB, more than they ask on GKE 1.33's n2 and GPU nodes.
DAEMONSETS = (0.5, 1.0)


def gke_allocatable(vcpus: int, gib: float) -> tuple[float, float]:
    """A GKE Standard node's allocatable CPU and memory (GiB), as GKE documents its reservation: CPU 6% of
    the first core, 1% of the second, 0.5% of the next two, 0.25% of the rest; memory 25% of the first 4 GiB,
    20% of the next 4, 10% of the next 8, 6% of the next 112, 2% of the rest, and 100 MiB for eviction."""
    cpu = 0.06 * min(vcpus, 1) + 0.01 * min(max(vcpus - 1, 0), 1) + 0.005 * min(max(vcpus - 2, 0), 2)
    cpu += 0.0025 * max(vcpus - 4, 0)
    mem, rest = 0.0, gib
    for size, share in ((4, 0.25), (4, 0.20), (8, 0.10), (112, 0.06), (float("inf"), 0.02)):
        mem += share * min(rest, size)
        rest = max(rest - size, 0)
    return vcpus - cpu, gib - mem - 100 / 1024


def _cpu(q) -> float:
    q = str(q)
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def _gib(q) -> float:
    q = str(q)
    units = {"Ki": 2**-20, "Mi": 2**-10, "Gi": 1, "Ti": 2**10}
    return float(q[:-2]) * units[q[-2:]] if q[-2:] in units else float(q) / 2**30


def _pods(values_file: Path, *sets: str) -> list[tuple[str, dict]]:
    """(role, pod spec) of every pod the values file makes, each replica once: the Ray pods and `helm test`
    pods of the RayCluster, the RayJob's submitter, and the sandbox service's pods."""
    pods = []
    for job in (False, True):
        docs = render(*sets, *(["job.enabled=true"] if job else []), values=(str(values_file),))
        for d in docs:
            if d["kind"] == "RayCluster":
                spec = d["spec"]
                pods.append(("head", spec["headGroupSpec"]["template"]["spec"]))
                for g in spec["workerGroupSpecs"]:
                    pods += [(g["groupName"], g["template"]["spec"])] * g["replicas"]
            if d["kind"] == "RayJob":
                pods.append(("submitter", d["spec"]["submitterPodTemplate"]["spec"]))
            if d["kind"] == "Pod":
                pods.append((d["metadata"]["name"], d["spec"]))
            if d["kind"] == "Deployment" and not job:
                pods += [("sandbox", d["spec"]["template"]["spec"])] * d["spec"]["replicas"]
    return pods


def _requests(spec: dict) -> tuple[float, float]:
    cpu = mem = 0.0
    for c in spec["containers"]:
        r = (c.get("resources") or {}).get("requests") or {}
        cpu, mem = cpu + _cpu(r.get("cpu", 0)), mem + _gib(r.get("memory", 0))
    return cpu, mem


def _misfits(values_file: Path, *sets: str) -> list[str]:
    """Why the pods of a values file would stay Pending: a pod larger than a node of the machine type it
    selects; more than one node's worth on the head's pool, which is one node (docs/cluster.md step 4:
    `--num-nodes=1`; the head, the submitter and the `helm test` pods select it); a sandbox pod that selects
    the head's pool, whose one node it may not share with the head (their anti-affinity)."""
    pods = _pods(values_file, *sets)
    head_pool = next(spec for role, spec in pods if role == "head").get("nodeSelector") or {}
    found, on_head_node = [], [0.0, 0.0]
    for role, spec in pods:
        selector = spec.get("nodeSelector") or {}
        machine = selector.get("node.kubernetes.io/instance-type")
        if machine not in MACHINES:
            found.append(f"{role} selects no machine type this test knows ({machine})")
            continue
        cpu, mem = _requests(spec)
        alloc_cpu, alloc_mem = gke_allocatable(*MACHINES[machine])
        free = (alloc_cpu - DAEMONSETS[0], alloc_mem - DAEMONSETS[1])
        if cpu > free[0] or mem > free[1]:
            found.append(f"{role} asks for {cpu:g} CPU and {mem:g} GiB; a {machine} node leaves "
                         f"{free[0]:.2f} CPU and {free[1]:.1f} GiB")  # fmt: skip
        if role == "sandbox" and selector.items() <= head_pool.items():
            found.append(f"the sandbox's nodeSelector {selector} selects the head's one-node pool")
        elif role != "sandbox" and selector == head_pool:
            on_head_node = [on_head_node[0] + cpu, on_head_node[1] + mem]
    alloc_cpu, alloc_mem = gke_allocatable(
        *MACHINES[head_pool.get("node.kubernetes.io/instance-type", "n2-standard-16")]
    )
    if on_head_node[0] > alloc_cpu - DAEMONSETS[0] or on_head_node[1] > alloc_mem - DAEMONSETS[1]:
        found.append(f"the head's node gets {on_head_node[0]:g} CPU and {on_head_node[1]:g} GiB of requests")
    return found


def test_should_fit_every_pod_on_the_pool_it_selects_when_rendering_each_values_file(
    values_file: Path,
) -> None:
    if (yaml.safe_load(values_file.read_text()).get("gpu") or {}).get("type") == "none":
        pytest.skip("a CPU-only cluster on one machine: no machine type")
    assert not _misfits(values_file), values_file.name


def test_should_find_the_sandbox_pending_when_it_selects_the_heads_pool_as_the_code_values_once_did(
    tmp_path,
) -> None:
    """Issue 63: two 15-CPU sandbox pods on the head's one-node n2-standard-16 pool stayed Pending."""
    code = next(p for p in FILES if p.stem == "qwen2.5-coder-7b-code-b200")
    values = yaml.safe_load(code.read_text())
    values["sandbox"]["nodeSelector"] = {"node.kubernetes.io/instance-type": "n2-standard-16"}  # as it was
    before = tmp_path / code.name
    before.write_text(yaml.safe_dump(values))
    assert _misfits(before) == [
        "the sandbox's nodeSelector {'node.kubernetes.io/instance-type': 'n2-standard-16'} selects the head's "
        "one-node pool"] * 2  # fmt: skip
    assert "the head's node gets" in " ".join(
        _misfits(code, "sandbox.cpus=15", "head.resources.requests.cpu=15.5")
    )


def test_should_compute_gkes_allocatable_as_gke_documents_it() -> None:
    # GKE's own figure for n2-standard-16 (16 vCPUs, 64 GiB): 15.89 CPU
    cpu, mem = gke_allocatable(16, 64)
    assert round(cpu, 2) == 15.89 and 58.2 < mem < 58.5
