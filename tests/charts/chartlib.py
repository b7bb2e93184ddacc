"""Chart test helpers: a real `helm` binary (bin/helm, `make helm`) and the strict schemas in
../shared/schemas (KubeRay RayCluster, GKE multi-networking, Kubernetes 1.33 core kinds), with the
Deployment's from the kubernetes-validate package."""

from __future__ import annotations

import copy
import functools
import json
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kuberl"
VALUES = REPO / "values"
HELM = REPO / "bin" / "helm"
SCHEMAS = REPO.parent / "shared" / "schemas"

# Every kind the chart renders, and the schema it must satisfy.
SCHEMA_FILES = {
    ("ray.io/v1", "RayCluster"): "raycluster-v1-strict.json",
    ("ray.io/v1", "RayJob"): "rayjob-v1-strict.json",
    ("networking.gke.io/v1", "Network"): "gke-network-v1.json",
    ("networking.gke.io/v1", "GKENetworkParamSet"): "gke-gkenetworkparamset-v1.json",
    ("v1", "Pod"): "k8s/pod-v1.json",
    ("v1", "ServiceAccount"): "k8s/serviceaccount-v1.json",
    ("v1", "PersistentVolume"): "k8s/persistentvolume-v1.json",
    ("v1", "PersistentVolumeClaim"): "k8s/persistentvolumeclaim-v1.json",
    ("v1", "Secret"): "k8s/secret-v1.json",
    ("v1", "Service"): "k8s/service-v1.json",
    ("networking.k8s.io/v1", "NetworkPolicy"): "k8s/networkpolicy-v1.json",
    ("policy/v1", "PodDisruptionBudget"): "k8s/poddisruptionbudget-v1.json",
}
# Kinds ../shared/schemas has no file for: the same Kubernetes 1.33 strict schemas, from the PyPI package
# kubernetes-validate that SOURCES.md names (its $refs resolve into the package's _definitions.json).
PACKAGED_SCHEMAS = {("apps/v1", "Deployment"): "deployment-apps-v1.json"}
PACKAGED_VERSION = "v1.33.0-local-strict"

# What most behaviour tests start from: a renderable chart with nothing else changed.
BASE = ("storage.gcsfuse.bucketName=test-bucket",)
RDMA = ("rdma.enabled=true",)
JOB_SETS = ("job.enabled=true",)
NETWORKS_CHART = REPO / "charts" / "kuberl-networks"


def gpu_group(name: str, replicas: int = 1, gpus: int = 8) -> tuple[str, ...]:
    """--set values of a GPU worker group added on the command line: the schema requires a GPU group's CPU
    and memory requests (its memory limit bounds the memory-backed /dev/shm)."""
    return (f"workerGroups.{name}.replicas={replicas}", f"workerGroups.{name}.gpus={gpus}",
            f"workerGroups.{name}.resources.requests.cpu=16", f"workerGroups.{name}.resources.requests.memory=128Gi")  # fmt: skip


def helm_binary() -> Path:
    if not HELM.exists():
        pytest.skip("bin/helm is missing: run `make helm` (make test does it)")
    return HELM


def run_helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(helm_binary()), *args], capture_output=True, text=True, timeout=60)


@functools.cache
def lint_failure(*sets: str) -> str:
    """``helm lint --strict`` of the chart with ``--set`` values that must fail it; what it printed."""
    args = ["lint", "--strict", str(CHART), "--set", "storage.gcsfuse.bucketName=b"]
    for s in sets:
        args += ["--set", s]
    out = run_helm(*args)
    assert out.returncode != 0, f"lint passed with {sets}"
    return out.stdout + out.stderr


@functools.cache  # a test module renders the same values again and again; render() hands out copies
def _render(values_files: tuple[str, ...], sets: tuple[str, ...], release: str) -> tuple:
    args = ["template", release, str(CHART), "--namespace", "exp"]
    for f in values_files:
        args += ["-f", f]
    for s in sets:
        args += ["--set", s]
    out = run_helm(*args)
    if out.returncode != 0:
        raise AssertionError(f"helm template failed: {out.stderr.strip()}")
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def render(*sets: str, values: tuple[str, ...] = (), release: str = "exp1") -> list[dict]:
    """Rendered objects for `helm template` with these --set values (plus BASE unless a values file)."""
    base = () if values else BASE
    return copy.deepcopy(list(_render(tuple(str(v) for v in values), base + sets, release)))


def one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def groups(docs: list[dict]) -> dict[str, dict]:
    return {g["groupName"]: g for g in one(docs, "RayCluster")["spec"]["workerGroupSpecs"]}


def ray_resources(group: dict) -> dict[str, int]:
    """The custom Ray resources a rendered worker group offers: `rayStartParams.resources`, the JSON in
    single quotes that KubeRay hands to `ray start --resources`."""
    text = group["rayStartParams"].get("resources")
    if text is None:
        return {}
    assert text.startswith("'") and text.endswith("'"), f"not quoted for the shell: {text!r}"
    return json.loads(text[1:-1])


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """Whether a Kubernetes label selector (matchLabels, matchExpressions) selects a pod with these labels."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        has = key in labels
        if {"In": not has or labels[key] not in values, "NotIn": has and labels[key] in values,
            "Exists": not has, "DoesNotExist": has}[op]:  # fmt: skip
            return False
    return True


def pod_labels(docs: list[dict], cluster: str = "exp1-x7k2p") -> dict[str, dict[str, str]]:
    """The labels of every pod the release ends up with, by role: the Ray pods as KubeRay 1.6 labels them
    from the RayCluster's (or the RayJob's) templates (common/pod.go `labelPod`: its own labels, then the
    template's over them, but for ray.io/node-type, ray.io/group and ray.io/cluster, which it keeps; a
    RayJob's cluster is named `<name>-<random>`, `cluster` here), the RayJob's submitter and the `helm test`
    pods as rendered, and the sandbox service's pods (`sandbox`) and the reward server's (`reward-server`) as
    their Deployments' templates label them."""
    found: dict[str, dict[str, str]] = {}
    for doc in docs:
        if doc["kind"] == "Pod":
            found[f"test:{doc['metadata']['name']}"] = dict(doc["metadata"].get("labels") or {})
        if doc["kind"] == "Deployment":
            labels = dict(doc["spec"]["template"]["metadata"].get("labels") or {})
            found[labels["app.kubernetes.io/component"]] = labels
        if doc["kind"] not in ("RayCluster", "RayJob"):
            continue
        spec = doc["spec"]
        if doc["kind"] == "RayJob":
            found["submitter"] = dict(spec["submitterPodTemplate"]["metadata"].get("labels") or {})
            spec = spec["rayClusterSpec"]
        else:
            cluster = doc["metadata"]["name"]
        ray = [("head", "headgroup", spec["headGroupSpec"]["template"])]
        ray += [("worker", g["groupName"], g["template"]) for g in spec["workerGroupSpecs"]]
        for node_type, group, template in ray:
            labels = {"ray.io/is-ray-node": "yes", "app.kubernetes.io/name": "kuberay",
                      "app.kubernetes.io/created-by": "kuberay-operator"}  # fmt: skip
            labels.update((template["metadata"].get("labels") or {}).items())
            labels.update({"ray.io/node-type": node_type, "ray.io/group": group, "ray.io/cluster": cluster})
            found["head" if node_type == "head" else group] = labels
    return found


def deployment(docs: list[dict], component: str) -> dict:
    """The Deployment of a component (`sandbox`, `reward-server`)."""
    found = [d for d in docs if d["kind"] == "Deployment"
             and d["metadata"]["labels"]["app.kubernetes.io/component"] == component]  # fmt: skip
    assert len(found) == 1, f"expected one {component} Deployment, got {len(found)}"
    return found[0]


def sandbox_pod(docs: list[dict]) -> dict:
    """The sandbox service's pod template (its Deployment's)."""
    return deployment(docs, "sandbox")["spec"]["template"]


def head_template(docs: list[dict]) -> dict:
    return one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]


def env_of(template: dict) -> dict[str, dict]:
    return {e["name"]: e for e in template["spec"]["containers"][0]["env"]}


@functools.cache
def validator(api_version: str, kind: str):
    if not SCHEMAS.is_dir():
        pytest.skip(f"schemas not found at {SCHEMAS} (CI has them in ../shared/schemas)")
    import jsonschema

    if (api_version, kind) in PACKAGED_SCHEMAS:
        return _packaged_validator(PACKAGED_SCHEMAS[(api_version, kind)])
    name = SCHEMA_FILES.get((api_version, kind))
    assert name, f"no schema known for {api_version} {kind}: add it to SCHEMA_FILES"
    schema = json.loads((SCHEMAS / name).read_text())
    return jsonschema.Draft202012Validator(schema)


def _packaged_validator(name: str):
    import jsonschema
    import kubernetes_validate
    from referencing import Registry, Resource

    root = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / PACKAGED_VERSION
    definitions = json.loads((root / "_definitions.json").read_text())
    registry = Registry().with_resource(definitions["$id"], Resource.from_contents(definitions))
    return jsonschema.Draft202012Validator(json.loads((root / name).read_text()), registry=registry)


def schema_errors(doc: dict) -> list[str]:
    v = validator(doc["apiVersion"], doc["kind"])
    return [f"{doc['kind']} {'/'.join(map(str, e.absolute_path))}: {e.message}" for e in v.iter_errors(doc)]


def start_script(template: dict) -> str:
    """The bash script a Ray container runs (its args), as rendered."""
    return template["spec"]["containers"][0]["args"][0]


def run_start_script(
    template: dict, root: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run a Ray container's start-up script with bash, as the pod would, on this machine: the node's
    scripts and tools (/usr/local/gib/scripts, /usr/local/nvidia/bin) live under `root`, and KubeRay's
    `ray start` is `env`, so stdout shows the environment Ray would start with."""
    script = start_script(template)
    for node_dir in ("/usr/local/gib/scripts/", "/usr/local/nvidia/bin/"):
        script = script.replace(node_dir, f"{root}{node_dir}")
    base = {"PATH": "/usr/bin:/bin", "KUBERAY_GEN_RAY_START_CMD": "env"}
    for name in ("KUBERL_LOG_DIR", "KUBERL_CHECKPOINT_DIR", "HF_HOME", "KUBERL_CACHE"):
        base[name] = str(root / "data" / name.lower())
    return subprocess.run(["/bin/bash", "-c", "--", script], capture_output=True, text=True, timeout=30,
                          env={**base, **(env or {})})  # fmt: skip


def node_file(root: Path, path: str, text: str, mode: int = 0o644) -> Path:
    """A file at the node path `path` (e.g. /usr/local/gib/scripts/set_nccl_env.sh) under `root`."""
    f = root / path.lstrip("/")
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(text)
    f.chmod(mode)
    return f


def values_files() -> list[Path]:
    return sorted(VALUES.glob("*.yaml"))


def lock_pins(path: Path) -> dict[str, tuple[str, frozenset[str]]]:
    """A uv/pip-compile lock file as {name: (version, hashes)}."""
    pins: dict[str, tuple[str, frozenset[str]]] = {}
    name = None
    for line in path.read_text().splitlines():
        line = line.strip().rstrip("\\").strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("--hash="):
            version, hashes = pins[name]
            pins[name] = (version, hashes | {line.split("=", 1)[1]})
            continue
        req, _, _marker = line.partition(";")
        name, _, version = req.strip().partition("==")
        name = name.split("[")[0].strip().lower().replace("_", "-")
        pins[name] = (version.strip(), frozenset())
    return pins
