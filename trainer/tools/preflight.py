"""``python -m trainer.tools.preflight``: what a GKE cluster lacks for one release, one line each.

``make preflight EXP=... [HELM_ARGS="--set ..."]`` renders the release with ``helm template`` (the
values file and the same ``HELM_ARGS`` that ``make install`` applies), reads the cluster with kubectl
and checks what the rendered pods will need:

  KubeRay       the ray.io CRDs, with the fields the chart sets (``authOptions``, ``upgradeStrategy``:
                `helm upgrade` of the operator never updates its CRDs, and an old CRD prunes them
                silently), and an operator at least as new as the chart's
                ``kuberl.dev/min-kuberay-version`` annotation (1.6: older ones inject wget-based
                probes, and the job image has no wget)
  GPU nodes     for each worker group: Ready nodes that match its node selector (accelerator,
                machine type, spot or reservation, local SSD) and tolerate nothing it does not, with
                allocatable ``nvidia.com/gpu``, CPU and memory for every replica (first fit, on empty
                nodes); their NVIDIA driver against ``kuberl.dev/min-nvidia-driver`` where the node
                reports it (GPU Feature Discovery labels; GKE's own labels name only the channel)
  head          a node of the head's pool that fits the head's requests
  RDMA          (GPU pods with multi-network annotations) GKE's ``nccl-rdma-installer`` DaemonSet,
                rolled out (a Ready pod) on every node the GPU groups match, the multi-networking
                CRDs, and the ``gvnic-1``/``rdma-N`` networks when the chart does not create them
  storage       the CSI driver each volume uses, an existing claim, and for Managed Lustre nodes on
                GKE 1.33.2-gke.4655000 or later (docs/cluster.md creates the instance without
                ``--gke-support-enabled``, which older nodes need with ``--enable-legacy-lustre-port``)
  identity      the service account when the chart does not create it, the Secrets pods read, the
                Ray token's Secret when the chart does not create it (and a note when auth is off)
  quotas        where ``gcloud`` is installed: the region's GPU quota of the capacity type (on-demand,
                or preemptible for spot and flex-start; a reservation's VMs hold theirs already) and
                ``GPUS_ALL_REGIONS``, against the GPUs the groups need beyond the nodes already there
  Pod Security  the namespace's ``pod-security.kubernetes.io/enforce`` level against the one the
                rendered pods need (hostPath volumes of the RDMA workers and Unconfined seccomp or
                AppArmor of code sandboxes need ``privileged``; KubeRay reports a rejected pod only
                as an event), and what ``warn``/``audit`` will say

``make install`` runs the KubeRay check alone (``--kuberay-only``) before ``helm upgrade --install``.
Without kubectl the checks cannot run: one line says so, and install goes on. The checks take a
``kubectl`` function and rendered objects, so that tests feed them recorded ``kubectl`` answers.
It needs helm and PyYAML only: no torch, no Ray.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kuberl"
MIN_KUBERAY_KEY = "kuberl.dev/min-kuberay-version"
MIN_DRIVER_KEY = "kuberl.dev/min-nvidia-driver"
RDMA_INSTALLER = ("kube-system", "nccl-rdma-installer")  # GKE's DaemonSet: gIB plugin + host libraries
RDMA_INSTALLER_LABEL = "k8s-app=nccl-rdma-installer"  # its pods' label in GKE's manifest
RDMA_INSTALLER_URL = (
    "https://raw.githubusercontent.com/GoogleCloudPlatform/container-engine-accelerators/master/"
    "gpudirect-rdma/nccl-rdma-installer.yaml"
)
CSI_ADDONS = {
    "gcsfuse.csi.storage.gke.io": "GcsFuseCsiDriver",
    "lustre.csi.storage.gke.io": "LustreCsiDriver",
}
# Managed Lustre without the legacy port: GKE's LustreCsiDriverConfig.enable_legacy_lustre_port is
# "no longer required as of GKE node version 1.33.2-gke.4655000" (GKE API reference).
LUSTRE_MIN_GKE = (1, 33, 2, 4655000)
# Where a node says which NVIDIA driver it runs: NVIDIA GPU Feature Discovery's labels (newer, older).
DRIVER_LABELS = ("nvidia.com/cuda.driver-version.major", "nvidia.com/cuda.driver.major")
GKE_DRIVER_LABEL = "cloud.google.com/gke-gpu-driver-version"  # GKE: `default` / `latest`, not a number
GPU = "nvidia.com/gpu"
# Fields of the RayCluster spec the chart sets, which KubeRay's CRDs gained in 1.6 (authOptions,
# upgradeStrategy): an older CRD prunes them without a word.
CRD_FIELDS = {"rayclusters.ray.io": ("spec",), "rayjobs.ray.io": ("spec", "rayClusterSpec")}
NEEDED_FIELDS = ("authOptions", "upgradeStrategy")
# Compute Engine quota metrics of the GPUs the presets use; spot and flex-start VMs count against the
# PREEMPTIBLE_ ones.
GPU_QUOTAS = {"nvidia-h200-141gb": "NVIDIA_H200_GPUS", "nvidia-b200": "NVIDIA_B200_GPUS"}
PSA = "pod-security.kubernetes.io"
PSA_LEVELS = ("restricted", "baseline", "privileged")  # strictest first


@dataclass
class Result:
    """What kubectl answered: exit status, stdout, stderr."""

    rc: int
    out: str = ""
    err: str = ""


Kubectl = Callable[..., Result]
Gcloud = Callable[..., "Result | None"]  # None: no gcloud here, so no quota check


class NoCluster(Exception):
    """kubectl is missing or cannot reach a cluster: the checks cannot run (one line says why)."""


class RenderError(Exception):
    """helm cannot render the release (a bad value, no helm): one line says why."""


def real_kubectl(*args: str) -> Result:
    if not shutil.which("kubectl"):
        raise NoCluster("kubectl is not installed")
    try:
        p = subprocess.run(["kubectl", *args], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        raise NoCluster(f"kubectl {' '.join(args[:2])} timed out: is the cluster reachable?") from None
    return Result(p.returncode, p.stdout, p.stderr)


def real_gcloud(*args: str) -> Result | None:
    if not shutil.which("gcloud"):
        return None
    try:
        p = subprocess.run(["gcloud", *args, "--format=json"], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return Result(1, "", "gcloud timed out")
    return Result(p.returncode, p.stdout, p.stderr)


def _get(kubectl: Kubectl, *args: str) -> dict | None:
    """`kubectl get ... -o json` as a dict; None when the object does not exist."""
    r = kubectl("get", *args, "-o", "json")
    if r.rc == 0:
        return json.loads(r.out or "{}")
    lines = r.err.strip().splitlines() or ["no output"]
    if any(s in lines[0] for s in ("NotFound", "not found", "doesn't have a resource type")):
        return None
    raise NoCluster(f"kubectl get {' '.join(args[:2])}: {lines[-1]}")  # the last line is kubectl's summary


def check_context(kubectl: Kubectl) -> str:
    r = kubectl("config", "current-context")
    if r.rc != 0 or not r.out.strip():
        raise NoCluster(
            "no kube context: gcloud container clusters get-credentials CLUSTER --location LOCATION"
        )
    return r.out.strip()


# ----- versions and quantities --------------------------------------------------------------------


def parse_version(text: str) -> tuple[int, int, int] | None:
    """`v1.6.0`, `1.6.1-rc.0` or an image `quay.io/kuberay/operator:v1.6.0` -> (1, 6, 0)."""
    tag = text.rsplit("@", 1)[0].rsplit(":", 1)[-1] if "/" in text or ":" in text else text
    m = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", tag)
    return (int(m[1]), int(m[2]), int(m[3] or 0)) if m else None


def parse_gke_version(text: str) -> tuple[int, int, int, int] | None:
    """A kubelet version `v1.33.2-gke.4655000` -> (1, 33, 2, 4655000); None when not a GKE version."""
    m = re.match(r"^v?(\d+)\.(\d+)\.(\d+)-gke\.(\d+)", text)
    return tuple(int(g) for g in m.groups()) if m else None  # type: ignore[return-value]


_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
           "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18, "m": 1e-3, "": 1}  # fmt: skip


def parse_quantity(text: str | int | float) -> float:
    """A Kubernetes quantity (`12`, `15890m`, `48Gi`, `61255728Ki`, `1e3`) as a number."""
    m = re.fullmatch(
        r"([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?", str(text).strip()
    )
    if not m:
        raise ValueError(f"not a Kubernetes quantity: {text!r}")
    return float(m[1]) * _SUFFIX[m[2] or ""]


def _show(name: str, amount: float) -> str:
    if name == "memory":
        return f"{amount / 2**30:.0f}Gi"
    return f"{amount:g} CPU" if name == "cpu" else f"{amount:g} {name}"


def min_kuberay_version() -> str:
    return _chart_annotation(MIN_KUBERAY_KEY)


def min_driver() -> int:
    return int(_chart_annotation(MIN_DRIVER_KEY))


def _chart_annotation(key: str) -> str:
    return yaml.safe_load((CHART / "Chart.yaml").read_text())["annotations"][key]


# ----- KubeRay ------------------------------------------------------------------------------------


def check_kuberay(kubectl: Kubectl, minimum: str) -> tuple[list[str], list[str]]:
    """(problems, notes): the CRDs must exist and the operator's image tag must be >= minimum."""
    install = f"make kuberay (kuberay-operator {minimum} with bin/helm; docs/cluster.md step 9)"
    crds = {c: _get(kubectl, "crd", c) for c in CRD_FIELDS}
    missing = [c for c, crd in crds.items() if crd is None]
    if missing:
        return [f"KubeRay is not installed (no CRD {', '.join(missing)}): {install}"], []
    stale = []
    for name, crd in crds.items():
        fields = crd_fields(crd, CRD_FIELDS[name])
        if fields is not None:
            stale += [
                f"{name} has no {f}"
                for f in NEEDED_FIELDS
                if f not in fields and not (f == "upgradeStrategy" and name == "rayjobs.ray.io")
            ]
    crd_problems = (
        [
            f"KubeRay's CRDs are older than the operator the chart needs ({'; '.join(stale)}; `helm upgrade` never "
            f"updates a chart's CRDs, and the API server drops those fields without a word): make kuberay "
            "(applies the CRDs server-side)"
        ]
        if stale
        else []
    )
    deployments = _get(kubectl, "deployments", "-A", "-l", "app.kubernetes.io/name=kuberay-operator") or {}
    images = [
        c["image"]
        for d in deployments.get("items", [])
        for c in d["spec"]["template"]["spec"]["containers"]
        if "kuberay" in c["image"] or "operator" in c["image"]
    ]
    if not images:
        return crd_problems, [
            f"KubeRay operator not found by label app.kubernetes.io/name=kuberay-operator: "
            f"check yourself that it is {minimum} or newer"
        ]
    want = parse_version(minimum)
    problems, notes = list(crd_problems), []
    for image in images:
        have = parse_version(image)
        if have is None:
            notes.append(f"KubeRay operator image {image} has no version tag: check it is {minimum} or newer")
        elif have < want:
            problems.append(
                f"KubeRay operator {image} is older than {minimum} (it injects wget probes the image "
                f"cannot run): make kuberay (upgrades it to {minimum} with bin/helm)"
            )
    return problems, notes


def crd_fields(crd: dict, path: tuple[str, ...]) -> set[str] | None:
    """The properties of the v1 schema at ``path`` (``spec``, ``spec.rayClusterSpec``); None when the
    CRD carries no such schema to read."""
    for version in (crd.get("spec") or {}).get("versions") or []:
        if version.get("name") != "v1":
            continue
        node = ((version.get("schema") or {}).get("openAPIV3Schema")) or {}
        for part in path:
            node = (node.get("properties") or {}).get(part) or {}
        props = node.get("properties")
        return set(props) if props else None
    return None


# ----- what the rendered release needs ------------------------------------------------------------


def render(release: str, values_file: Path, namespace: str, helm_args: list[str], helm: str) -> list[dict]:
    """`helm template` of the release as `make install` would apply it (values file + HELM_ARGS)."""
    cmd = [
        helm,
        "template",
        release,
        str(CHART),
        "--namespace",
        namespace,
        "-f",
        str(values_file),
        *helm_args,
    ]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    except FileNotFoundError:
        raise RenderError(f"helm is not at {helm}: make helm (it installs bin/helm)") from None
    if out.returncode != 0:
        lines = [ln for ln in out.stderr.strip().splitlines() if ln.strip()] or ["no output"]
        raise RenderError(f"helm template cannot render {release}: {lines[0].removeprefix('Error: ')}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@dataclass
class PodNeed:
    """Pods of one group: how many, where they may go and what each asks for."""

    name: str  # `head` or `workerGroups.<group>`
    count: int
    selector: dict[str, str]
    tolerations: list[dict]
    requests: dict[str, float]  # cpu, memory, nvidia.com/gpu (only those asked for)
    rdma: bool = False
    # Node labels its required node affinity rules out (NotIn): capacity.type=onDemand keeps GPU pods
    # off spot and flex-start nodes this way. Only the first term is read: the chart adds its rule to all.
    excluded: dict[str, set[str]] = field(default_factory=dict)

    @property
    def gpus(self) -> int:
        return int(self.requests.get(GPU, 0))


@dataclass
class Plan:
    """What the rendered objects ask of the cluster."""

    head: PodNeed
    workers: list[PodNeed]
    networks: list[str] = field(default_factory=list)  # Network objects the GPU pods attach to
    csi_drivers: set[str] = field(default_factory=set)
    claims: list[str] = field(default_factory=list)  # claims the pods use and the release does not create
    service_account: str = ""
    creates_service_account: bool = False
    secrets: dict[str, tuple[str, str]] = field(default_factory=dict)  # Secret -> (key, env var)
    auth_on: bool = False  # authOptions.mode=token
    auth_secret: str | None = (
        None  # the Ray token's Secret (authOptions.secretName); None: KubeRay makes its own
    )
    creates_auth_secret: bool = False
    # The Pod Security level the rendered pods need, and why where it is `privileged`.
    pod_security: str = "baseline"
    privileged_because: list[str] = field(default_factory=list)


def _requests(container: dict) -> dict[str, float]:
    res = container.get("resources") or {}
    merged = {**(res.get("limits") or {}), **(res.get("requests") or {})}  # a limit alone is the request
    return {k: parse_quantity(merged[k]) for k in ("cpu", "memory", GPU) if k in merged}


def _need(name: str, count: int, template: dict) -> PodNeed:
    spec = template["spec"]
    annotations = (template.get("metadata") or {}).get("annotations") or {}
    return PodNeed(
        name=name,
        count=count,
        selector=dict(spec.get("nodeSelector") or {}),
        tolerations=list(spec.get("tolerations") or []),
        requests=_requests(spec["containers"][0]),
        rdma="networking.gke.io/interfaces" in annotations,
        excluded=_excluded(spec),
    )


def _excluded(spec: dict) -> dict[str, set[str]]:
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    terms = required.get("nodeSelectorTerms") or [{}]
    return {
        e["key"]: set(e.get("values") or [])
        for e in terms[0].get("matchExpressions") or []
        if e.get("operator") == "NotIn"
    }


def plan(docs: list[dict]) -> Plan:
    by_kind: dict[str, list[dict]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    if "RayCluster" in by_kind:
        spec = by_kind["RayCluster"][0]["spec"]
    else:
        spec = by_kind["RayJob"][0]["spec"]["rayClusterSpec"]
    head_template = spec["headGroupSpec"]["template"]
    templates = [head_template]
    workers = []
    for g in spec.get("workerGroupSpecs", []):
        workers.append(_need(f"workerGroups.{g['groupName']}", int(g.get("replicas", 0)), g["template"]))
        templates.append(g["template"])
    p = Plan(head=_need("head", 1, head_template), workers=workers)
    for t in templates[1:]:
        raw = ((t.get("metadata") or {}).get("annotations") or {}).get("networking.gke.io/interfaces")
        for iface in json.loads(raw) if raw else []:
            if iface["network"] != "default" and iface["network"] not in p.networks:
                p.networks.append(iface["network"])
    created_claims = {d["metadata"]["name"] for d in by_kind.get("PersistentVolumeClaim", [])}
    for t in templates:
        for v in t["spec"].get("volumes", []):
            if "csi" in v:
                p.csi_drivers.add(v["csi"]["driver"])
            claim = (v.get("persistentVolumeClaim") or {}).get("claimName")
            if claim and claim not in created_claims and claim not in p.claims:
                p.claims.append(claim)
    for pv in by_kind.get("PersistentVolume", []):
        if "csi" in pv["spec"]:
            p.csi_drivers.add(pv["spec"]["csi"]["driver"])
    p.service_account = head_template["spec"].get("serviceAccountName", "")
    p.creates_service_account = any(
        d["metadata"]["name"] == p.service_account for d in by_kind.get("ServiceAccount", [])
    )
    for t in templates:
        for env in t["spec"]["containers"][0].get("env", []):
            ref = (env.get("valueFrom") or {}).get("secretKeyRef")
            if ref and not ref.get("optional"):
                p.secrets.setdefault(ref["name"], (ref["key"], env["name"]))
    auth = spec.get("authOptions") or {}
    if auth.get("mode") == "token":
        p.auth_on = True
        p.auth_secret = auth.get("secretName") or None
        p.creates_auth_secret = any(d["metadata"]["name"] == p.auth_secret for d in by_kind.get("Secret", []))
    named = [("head", head_template), *((w.name, t) for w, t in zip(workers, templates[1:], strict=True))]
    named += [(f"Pod {d['metadata']['name']}", d) for d in by_kind.get("Pod", [])]
    named += [("the RayJob submitter", d["spec"]["submitterPodTemplate"]) for d in by_kind.get("RayJob", [])
              if d["spec"].get("submitterPodTemplate")]  # fmt: skip
    # the sandbox service (sandbox.enabled): a Deployment, whose container is loosened for bubblewrap
    named += [
        (f"Deployment {d['metadata']['name']}", d["spec"]["template"]) for d in by_kind.get("Deployment", [])
    ]
    where: dict[str, list[str]] = {}  # what baseline forbids -> the pods that have it
    for name, t in named:
        for why in _privileged_because(t["spec"]):
            where.setdefault(why, []).append(name)
    p.privileged_because = [f"{why} on {', '.join(names)}" for why, names in where.items()]
    p.pod_security = "privileged" if p.privileged_because else "baseline"
    return p


# What Pod Security `baseline` lets a container add, and the sysctls it lets a pod set (the Kubernetes
# Pod Security Standards, as of Kubernetes 1.33); anything else needs `privileged`.
BASELINE_CAPABILITIES = frozenset({
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE", "SETFCAP",
    "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
})  # fmt: skip
SAFE_SYSCTLS = frozenset({
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
})  # fmt: skip


def _privileged_because(pod: dict) -> list[str]:
    """What in a pod spec the Pod Security `baseline` level forbids (so it needs `privileged`)."""
    why = []
    for v in pod.get("volumes") or []:
        if "hostPath" in v:
            why.append(f"hostPath volume {v['hostPath']['path']}")
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            why.append(key)
    containers = [*pod.get("containers", []), *pod.get("initContainers", [])]
    contexts = [pod.get("securityContext") or {}] + [c.get("securityContext") or {} for c in containers]
    for sc in contexts:
        for profile in ("seccompProfile", "appArmorProfile"):
            if (sc.get(profile) or {}).get("type") == "Unconfined":
                why.append(f"{profile} Unconfined")
        if sc.get("privileged"):
            why.append("a privileged container")
        added = sorted(set((sc.get("capabilities") or {}).get("add") or []) - BASELINE_CAPABILITIES)
        if added:
            why.append(f"added capabilities {', '.join(added)}")
        if sc.get("procMount") not in (None, "Default"):
            why.append(f"procMount {sc['procMount']}")
    for sysctl in (pod.get("securityContext") or {}).get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            why.append(f"sysctl {sysctl.get('name')}")
    for c in containers:
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                why.append(f"hostPort {port['hostPort']}")
    return list(dict.fromkeys(why))


# ----- nodes --------------------------------------------------------------------------------------


def _ready(node: dict) -> bool:
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _tolerates(tolerations: list[dict], taint: dict) -> bool:
    if taint.get("effect") == "PreferNoSchedule":
        return True
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        if t.get("operator") == "Exists" and (not t.get("key") or t["key"] == taint["key"]):
            return True
        if t.get("key") == taint["key"] and t.get("value", "") == taint.get("value", ""):
            return True
    return False


def _eligible(node: dict, need: PodNeed) -> bool:
    labels = node["metadata"].get("labels") or {}
    if not _ready(node) or (node.get("spec") or {}).get("unschedulable"):
        return False
    if any(labels.get(k) != v for k, v in need.selector.items()):
        return False
    if any(labels.get(k) in values for k, values in need.excluded.items()):
        return False
    return all(_tolerates(need.tolerations, t) for t in (node.get("spec") or {}).get("taints") or [])


def _allocatable(node: dict) -> dict[str, float]:
    alloc = (node.get("status") or {}).get("allocatable") or {}
    return {k: parse_quantity(alloc.get(k, 0)) for k in ("cpu", "memory", GPU)}


def _selector_text(need: PodNeed) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(need.selector.items())) or "no node selector"


def _why_no_node(nodes: list[dict], need: PodNeed) -> str:
    """Why no node matches: the nodes of the same accelerator (or machine type) and the labels they lack."""
    for key in ("cloud.google.com/gke-accelerator", "node.kubernetes.io/instance-type"):
        if key not in need.selector:
            continue
        kin = [n for n in nodes if (n["metadata"].get("labels") or {}).get(key) == need.selector[key]]
        if not kin:
            return f"no node has {key}={need.selector[key]}"
        for k, v in sorted(need.selector.items()):
            have = sorted({(n["metadata"].get("labels") or {}).get(k, "<unset>") for n in kin})
            if have != [v]:
                return (
                    f"{len(kin)} node(s) with {key}={need.selector[key]} have {k}={'/'.join(have)}, not {v}"
                )
        for k, values in sorted(need.excluded.items()):
            ruled_out = [n for n in kin if (n["metadata"].get("labels") or {}).get(k) in values]
            if len(ruled_out) == len(kin):
                return (
                    f"the {len(kin)} node(s) with {key}={need.selector[key]} have {k}={'/'.join(sorted(values))}, "
                    "which its node affinity rules out (capacity.type=onDemand: no spot or flex-start nodes)"
                )
        return f"the {len(kin)} node(s) with {key}={need.selector[key]} are not Ready or have taints it does not tolerate"
    return "no Ready node matches it"


def place(nodes: list[dict], needs: list[PodNeed]) -> dict[str, tuple[int, str]]:
    """First fit of every pod on empty nodes: {need: (pods that do not fit, why)}; fitting needs omitted."""
    free = {n["metadata"]["name"]: _allocatable(n) for n in nodes}
    short: dict[str, tuple[int, str]] = {}
    for need in needs:
        eligible = [n for n in nodes if _eligible(n, need)]
        placed = 0
        for _ in range(need.count):
            for n in eligible:
                room = free[n["metadata"]["name"]]
                if all(room[k] >= v for k, v in need.requests.items()):
                    for k, v in need.requests.items():
                        room[k] -= v
                    placed += 1
                    break
            else:
                break
        if placed == need.count:
            continue
        short[need.name] = (need.count - placed, _why_short(nodes, eligible, need))
    return short


def _why_short(nodes: list[dict], eligible: list[dict], need: PodNeed) -> str:
    """Why pods of `need` do not fit: no node matches, or the matching ones are too small (and how)."""
    if not eligible:
        return _why_no_node(nodes, need)
    too_small: dict[str, int] = {}  # "<amount> allocatable" -> nodes
    no_gpus = 0
    for n in eligible:
        alloc = _allocatable(n)
        blocker = next((k for k, v in need.requests.items() if alloc[k] < v), None)
        if blocker is None:
            continue
        if blocker == GPU and alloc[GPU] == 0:
            no_gpus += 1
        what = f"{_show(blocker, alloc[blocker])} allocatable"
        too_small[what] = too_small.get(what, 0) + 1
    parts = [f"{len(eligible)} node(s) match"]
    parts += [f"{c} of them with {what}" for what, c in sorted(too_small.items())]
    if no_gpus:
        parts.append(f"0 {GPU} means the driver or GKE's device plugin is not up there")
    if not too_small:
        parts[0] += ", and the release's other pods fill them"
    return ", ".join(parts)


def _worker_needs(p: Plan) -> tuple[list[PodNeed], list[PodNeed]]:
    """The GPU groups, most GPUs per pod first (a group of whole nodes is placed before a reward model's
    one-GPU pod could take a GPU of its node), then the CPU groups."""
    gpu_needs = sorted((w for w in p.workers if w.gpus > 0 and w.count > 0), key=lambda w: -w.gpus)
    cpu_needs = [w for w in p.workers if w.gpus == 0 and w.count > 0]
    return gpu_needs, cpu_needs


def _gpus_per_node(need: PodNeed) -> int:
    """GPUs of the machine type the group selects (`a4-highgpu-8g`: 8): a node comes whole, however few
    of its GPUs the pod asks for; the pod's own count when the selector names no such machine."""
    m = re.search(r"-(\d+)g$", need.selector.get("node.kubernetes.io/instance-type", ""))
    return max(int(m.group(1)), need.gpus) if m else need.gpus


def check_nodes(kubectl: Kubectl, p: Plan) -> tuple[list[str], list[str]]:
    """(problems, notes): GPU groups and the head fit the nodes; drivers, RDMA installer, Lustre versions."""
    nodes = (_get(kubectl, "nodes") or {}).get("items", [])
    problems: list[str] = []
    notes: list[str] = []
    gpu_needs, cpu_needs = _worker_needs(p)
    short = place(nodes, [p.head, *gpu_needs, *cpu_needs])

    if "head" in short:
        _, why = short["head"]
        asks = ", ".join(_show(k, v) for k, v in p.head.requests.items())
        problems.append(
            f"head: no node fits the head ({asks}; {_selector_text(p.head)}): {why}; create the head pool "
            "(docs/cluster.md step 4) or change head.nodeSelector / head.resources"
        )
    for need in [*gpu_needs, *cpu_needs]:
        if need.name not in short:
            continue
        missing, why = short[need.name]
        asks = ", ".join(_show(k, v) for k, v in need.requests.items())
        line = (
            f"{'GPU nodes' if need.gpus else 'nodes'}: {need.name} needs {need.count} pod(s) of {asks} on nodes with {_selector_text(need)}; "
            f"{missing} do not fit: {why}"
        )
        if need.selector.get("cloud.google.com/gke-spot") == "true":
            # A spot pool usually scales from zero: its nodes appear once the pods ask for them.
            notes.append(f"{line} (a spot pool that autoscales from zero adds them when the pods ask; "
                         "otherwise grow the pool, docs/cluster.md step 4)")  # fmt: skip
        else:
            problems.append(f"{line}: create or grow the node pool (docs/cluster.md step 4)")

    gpu_nodes = {n["metadata"]["name"]: n for w in gpu_needs for n in nodes if _eligible(n, w)}
    problems_, notes_ = _check_drivers(list(gpu_nodes.values()))
    problems += problems_
    notes += notes_

    rdma_nodes = sorted(
        {n["metadata"]["name"] for w in gpu_needs if w.rdma for n in nodes if _eligible(n, w)}
    )
    if rdma_nodes:
        ns, name = RDMA_INSTALLER
        pods = (_get(kubectl, "pods", "-n", ns, "-l", RDMA_INSTALLER_LABEL) or {}).get("items", [])
        ready = {
            pod["spec"].get("nodeName")
            for pod in pods
            if (pod.get("status") or {}).get("phase") == "Running"
            and all(c.get("ready") for c in (pod.get("status") or {}).get("containerStatuses") or [{}])
        }
        lacking = [n for n in rdma_nodes if n not in ready]
        if lacking:
            problems.append(
                f"RDMA: {name} has no Ready pod on {len(lacking)} of the {len(rdma_nodes)} GPU node(s) "
                f"({', '.join(lacking)}), so gIB's NCCL plugin is not installed there: kubectl rollout "
                f"status daemonset/{name} -n {ns}, and check that its node affinity lists their accelerator"
            )

    if "lustre.csi.storage.gke.io" in p.csi_drivers:
        used = {
            n["metadata"]["name"]: n
            for need in [p.head, *gpu_needs, *cpu_needs]
            for n in nodes
            if _eligible(n, need)
        }
        old = []
        for name, n in sorted(used.items()):
            version = ((n.get("status") or {}).get("nodeInfo") or {}).get("kubeletVersion", "")
            gke = parse_gke_version(version)
            if gke is not None and gke < LUSTRE_MIN_GKE:
                old.append(f"{name} ({version})")
        if old:
            want = "1.33.2-gke." + str(LUSTRE_MIN_GKE[3])
            problems.append(
                f"storage: node(s) {', '.join(old)} run GKE older than {want}, which Managed Lustre needs "
                f"for an instance created without --gke-support-enabled (docs/cluster.md step 6): upgrade "
                f"the node pools, or use such an instance with a cluster created with --enable-legacy-lustre-port"
            )
    return problems, notes


def _check_drivers(gpu_nodes: list[dict]) -> tuple[list[str], list[str]]:
    minimum = min_driver()
    old, unknown, channels = [], [], set()
    for n in gpu_nodes:
        labels = n["metadata"].get("labels") or {}
        major = next((labels[k] for k in DRIVER_LABELS if labels.get(k, "").isdigit()), None)
        if major is None:
            unknown.append(n["metadata"]["name"])
            channels.add(labels.get(GKE_DRIVER_LABEL, "<unset>"))
        elif int(major) < minimum:
            old.append(f"{n['metadata']['name']} (R{major})")
    problems = []
    if old:
        problems.append(
            f"driver: GPU node(s) {', '.join(sorted(old))} run an NVIDIA driver older than R{minimum}, which "
            f"the image's CUDA 13 wheels need: recreate the node pool with gpu-driver-version=latest"
        )
    notes = []
    if unknown:
        notes.append(
            f"driver: {len(unknown)} GPU node(s) do not report their NVIDIA driver version "
            f"({GKE_DRIVER_LABEL}={'/'.join(sorted(channels))}); it must be R{minimum} or newer, and the GPU "
            "pods check it at start-up (docs/cluster.md step 4)"
        )
    return problems, notes


# ----- the rest of what a release needs -----------------------------------------------------------


def check_release(kubectl: Kubectl, p: Plan, namespace: str) -> tuple[list[str], list[str]]:
    """(problems, notes): one line per thing the cluster lacks for these rendered objects."""
    problems: list[str] = []
    if p.networks:
        ns, name = RDMA_INSTALLER
        if _get(kubectl, "daemonset", name, "-n", ns) is None:
            problems.append(
                f"RDMA: DaemonSet {ns}/{name} is missing (it installs the gIB NCCL plugin on the GPU "
                f"nodes): kubectl apply -f {RDMA_INSTALLER_URL}"
            )
        crds = ("networks.networking.gke.io", "gkenetworkparamsets.networking.gke.io")
        absent = [c for c in crds if _get(kubectl, "crd", c) is None]
        if absent:
            problems.append(
                f"RDMA: no CRD {', '.join(absent)}: the cluster needs --enable-multi-networking "
                "(and --enable-dataplane-v2), see docs/cluster.md"
            )
        else:
            have = {
                n["metadata"]["name"]
                for n in (_get(kubectl, "networks.networking.gke.io") or {}).get("items", [])
            }
            lacking = [n for n in p.networks if n not in have]
            if lacking:
                problems.append(
                    f"RDMA: Network objects {', '.join(lacking)} are missing: the platform creates them once per "
                    'cluster, make networks HELM_ARGS="--set gvnic.vpc=... " (docs/cluster.md step 2)'
                )
    for driver in sorted(p.csi_drivers):
        if _get(kubectl, "csidriver", driver) is None:
            addon = CSI_ADDONS.get(driver, driver)
            problems.append(
                f"storage: CSI driver {driver} is not enabled: "
                f"gcloud container clusters update CLUSTER --update-addons {addon}=ENABLED"
            )
    for claim in p.claims:
        if _get(kubectl, "pvc", claim, "-n", namespace) is None:
            problems.append(
                f"storage: PersistentVolumeClaim {claim} (storage.lustre.existingClaim) is missing in namespace {namespace}"
            )
    sa = p.service_account
    if sa and not p.creates_service_account and _get(kubectl, "serviceaccount", sa, "-n", namespace) is None:
        problems.append(
            f"identity: ServiceAccount {sa} (serviceAccount.name, create=false) is missing in "
            f"namespace {namespace}: kubectl create serviceaccount {sa} -n {namespace}"
        )
    for secret, (key, env) in p.secrets.items():
        if _get(kubectl, "secret", secret, "-n", namespace) is None:
            problems.append(
                f"secrets: Secret {secret} (for {env}) is missing in namespace {namespace}: "
                f"kubectl create secret generic {secret} -n {namespace} --from-literal={key}=..."
            )
    auth_notes: list[str] = []
    if not p.auth_on:
        auth_notes.append(
            "auth: Ray's token auth is off (auth.mode=disabled): any pod that reaches the head can run code "
            "with this release's service account and Secrets"
        )
    elif (
        p.auth_secret
        and not p.creates_auth_secret
        and _get(kubectl, "secret", p.auth_secret, "-n", namespace) is None
    ):
        problems.append(
            f"auth: Secret {p.auth_secret} (the Ray token, auth.existingSecret) is missing in namespace {namespace}: "
            f'kubectl create secret generic {p.auth_secret} -n {namespace} --from-literal=auth_token="$(openssl rand -hex 32)"'
        )
    psa_problems, psa_notes = check_pod_security(kubectl, p, namespace)
    node_problems, notes = check_nodes(kubectl, p)
    return problems + psa_problems + node_problems, auth_notes + psa_notes + notes


def check_pod_security(kubectl: Kubectl, p: Plan, namespace: str) -> tuple[list[str], list[str]]:
    """(problems, notes): the namespace's Pod Security labels against the level the pods need."""
    ns = _get(kubectl, "namespace", namespace)
    if ns is None:  # `helm install` says so itself; nothing to compare
        return [], []
    labels = (ns.get("metadata") or {}).get("labels") or {}
    need = PSA_LEVELS.index(p.pod_security)
    because = f" ({'; '.join(p.privileged_because)})" if p.privileged_because else ""
    problems, notes = [], []
    for mode in ("enforce", "warn", "audit"):
        level = labels.get(f"{PSA}/{mode}")
        if level not in PSA_LEVELS or PSA_LEVELS.index(level) >= need:
            continue
        if mode == "enforce":
            problems.append(
                f"Pod Security: namespace {namespace} enforces {level}, and this release's pods need "
                f"{p.pod_security}{because}; KubeRay would show the rejection only as events: kubectl label "
                f"namespace {namespace} {PSA}/enforce={p.pod_security} --overwrite, or a namespace that allows it"
            )
        else:
            notes.append(
                f"Pod Security: namespace {namespace} has {mode}={level}: "
                + (
                    "every Ray pod creation will print a warning"
                    if mode == "warn"
                    else "the audit log records every Ray pod"
                )
                + f" (they need {p.pod_security}{because})"
            )
    return problems, notes


# ----- quotas -------------------------------------------------------------------------------------


def _project(context: str) -> str | None:
    """The project of a GKE kube context (`gke_PROJECT_LOCATION_CLUSTER`); None for any other."""
    parts = context.split("_")
    return parts[1] if len(parts) >= 4 and parts[0] == "gke" else None


def _quotas(answer: Result | None) -> dict[str, tuple[float, float]] | None:
    if answer is None or answer.rc != 0:
        return None
    return {
        q["metric"]: (float(q["limit"]), float(q["usage"]))
        for q in json.loads(answer.out or "{}").get("quotas", [])
    }


def check_quotas(
    kubectl: Kubectl, p: Plan, context: str, gcloud: Gcloud = real_gcloud
) -> tuple[list[str], list[str]]:
    """(problems, notes): GPU quota for the GPUs the groups need beyond the matching nodes already up
    (those hold theirs, as :func:`place` shares them out between the groups): each pod that does not fit
    there brings a whole node, all its GPUs counted. Nothing without gcloud; a note when gcloud cannot
    read the quotas."""
    nodes = (_get(kubectl, "nodes") or {}).get("items", [])
    regions = {(n["metadata"].get("labels") or {}).get("topology.kubernetes.io/region") for n in nodes} - {
        None
    }
    gpu_needs, cpu_needs = _worker_needs(p)
    short = place(nodes, [p.head, *gpu_needs, *cpu_needs])
    wants: dict[str, int] = {}  # metric -> GPUs still to come
    for need in gpu_needs:
        accelerator = need.selector.get("cloud.google.com/gke-accelerator")
        if need.name not in short or accelerator not in GPU_QUOTAS:
            continue
        if "cloud.google.com/reservation-name" in need.selector:
            continue  # the reservation took its quota when it was made
        preemptible = any(
            need.selector.get(k) == "true"
            for k in ("cloud.google.com/gke-spot", "cloud.google.com/gke-flex-start")
        )
        metric = ("PREEMPTIBLE_" if preemptible else "") + GPU_QUOTAS[accelerator]
        per_node = _gpus_per_node(need)
        pods, _ = short[need.name]
        new_nodes = -(-pods // (per_node // need.gpus))
        wants[metric] = wants.get(metric, 0) + new_nodes * per_node
    if not wants or len(regions) != 1:
        return [], []
    (region,) = regions
    project = _project(context)
    where = [f"--project={project}"] if project else []
    answer = gcloud("compute", "regions", "describe", region, *where)
    if answer is None:  # no gcloud here: the runbook lists the quotas (step 0)
        return [], []
    regional = _quotas(answer)
    if regional is None:
        return [], [
            f"quota: gcloud could not read the quotas of {region}: check {', '.join(sorted(wants))} yourself (docs/cluster.md step 0)"
        ]
    global_ = _quotas(gcloud("compute", "project-info", "describe", *where)) or {}
    problems = []
    total = sum(wants.values())
    checks = [(m, region, n) for m, n in sorted(wants.items())] + [("GPUS_ALL_REGIONS", "all regions", total)]
    for metric, scope, n in checks:
        quotas = global_ if metric == "GPUS_ALL_REGIONS" else regional
        if metric not in quotas:
            continue
        limit, usage = quotas[metric]
        if limit - usage < n:
            problems.append(
                f"quota: {metric} in {scope} has {limit - usage:g} free (limit {limit:g}, used {usage:g}) and the "
                f"release needs {n} more GPUs than its nodes have: request more (IAM & Admin, Quotas) or free some"
            )
    return problems, []


# ----- what `helm upgrade` does to what is running --------------------------------------------------

# What KubeRay leaves out of the RayCluster spec it hashes (utils.GenerateHashWithoutReplicasAndWorkersToDelete,
# KubeRay 1.6): with upgradeStrategy Recreate, any other change of the spec deletes every pod, head included.
RUNNING_JOB = ("Initializing", "Running", "Waiting", "Retrying")


def kuberay_hashed_spec(spec: dict) -> dict:
    """The part of a RayClusterSpec whose change makes KubeRay recreate the cluster's pods: the spec less
    the worker groups' replicas, min/max and workersToDelete, every template's tolerations and scheduling
    gates (Kueue injects them), and upgradeStrategy."""
    import copy

    out = copy.deepcopy(spec)
    out.pop("upgradeStrategy", None)
    groups = [out.get("headGroupSpec") or {}, *(out.get("workerGroupSpecs") or [])]
    for i, group in enumerate(groups):
        pod = (group.get("template") or {}).get("spec") or {}
        pod.pop("tolerations", None)
        pod.pop("schedulingGates", None)
        if i:
            for key in ("replicas", "minReplicas", "maxReplicas"):
                group.pop(key, None)
            (group.get("scaleStrategy") or {}).pop("workersToDelete", None)
    return out


def spec_changes(live: object, rendered: object, path: str = "spec") -> list[str]:
    """Where ``rendered`` differs from ``live``, as paths. A key only the live object has is a default the
    API server or the operator filled in, not a change; a list is compared whole (an env var removed)."""
    if isinstance(live, dict) and isinstance(rendered, dict):
        out: list[str] = []
        for key, value in rendered.items():
            out += spec_changes(live.get(key), value, f"{path}.{key}")
        return out
    if isinstance(live, list) and isinstance(rendered, list) and len(live) == len(rendered):
        out = []
        for i, (a, b) in enumerate(zip(live, rendered)):
            out += spec_changes(a, b, f"{path}[{i}]")
        return out
    return [] if live == rendered or (live is None and rendered in ({}, [], None)) else [path]


def _shown(paths: list[str]) -> str:
    return ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


def check_upgrade(kubectl: Kubectl, docs: list[dict], namespace: str) -> list[str]:
    """Warnings, one line each, about what this `helm upgrade` does to the release's running objects: a
    RayCluster it recreates (every pod deleted) and a running RayJob it changes only at its next retry."""
    warnings = []
    for d in docs:
        if not isinstance(d, dict) or not isinstance(d.get("metadata"), dict):
            continue
        name, kind = d["metadata"].get("name"), d.get("kind")
        if kind == "RayCluster":
            live = _get(kubectl, "raycluster", name, "-n", namespace)
            if live is None:
                continue
            changed = spec_changes(
                kuberay_hashed_spec(live.get("spec") or {}), kuberay_hashed_spec(d["spec"])
            )
            strategy = ((d["spec"].get("upgradeStrategy") or {}).get("type")) or "None"
            if changed and strategy == "Recreate":
                warnings.append(
                    f"upgrade: RayCluster {name} is recreated by this upgrade: KubeRay deletes every pod, the head "
                    f"included, and a running job dies with it (changed: {_shown(changed)}); stop the job first "
                    "(make stop), then upgrade and submit again: it resumes from its last checkpoint"
                )
            elif changed:
                warnings.append(
                    f"upgrade: RayCluster {name} keeps its pods (upgradeStrategy {strategy}): the change "
                    f"({_shown(changed)}) applies only to pods created later"
                )
        elif kind == "RayJob":
            live = _get(kubectl, "rayjob", name, "-n", namespace)
            status = ((live or {}).get("status") or {}).get("jobDeploymentStatus", "")
            if live is None or status not in RUNNING_JOB:
                continue
            changed = spec_changes(live.get("spec") or {}, d["spec"])
            if changed:
                warnings.append(
                    f"upgrade: RayJob {name} is {status}: KubeRay ignores spec changes of a running RayJob, so this "
                    f"upgrade changes nothing now and takes effect at its next retry, mid-run (changed: "
                    f"{_shown(changed)}). To change it now: kubectl patch rayjob {name} -n {namespace} --type merge "
                    '-p \'{"spec":{"suspend":true}}\', upgrade, then set suspend back to false: the new cluster '
                    "resumes from the last checkpoint (a changed config refuses unless checkpointing.allow_changed_config)"
                )
    return warnings


# ----- command line -------------------------------------------------------------------------------


def run(args: argparse.Namespace, kubectl: Kubectl = real_kubectl, gcloud: Gcloud = real_gcloud) -> int:
    minimum = min_kuberay_version()
    try:
        context = check_context(kubectl)
        problems, notes = check_kuberay(kubectl, minimum)
        if args.upgrade:  # before `helm upgrade --install` (make install): what it does to what runs
            from trainer.tools.submit import kube_namespace, resolve

            release = resolve(args.exp, need_values=True)
            namespace = args.namespace or kube_namespace(None)
            docs = render(release.name, release.values, namespace, args.helm_args, args.helm)
            for line in check_upgrade(kubectl, docs, namespace):
                print(f"warning: {line}")
        if not args.kuberay_only:
            from trainer.tools.submit import kube_namespace, resolve

            release = resolve(args.exp, need_values=True)
            namespace = args.namespace or kube_namespace(None)
            docs = render(release.name, release.values, namespace, args.helm_args, args.helm)
            p = plan(docs)
            notes += [f"{line} (warning)" for line in check_upgrade(kubectl, docs, namespace)]
            more, more_notes = check_release(kubectl, p, namespace)
            problems += more
            notes += more_notes
            more, more_notes = check_quotas(kubectl, p, context, gcloud)
            problems += more
            notes += more_notes
    except NoCluster as e:
        if args.kuberay_only:  # `make install` goes on: helm says the rest
            print(f"kuberl: cannot check the KubeRay version ({e}); it must be {minimum} or newer")
            return 0
        print(f"kuberl: cannot run the preflight checks: {e}", file=sys.stderr)
        return 2
    except RenderError as e:
        print(f"kuberl: {e}", file=sys.stderr)
        return 2
    for line in notes:
        print(f"note: {line}")
    for line in problems:
        print(f"missing: {line}")
    if problems:
        if not args.kuberay_only:  # `make install` stops on the line above alone
            print(f"preflight: {len(problems)} problem(s); fix them before `make install`")
        return 1
    if not args.kuberay_only:
        print("preflight: the cluster has what the release asks for")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m trainer.tools.preflight", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--exp", default="", help="values file or experiment (as for make install)")
    p.add_argument("--namespace", "-n", default="")
    p.add_argument("--kuberay-only", action="store_true", help="only the KubeRay version (make install)")
    p.add_argument("--upgrade", action="store_true",
                   help="also what helm upgrade does to the release's running RayCluster or RayJob (make install)")  # fmt: skip
    p.add_argument("--helm", default=os.environ.get("HELM") or str(REPO / "bin" / "helm"), help="helm binary")
    p.add_argument("helm_args", nargs="*", help="after --: what make install passes to helm (HELM_ARGS)")
    args = p.parse_args(argv)
    from trainer.tools.submit import SubmitError

    try:
        return run(args)
    except SubmitError as e:
        print(f"kuberl: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
