"""``python -m trainer.preflight``: what a GKE cluster lacks for one values file, one line each.

``make preflight EXP=...`` reads the cluster with kubectl and checks what the release will need:

  KubeRay       the ray.io CRDs, and an operator at least as new as the chart's
                ``kuberl.dev/min-kuberay-version`` annotation (1.6: older ones inject wget-based
                probes, and the job image has no wget)
  RDMA          (rdma.enabled) GKE's ``nccl-rdma-installer`` DaemonSet, the multi-networking CRDs,
                and the ``gvnic-1``/``rdma-N`` networks when the chart does not create them
  storage       the CSI driver of storage.type (gcsfuse or Managed Lustre), an existing claim
  identity      the service account when the chart does not create it, the Secrets pods read

``make install`` runs the KubeRay check alone (``--kuberay-only``) before ``helm upgrade --install``.
Without kubectl the checks cannot run: one line says so, and install goes on. The checks take a
``kubectl`` function so that tests can feed them canned output.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "kuberl"
MIN_KUBERAY_KEY = "kuberl.dev/min-kuberay-version"
RDMA_INSTALLER = ("kube-system", "nccl-rdma-installer")  # GKE's DaemonSet: gIB plugin + host libraries
CSI_DRIVERS = {"gcsfuse": "gcsfuse.csi.storage.gke.io", "lustre": "lustre.csi.storage.gke.io"}


@dataclass
class Result:
    """What kubectl answered: exit status, stdout, stderr."""

    rc: int
    out: str = ""
    err: str = ""


Kubectl = Callable[..., Result]


class NoCluster(Exception):
    """kubectl is missing or cannot reach a cluster: the checks cannot run (one line says why)."""


def real_kubectl(*args: str) -> Result:
    if not shutil.which("kubectl"):
        raise NoCluster("kubectl is not installed")
    try:
        p = subprocess.run(["kubectl", *args], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        raise NoCluster(f"kubectl {' '.join(args[:2])} timed out: is the cluster reachable?") from None
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
        raise NoCluster("no kube context: gcloud container clusters get-credentials CLUSTER --location LOCATION")
    return r.out.strip()


# ----- versions -----------------------------------------------------------------------------------


def parse_version(text: str) -> tuple[int, int, int] | None:
    """`v1.6.0`, `1.6.1-rc.0` or an image `quay.io/kuberay/operator:v1.6.0` -> (1, 6, 0)."""
    tag = text.rsplit("@", 1)[0].rsplit(":", 1)[-1] if "/" in text or ":" in text else text
    m = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", tag)
    return (int(m[1]), int(m[2]), int(m[3] or 0)) if m else None


def min_kuberay_version() -> str:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    return chart["annotations"][MIN_KUBERAY_KEY]


def check_kuberay(kubectl: Kubectl, minimum: str) -> tuple[list[str], list[str]]:
    """(problems, notes): the CRDs must exist and the operator's image tag must be >= minimum."""
    install = f"helm install kuberay-operator kuberay/kuberay-operator --version {minimum} (docs/cluster.md)"
    missing = [c for c in ("rayclusters.ray.io", "rayjobs.ray.io") if _get(kubectl, "crd", c) is None]
    if missing:
        return [f"KubeRay is not installed (no CRD {', '.join(missing)}): {install}"], []
    deployments = _get(kubectl, "deployments", "-A", "-l", "app.kubernetes.io/name=kuberay-operator") or {}
    images = [
        c["image"]
        for d in deployments.get("items", [])
        for c in d["spec"]["template"]["spec"]["containers"]
        if "kuberay" in c["image"] or "operator" in c["image"]
    ]
    if not images:
        return [], [
            f"KubeRay operator not found by label app.kubernetes.io/name=kuberay-operator: "
            f"check yourself that it is {minimum} or newer"
        ]
    want = parse_version(minimum)
    problems, notes = [], []
    for image in images:
        have = parse_version(image)
        if have is None:
            notes.append(f"KubeRay operator image {image} has no version tag: check it is {minimum} or newer")
        elif have < want:
            problems.append(
                f"KubeRay operator {image} is older than {minimum} (it injects wget probes the image "
                f"cannot run): helm upgrade kuberay-operator kuberay/kuberay-operator --version {minimum}"
            )
    return problems, notes


# ----- the rest of what a values file needs -------------------------------------------------------


def chart_values(values_file: Path | None) -> dict:
    """The chart's defaults with the values file merged over them (as helm does for maps)."""

    def merge(base: dict, over: dict) -> dict:
        out = dict(base)
        for k, v in over.items():
            out[k] = merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
        return out

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    if values_file:
        values = merge(values, yaml.safe_load(values_file.read_text()) or {})
    return values


def check_values(kubectl: Kubectl, values: dict, namespace: str) -> list[str]:
    """One line per thing the cluster lacks for these values."""
    problems: list[str] = []
    rdma = values["rdma"]
    if rdma["enabled"]:
        ns, name = RDMA_INSTALLER
        if _get(kubectl, "daemonset", name, "-n", ns) is None:
            problems.append(
                f"RDMA: DaemonSet {ns}/{name} is missing (it installs the gIB NCCL plugin on the GPU "
                "nodes): kubectl apply -f https://raw.githubusercontent.com/GoogleCloudPlatform/"
                "container-engine-accelerators/master/gpudirect-rdma/nccl-rdma-installer.yaml"
            )
        crds = ("networks.networking.gke.io", "gkenetworkparamsets.networking.gke.io")
        absent = [c for c in crds if _get(kubectl, "crd", c) is None]
        if absent:
            problems.append(
                f"RDMA: no CRD {', '.join(absent)}: the cluster needs --enable-multi-networking "
                "(and --enable-dataplane-v2), see docs/cluster.md"
            )
        elif not rdma["createNetworks"]:
            have = {n["metadata"]["name"] for n in (_get(kubectl, "networks.networking.gke.io") or {}).get("items", [])}
            want = ["gvnic-1", *(f"rdma-{i}" for i in range(int(rdma["nics"])))]
            lacking = [n for n in want if n not in have]
            if lacking:
                problems.append(
                    f"RDMA: Network objects {', '.join(lacking)} are missing and rdma.createNetworks=false: "
                    "set it to true, or create them (docs/cluster.md)"
                )
    storage = values["storage"]
    driver = CSI_DRIVERS.get(storage["type"])
    if driver and _get(kubectl, "csidriver", driver) is None:
        flag = "GcsFuseCsiDriver" if storage["type"] == "gcsfuse" else "LustreCsiDriver"
        problems.append(
            f"storage: CSI driver {driver} is not enabled (storage.type={storage['type']}): "
            f"gcloud container clusters update CLUSTER --update-addons {flag}=ENABLED"
        )
    claim = storage["lustre"].get("existingClaim") if storage["type"] == "lustre" else ""
    if claim and _get(kubectl, "pvc", claim, "-n", namespace) is None:
        problems.append(
            f"storage: PersistentVolumeClaim {claim} (storage.lustre.existingClaim) is missing in namespace {namespace}"
        )
    sa = values["serviceAccount"]
    if not sa["create"] and sa["name"] and _get(kubectl, "serviceaccount", sa["name"], "-n", namespace) is None:
        problems.append(
            f"identity: ServiceAccount {sa['name']} (serviceAccount.name, create=false) is missing in "
            f"namespace {namespace}: kubectl create serviceaccount {sa['name']} -n {namespace}"
        )
    for key, ref in values["secrets"].items():
        if ref.get("secretName") and _get(kubectl, "secret", ref["secretName"], "-n", namespace) is None:
            problems.append(
                f"secrets: Secret {ref['secretName']} (secrets.{key}) is missing in namespace {namespace}: "
                f"kubectl create secret generic {ref['secretName']} -n {namespace} --from-literal={ref['key']}=..."
            )
    return problems


# ----- command line -------------------------------------------------------------------------------


def run(args: argparse.Namespace, kubectl: Kubectl = real_kubectl) -> int:
    minimum = min_kuberay_version()
    try:
        check_context(kubectl)
        problems, notes = check_kuberay(kubectl, minimum)
        if not args.kuberay_only:
            from trainer.submit import kube_namespace, resolve

            values_file = resolve(args.exp, need_values=True).values if args.exp else None
            namespace = args.namespace or kube_namespace(None)
            problems += check_values(kubectl, chart_values(values_file), namespace)
    except NoCluster as e:
        if args.kuberay_only:  # `make install` goes on: helm says the rest
            print(f"kuberl: cannot check the KubeRay version ({e}); it must be {minimum} or newer")
            return 0
        print(f"kuberl: cannot run the preflight checks: {e}", file=sys.stderr)
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
        print("preflight: the cluster has what the values ask for")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.preflight", description=__doc__.split("\n\n")[0])
    p.add_argument("--exp", default="", help="values file or experiment (as for make install)")
    p.add_argument("--namespace", "-n", default="")
    p.add_argument("--kuberay-only", action="store_true", help="only the KubeRay version (make install)")
    args = p.parse_args(argv)
    from trainer.submit import SubmitError

    try:
        return run(args)
    except SubmitError as e:
        print(f"kuberl: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
