"""Every values/*.yaml: `helm lint --strict` passes, every rendered object validates against the
strict schemas in ../shared/schemas, and its worker groups supply exactly the nodes and GPUs that
its Hydra experiment's cluster config asks for (the reward model's group: its replicas' GPUs)."""

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
    # the sandbox group (sandbox.enabled) is CPU nodes for code rewards, outside the experiment's GPU
    # layout; so are the groups that offer the reward model's resource (checked below)
    rm = cfg.reward_model
    serving = {n: g for n, g in rendered.items() if rm.resource and rm.resource in ray_resources(g)}
    workers = {n: g for n, g in rendered.items() if n != "sandbox" and n not in serving}
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
