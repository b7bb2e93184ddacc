"""Write the bash scripts the chart's containers run, as rendered, for shellcheck (`make check-chart`).

    python mk/render_scripts.py OUT_DIR      # needs bin/helm and PyYAML

The start-up script (charts/kuberl/files/ray-start.sh.tpl) is a template: what runs is its rendering,
which differs by pod (head, GPU worker, sandbox) and by values (RDMA, TensorBoard). So every values file
is rendered as it is, as a RayJob, and with every optional part on, and each container's script written
to OUT_DIR/<case>-<n>.sh; identical scripts are written once.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "kuberl"
CASES = {
    "": (),
    "job": ("job.enabled=true",),
    "all": ("sandbox.enabled=true", "rdma.enabled=true", "tensorboard.enabled=true", "gpu.type=h200"),
}


def scripts(rendered: str) -> list[str]:
    found = []
    for doc in yaml.safe_load_all(rendered):
        if not doc or doc.get("kind") not in ("RayCluster", "RayJob", "Pod"):
            continue
        if doc["kind"] == "Pod":
            templates = [doc]
        else:
            spec = doc["spec"].get("rayClusterSpec", doc["spec"])
            templates = [spec["headGroupSpec"]["template"], *(g["template"] for g in spec.get("workerGroupSpecs", []))]
        for t in templates:
            container = t["spec"]["containers"][0]
            if container.get("command", [])[:1] in (["/usr/bin/tini"], ["/bin/bash"]) and container.get("args"):
                found.append(container["args"][0])
    return found


def render_all(out: Path, helm: Path = REPO / "bin" / "helm") -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written, seen = [], set()
    for values in sorted((REPO / "values").glob("*.yaml")):
        for case, sets in CASES.items():
            args = [str(helm), "template", values.stem, str(CHART), "-f", str(values), "--namespace", "exp"]
            for s in sets:
                args += ["--set", s]
            rendered = subprocess.run(args, capture_output=True, text=True, check=True).stdout
            for text in scripts(rendered):
                digest = hashlib.sha256(text.encode()).hexdigest()
                if digest in seen:
                    continue
                seen.add(digest)
                path = out / f"{values.stem}{'-' + case if case else ''}-{len(written)}.sh"
                path.write_text(text)
                written.append(path)
    return written


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python mk/render_scripts.py OUT_DIR", file=sys.stderr)
        sys.exit(2)
    for p in render_all(Path(sys.argv[1])):
        print(p)
