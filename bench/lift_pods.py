"""Lift the pod templates out of the rendered RayCluster / RayJob of each values file as plain Pods,
so a Kubernetes scanner that knows no KubeRay CRD (checkov, kube-score) judges what KubeRay will run.

    python bench/lift_pods.py OUT_DIR values/gemma3-1b-math-b200.yaml ...   # needs bin/helm and PyYAML

KUBERL_CHART=DIR lifts from another copy of the chart (an older commit's, to compare).

Each template becomes `OUT_DIR/<values>-<group>.yaml`: a Pod in the release's namespace with the
template's metadata (its checkov skip annotations included) and spec; the release's NetworkPolicies
come along, as checkov asks every pod to have one. How the chart's checkov figures
were made is in bench/README.md.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
NAMESPACE = "exp"


def templates(doc: dict) -> list[tuple[str, dict]]:
    spec = doc["spec"]
    if doc["kind"] == "RayJob":
        found = [("submitter", spec["submitterPodTemplate"])] if "submitterPodTemplate" in spec else []
        spec = spec["rayClusterSpec"]
    else:
        found = []
    found.append(("head", spec["headGroupSpec"]["template"]))
    found += [(g["groupName"], g["template"]) for g in spec.get("workerGroupSpecs", [])]
    return found


def lift(values: Path, out: Path) -> list[Path]:
    release = values.stem
    rendered = subprocess.run([str(REPO / "bin" / "helm"), "template", release, os.environ.get("KUBERL_CHART", str(REPO / "charts" / "kuberl")),
                               "-f", str(values), "--namespace", NAMESPACE],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
    written = []
    for doc in yaml.safe_load_all(rendered):
        if doc and doc.get("kind") == "NetworkPolicy":  # checkov pairs pods with the policies selecting them
            path = out / f"{release}-{doc['metadata']['name']}-policy.yaml"
            doc["metadata"]["namespace"] = NAMESPACE
            path.write_text(yaml.safe_dump(doc, sort_keys=False))
            written.append(path)
        if not doc or doc.get("kind") not in ("RayCluster", "RayJob"):
            continue
        for group, template in templates(doc):
            meta = dict(template.get("metadata") or {})
            meta.update(name=f"{release}-{group}"[:63], namespace=NAMESPACE)
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template["spec"]}
            path = out / f"{release}-{group}.yaml"
            path.write_text(yaml.safe_dump(pod, sort_keys=False))
            written.append(path)
    return written


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python bench/lift_pods.py OUT_DIR VALUES.yaml...", file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    for values in argv[1:]:
        for path in lift(Path(values), out):
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
