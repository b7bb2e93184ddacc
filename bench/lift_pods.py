"""Lift the pod templates out of the rendered RayCluster / RayJob of each values file as plain Pods,
so a Kubernetes scanner that knows no KubeRay CRD (checkov, kube-score) judges what KubeRay will run.

    python bench/lift_pods.py OUT_DIR values/gemma3-1b-math-b200.yaml ...   # needs bin/helm and PyYAML

KUBERL_CHART=DIR lifts from another copy of the chart (an older commit's, to compare).

Each values file is rendered twice, as the RayCluster and as the RayJob (`job.enabled=true`), and each
pod template becomes `OUT_DIR/<kind>/<values>[-job]-<group>.yaml`: a Pod in the release's namespace with
the template's metadata and spec. `<kind>` is the checkov config that judges it
(charts/kuberl/checkov/<kind>.yaml): `ray` (the head and the worker groups) or `submitter` (the RayJob's
submitter). The sandbox service's Deployment (sandbox.enabled), a kind checkov knows, goes as rendered to
`OUT_DIR/sandbox/<values>[-job]-sandbox.yaml`, judged by `sandbox.yaml`. The release's NetworkPolicies
come along into every kind's directory, as checkov asks every pod to have one. `make checkov` runs checkov
over them; bench/README.md has the figures.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
NAMESPACE = "exp"
KINDS = ("ray", "sandbox", "submitter")
MODES = {"": (), "-job": ("--set", "job.enabled=true")}  # name suffix -> helm arguments


def templates(doc: dict) -> list[tuple[str, str, dict]]:
    """(kind, group, pod template) of a RayCluster or RayJob."""
    spec = doc["spec"]
    found = []
    if doc["kind"] == "RayJob":
        if "submitterPodTemplate" in spec:
            found.append(("submitter", "submitter", spec["submitterPodTemplate"]))
        spec = spec["rayClusterSpec"]
    found.append(("ray", "head", spec["headGroupSpec"]["template"]))
    for g in spec.get("workerGroupSpecs", []):
        found.append(("ray", g["groupName"], g["template"]))
    return found


def _write(path: Path, doc: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def lift(values: Path, out: Path) -> list[Path]:
    chart = os.environ.get("KUBERL_CHART", str(REPO / "charts" / "kuberl"))
    written = []
    for suffix, sets in MODES.items():
        release = values.stem
        rendered = subprocess.run([str(REPO / "bin" / "helm"), "template", release, chart, "-f", str(values),
                                   "--namespace", NAMESPACE, *sets],
                                  capture_output=True, text=True, check=True).stdout  # fmt: skip
        name = f"{release}{suffix}"
        for doc in yaml.safe_load_all(rendered):
            if (
                doc and doc.get("kind") == "NetworkPolicy"
            ):  # checkov pairs pods with the policies selecting them
                doc["metadata"].update(name=f"{doc['metadata']['name']}{suffix}", namespace=NAMESPACE)
                for kind in KINDS:
                    written.append(_write(out / kind / f"{name}-{doc['metadata']['name']}-policy.yaml", doc))
            if doc and doc.get("kind") == "Deployment":  # the sandbox service: checkov judges it as it is
                doc["metadata"]["namespace"] = NAMESPACE
                written.append(_write(out / "sandbox" / f"{name}-sandbox.yaml", doc))
            if not doc or doc.get("kind") not in ("RayCluster", "RayJob"):
                continue
            for kind, group, template in templates(doc):
                meta = dict(template.get("metadata") or {})
                meta.update(name=f"{name}-{group}"[:63], namespace=NAMESPACE)
                pod = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template["spec"]}
                written.append(_write(out / kind / f"{name}-{group}.yaml", pod))
    return written


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python bench/lift_pods.py OUT_DIR VALUES.yaml...", file=sys.stderr)
        return 2
    out = Path(argv[0])
    for kind in KINDS:  # every kind has a directory, so a scan of one that holds no pod finds nothing
        (out / kind).mkdir(parents=True, exist_ok=True)
    for values in argv[1:]:
        for path in lift(Path(values), out):
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
