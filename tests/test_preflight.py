"""`make preflight` and the KubeRay check of `make install`, on canned kubectl output (there is no
Kubernetes API here): the check logic as units, and the command line with a stand-in kubectl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer import preflight
from trainer.preflight import Result

REPO = Path(__file__).resolve().parents[1]


def _operator(image: str) -> dict:
    return {"items": [{"spec": {"template": {"spec": {"containers": [{"name": "kuberay-operator", "image": image}]}}}}]}


NOT_FOUND = Result(1, "", 'Error from server (NotFound): x "y" not found')


class FakeCluster:
    """Answers `kubectl get KIND NAME ... -o json` from a dict {(kind, name): object}."""

    def __init__(self, objects: dict[tuple[str, str], dict]):
        self.objects = objects
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, *args: str) -> Result:
        self.calls.append(args)
        if args[:2] == ("config", "current-context"):
            return Result(0, "gke_proj_us-central1_kuberl\n")
        assert args[0] == "get" and args[-2:] == ("-o", "json"), args
        kind = args[1]
        name = args[2] if len(args) > 2 and not args[2].startswith("-") else ""
        obj = self.objects.get((kind, name))
        return Result(0, json.dumps(obj)) if obj is not None else NOT_FOUND


# Everything the 27B H200 values file (RDMA, Lustre, hf-token) needs, as a healthy cluster answers.
HEALTHY = {
    ("crd", "rayclusters.ray.io"): {},
    ("crd", "rayjobs.ray.io"): {},
    ("deployments", ""): _operator("quay.io/kuberay/operator:v1.6.0"),
    ("daemonset", "nccl-rdma-installer"): {},
    ("crd", "networks.networking.gke.io"): {},
    ("crd", "gkenetworkparamsets.networking.gke.io"): {},
    ("csidriver", "lustre.csi.storage.gke.io"): {},
    ("csidriver", "gcsfuse.csi.storage.gke.io"): {},
    ("secret", "hf-token"): {},
}


def _values(name: str) -> dict:
    return preflight.chart_values(REPO / "values" / name)


# ----- KubeRay ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "version"),
    [("v1.6.0", (1, 6, 0)), ("1.6.1-rc.0", (1, 6, 1)), ("quay.io/kuberay/operator:v1.5.1", (1, 5, 1)),
     ("registry:5000/kuberay/operator:v1.7", (1, 7, 0)), ("quay.io/kuberay/operator@sha256:ab", None)],
)  # fmt: skip
def test_should_read_the_version_from_a_tag_or_an_image_when_parsing(text, version) -> None:
    assert preflight.parse_version(text) == version


def test_should_pass_when_the_crds_exist_and_the_operator_is_new_enough() -> None:
    assert preflight.check_kuberay(FakeCluster(HEALTHY), "1.6.0") == ([], [])


def test_should_say_how_to_install_kuberay_when_its_crds_are_missing() -> None:
    problems, _ = preflight.check_kuberay(FakeCluster({}), "1.6.0")
    assert len(problems) == 1
    assert "KubeRay is not installed (no CRD rayclusters.ray.io, rayjobs.ray.io)" in problems[0]
    assert "--version 1.6.0" in problems[0]


def test_should_name_the_old_operator_when_kuberay_is_older_than_the_minimum() -> None:
    cluster = FakeCluster({**HEALTHY, ("deployments", ""): _operator("quay.io/kuberay/operator:v1.5.1")})
    problems, _ = preflight.check_kuberay(cluster, "1.6.0")
    assert len(problems) == 1 and "quay.io/kuberay/operator:v1.5.1 is older than 1.6.0" in problems[0]


def test_should_note_rather_than_fail_when_the_operator_version_cannot_be_read() -> None:
    for deployments in ({"items": []}, _operator("quay.io/kuberay/operator@sha256:abc")):
        problems, notes = preflight.check_kuberay(FakeCluster({**HEALTHY, ("deployments", ""): deployments}), "1.6.0")
        assert problems == [] and len(notes) == 1 and "1.6.0 or newer" in notes[0]


def test_should_take_the_minimum_kuberay_version_from_the_chart_when_checking() -> None:
    assert preflight.min_kuberay_version() == "1.6.0"


# ----- what a values file needs -------------------------------------------------------------------


def test_should_find_nothing_missing_when_the_cluster_has_what_the_values_ask_for() -> None:
    assert preflight.check_values(FakeCluster(HEALTHY), _values("gemma3-27b-gsm8k-h200.yaml"), "team") == []


def test_should_print_one_line_per_missing_thing_when_the_cluster_is_bare() -> None:
    problems = preflight.check_values(FakeCluster({}), _values("gemma3-27b-gsm8k-h200.yaml"), "team")
    assert [p.split(":")[0] for p in problems] == ["RDMA", "RDMA", "storage", "secrets"]
    assert "DaemonSet kube-system/nccl-rdma-installer is missing" in problems[0]
    assert "nccl-rdma-installer.yaml" in problems[0]
    assert "--enable-multi-networking" in problems[1]
    assert "lustre.csi.storage.gke.io" in problems[2] and "LustreCsiDriver=ENABLED" in problems[2]
    assert "kubectl create secret generic hf-token -n team" in problems[3]
    assert all("\n" not in p for p in problems)


def test_should_check_the_gcsfuse_driver_and_skip_rdma_when_the_values_use_neither_rdma_nor_lustre() -> None:
    cluster = FakeCluster({("secret", "hf-token"): {}})
    problems = preflight.check_values(cluster, _values("gemma3-1b-math-b200.yaml"), "team")
    assert len(problems) == 1 and "gcsfuse.csi.storage.gke.io" in problems[0]
    assert not [c for c in cluster.calls if "nccl-rdma-installer" in c or "lustre.csi.storage.gke.io" in c]


def test_should_list_the_absent_networks_when_the_chart_does_not_create_them() -> None:
    values = _values("gemma3-27b-gsm8k-h200.yaml")
    values["rdma"]["createNetworks"] = False
    networks = {"items": [{"metadata": {"name": n}} for n in ("gvnic-1", "rdma-0", "rdma-1")]}
    cluster = FakeCluster({**HEALTHY, ("networks.networking.gke.io", ""): networks})
    (problem,) = preflight.check_values(cluster, values, "team")
    assert "rdma-2, rdma-3, rdma-4, rdma-5, rdma-6, rdma-7 are missing" in problem


# ----- command line -------------------------------------------------------------------------------

FAKE_KUBECTL = """#!/bin/bash
case "$*" in
  "config current-context") echo test-ctx ;;
  "config view --minify -o jsonpath={..namespace}") echo team ;;
  "get crd rayclusters.ray.io -o json"|"get crd rayjobs.ray.io -o json") echo '{}' ;;
  "get deployments -A -l app.kubernetes.io/name=kuberay-operator -o json") cat "$(dirname "$0")/operator.json" ;;
  "get "*) echo 'Error from server (NotFound): x "y" not found' >&2; exit 1 ;;
  *) echo "unexpected kubectl $*" >&2; exit 3 ;;
esac
"""


def _env_with_kubectl(tmp_path: Path, image: str | None) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if image:
        (bin_dir / "kubectl").write_text(FAKE_KUBECTL)
        (bin_dir / "kubectl").chmod(0o755)
        (bin_dir / "operator.json").write_text(json.dumps(_operator(image)))
    env = {k: v for k, v in os.environ.items() if k not in ("EXP", "NAMESPACE")}
    path = os.environ["PATH"] if image else ""  # no kubectl anywhere when image is None
    env["PATH"] = f"{bin_dir}{os.pathsep}{path}" if path else str(bin_dir)
    return env


def _preflight(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer.preflight", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=60)  # fmt: skip


def test_should_say_it_cannot_check_and_go_on_when_kubectl_is_absent_at_install(tmp_path) -> None:
    out = _preflight(_env_with_kubectl(tmp_path, None), "--kuberay-only")
    assert out.returncode == 0 and "Traceback" not in out.stderr
    assert out.stdout.strip() == (
        "kuberl: cannot check the KubeRay version (kubectl is not installed); it must be 1.6.0 or newer"
    )


def test_should_fail_in_one_line_when_kubectl_is_absent_at_preflight(tmp_path) -> None:
    out = _preflight(_env_with_kubectl(tmp_path, None), "--exp", "gemma3-1b-math")
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "kuberl: cannot run the preflight checks: kubectl is not installed"
    ]


def test_should_print_each_missing_thing_and_exit_1_when_the_cluster_lacks_them(tmp_path) -> None:
    out = _preflight(_env_with_kubectl(tmp_path, "quay.io/kuberay/operator:v1.6.0"), "--exp", "gemma3-27b")
    assert out.returncode == 1, out.stderr
    lines = out.stdout.strip().splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["missing"] * 4 + ["preflight"]
    assert "namespace team" in out.stdout  # the kube context's namespace


def test_should_stop_make_install_before_helm_when_kuberay_is_too_old(tmp_path) -> None:
    env = _env_with_kubectl(tmp_path, "quay.io/kuberay/operator:v1.5.1")
    out = subprocess.run(["make", "--no-print-directory", "install", "EXP=gemma3-1b-math"], capture_output=True,
                         text=True, env=env, cwd=REPO, timeout=300)  # fmt: skip
    assert out.returncode != 0
    assert out.stdout.strip().startswith("missing: KubeRay operator quay.io/kuberay/operator:v1.5.1 is older than 1.6.0")
    assert len(out.stdout.strip().splitlines()) == 1, out.stdout
    assert "Release" not in out.stdout + out.stderr  # helm never ran
