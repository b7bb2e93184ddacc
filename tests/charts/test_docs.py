"""docs/cluster.md says only what the chart and the Makefile do: every values key it names exists in
charts/kuberl/values.yaml, every `make` target it runs exists, and the image tag it builds is the
tag the chart runs."""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml
from chartlib import CHART, REPO

from tests.cli import run_main
from trainer.tools import submit

DOC = (REPO / "docs" / "cluster.md").read_text()
ROOTS = ("image", "storage", "rdma", "job", "head", "capacity", "gpu", "serviceAccount", "secrets", "tests", "tensorboard",
         "auth", "sandbox", "rewardServer", "networkPolicy", "podDisruptionBudget", "podMonitoring")  # fmt: skip
# not "logger": the runbook cites the trainer's logger.* keys too


def _has(values: dict, dotted: str) -> bool:
    node = values
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def test_should_name_only_values_keys_that_exist_when_the_runbook_cites_them() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    # a key: not part of a path or role (`roles/storage.objectUser`) nor a host (`storage.googleapis.com`)
    cited = set(re.findall(rf"(?<![/\w.])((?:{'|'.join(ROOTS)})\.[A-Za-z][\w.]*[A-Za-z])(?!\.com)", DOC))
    cited = {k for k in cited if "googleapis" not in k}
    assert len(cited) > 20
    missing = sorted(k for k in cited if not _has(values, k))
    assert not missing, f"docs/cluster.md cites values keys the chart does not have: {missing}"


@pytest.mark.integration  # runs make
def test_should_run_only_make_targets_that_exist_when_the_runbook_calls_make() -> None:
    help_text = subprocess.run(
        ["make", "--no-print-directory", "help"], capture_output=True, text=True, cwd=REPO
    ).stdout
    targets = set(re.findall(r"^\s+(?:\x1b\[36m)?([\w.-]+)", help_text, flags=re.M))
    used = set(re.findall(r"\bmake ([a-z][\w-]*)", DOC))
    assert used and not (used - targets), (
        f"docs/cluster.md runs make targets that do not exist: {sorted(used - targets)}"
    )


@pytest.mark.integration  # runs make
def test_should_build_and_push_the_charts_app_version_when_make_image_and_push_run() -> None:
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    for target in ("image", "push"):
        out = subprocess.run(
            ["make", "-n", target, "IMAGE_REPO=reg/kuberl"], capture_output=True, text=True, cwd=REPO
        )
        assert f'"reg/kuberl:{app_version}"' in out.stdout, out.stdout + out.stderr


@pytest.mark.integration  # runs make
def test_should_say_in_one_line_which_variable_to_set_when_make_image_has_no_repository() -> None:
    out = subprocess.run(["make", "--no-print-directory", "image"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode != 0
    assert out.stdout.strip().splitlines()[0].startswith("IMAGE_REPO is not set: make image IMAGE_REPO=")


@pytest.mark.integration  # runs make
def test_should_install_the_kuberay_version_the_chart_needs_when_make_kuberay_runs() -> None:
    minimum = yaml.safe_load((CHART / "Chart.yaml").read_text())["annotations"][
        "kuberl.dev/min-kuberay-version"
    ]
    out = subprocess.run(
        ["make", "--no-print-directory", "-n", "kuberay"], capture_output=True, text=True, cwd=REPO
    )
    assert "bin/helm repo add kuberay https://ray-project.github.io/kuberay-helm/" in out.stdout
    assert (
        f"bin/helm upgrade --install kuberay-operator kuberay/kuberay-operator --version {minimum} "
        in out.stdout
    )


@pytest.mark.integration  # runs make
def test_should_apply_the_crds_server_side_before_the_operator_when_make_kuberay_runs() -> None:
    """`helm upgrade` never updates a chart's crds/: old CRDs would prune authOptions and upgradeStrategy."""
    minimum = yaml.safe_load((CHART / "Chart.yaml").read_text())["annotations"][
        "kuberl.dev/min-kuberay-version"
    ]
    lines = subprocess.run(["make", "--no-print-directory", "-n", "kuberay"], capture_output=True, text=True,
                           cwd=REPO).stdout.splitlines()  # fmt: skip
    show = next(
        i
        for i, ln in enumerate(lines)
        if ln.startswith(f"bin/helm show crds kuberay/kuberay-operator --version {minimum} > ")
    )
    crds = lines[show].split("> ", 1)[1].strip()
    apply = lines.index(f"kubectl apply --server-side --force-conflicts -f {crds}")
    upgrade = next(
        i for i, ln in enumerate(lines) if ln.startswith("bin/helm upgrade --install kuberay-operator")
    )
    assert show < apply < upgrade


@pytest.mark.integration  # runs make
def test_should_build_the_same_tag_with_cloud_build_when_there_is_no_docker() -> None:
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    out = subprocess.run(
        ["make", "-n", "cloud-image", "IMAGE_REPO=reg/kuberl"], capture_output=True, text=True, cwd=REPO
    )
    assert "gcloud builds submit . --config docker/cloudbuild.yaml" in out.stdout
    assert f'_IMAGE="reg/kuberl:{app_version}"' in out.stdout
    build = yaml.safe_load((REPO / "docker" / "cloudbuild.yaml").read_text())
    assert build["steps"][0]["args"] == ["build", "-f", "docker/Dockerfile", "-t", "${_IMAGE}", "."]
    assert build["images"] == ["${_IMAGE}"]


def _shell_lines() -> list[str]:
    """Every command line of the runbook's ```sh blocks (continuations joined)."""
    lines = []
    for block in re.findall(r"```sh\n(.*?)```", DOC, flags=re.S):
        lines += [
            ln.strip()
            for ln in block.replace("\\\n", " ").splitlines()
            if ln.strip() and not ln.strip().startswith("#")
        ]
    return lines


def test_should_run_only_helm_that_make_installs_when_the_runbook_calls_helm() -> None:
    bare = [ln for ln in _shell_lines() if re.match(r"^helm\b", ln) or re.search(r"[;&|]\s*helm\b", ln)]
    assert not bare, (
        f"docs/cluster.md runs a helm that nothing installs (use bin/helm after make helm): {bare}"
    )
    assert any(ln.startswith("bin/helm test ") for ln in _shell_lines())


def test_should_start_from_an_empty_project_with_prerequisites_when_the_runbook_opens() -> None:
    prereq = DOC.split("## 0. Prerequisites", 1)[1].split("\n## ", 1)[0]
    for tool in ("gcloud", "kubectl", "gke-gcloud-auth-plugin", "docker", "make cloud-image", "npm", "PyYAML",
                 "make setup", "make helm"):  # fmt: skip
        assert tool in prereq, f"the prerequisites do not mention {tool}"


def test_should_state_the_gke_version_and_driver_the_chart_needs_when_the_runbook_creates_the_cluster() -> (
    None
):
    assert "1.33.2-gke.4655000" in DOC and "R580" in DOC
    lustre = [ln for ln in _shell_lines() if ln.startswith("gcloud lustre instances create")]
    assert lustre and all("--gke-support-enabled" not in ln for ln in lustre)
    assert any("gpu-driver-version=latest" in ln for ln in DOC.splitlines())


def test_should_submit_the_27b_experiment_when_the_runbook_ends_a_run() -> None:
    assert "make submit EXP=gemma3-27b" in DOC
    release = run_main(submit.main, ["resolve", "gemma3-27b"])
    assert release.stdout.split() == ["gemma3-27b-gsm8k-h200", "values/gemma3-27b-gsm8k-h200.yaml"]


def test_should_state_the_spot_notice_honestly_when_the_docs_speak_of_preemption() -> None:
    assert "120 s" not in DOC and "about 15 s" in DOC
    assert "about 15 s" in (REPO / "README.md").read_text()


def test_should_call_the_ray_pods_pod_security_level_baseline_when_the_docs_name_it() -> None:
    """The job image runs as root, so the head and the GPU workers meet Pod Security `baseline`, not
    `restricted` (which requires runAsNonRoot): the docs and values say which, and never the other."""
    paths = [REPO / "docs" / "cluster.md", REPO / "README.md", CHART / "values.yaml"]
    paths += sorted((REPO / "values").glob("*.yaml")) + sorted(
        p for p in (CHART / "templates").iterdir() if p.is_file()
    )
    texts = {p.relative_to(REPO): p.read_text() for p in paths}
    for name, text in texts.items():
        for m in re.finditer(r"restricted", text, flags=re.I):
            assert text[: m.start()].endswith("not `"), (
                f"{name}: {text[max(0, m.start() - 80) : m.end() + 20]!r}"
            )
    assert "Pod Security `baseline` (not `restricted`: the" in DOC
