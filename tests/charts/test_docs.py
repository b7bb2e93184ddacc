"""docs/cluster.md says only what the chart and the Makefile do: every values key it names exists in
charts/kuberl/values.yaml, every `make` target it runs exists, and the image tag it builds is the
tag the chart runs."""

from __future__ import annotations

import re
import subprocess

import yaml
from chartlib import CHART, REPO

DOC = (REPO / "docs" / "cluster.md").read_text()
ROOTS = ("image", "storage", "rdma", "job", "head", "capacity", "gpu", "serviceAccount", "secrets", "tests", "tensorboard")


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


def test_should_run_only_make_targets_that_exist_when_the_runbook_calls_make() -> None:
    help_text = subprocess.run(["make", "--no-print-directory", "help"], capture_output=True, text=True, cwd=REPO).stdout
    targets = set(re.findall(r"^\s+(?:\x1b\[36m)?([\w.-]+)", help_text, flags=re.M))
    used = set(re.findall(r"\bmake ([a-z][\w-]*)", DOC))
    assert used and not (used - targets), f"docs/cluster.md runs make targets that do not exist: {sorted(used - targets)}"


def test_should_build_and_push_the_charts_app_version_when_make_image_and_push_run() -> None:
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    for target in ("image", "push"):
        out = subprocess.run(["make", "-n", target, "IMAGE_REPO=reg/kuberl"], capture_output=True, text=True, cwd=REPO)
        assert f'"reg/kuberl:{app_version}"' in out.stdout, out.stdout + out.stderr


def test_should_say_in_one_line_which_variable_to_set_when_make_image_has_no_repository() -> None:
    out = subprocess.run(["make", "--no-print-directory", "image"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode != 0
    assert out.stdout.strip().splitlines()[0].startswith("IMAGE_REPO is not set: make image IMAGE_REPO=")


def test_should_state_the_spot_notice_honestly_when_the_docs_speak_of_preemption() -> None:
    assert "120 s" not in DOC and "about 15 s" in DOC
    assert "about 15 s" in (REPO / "README.md").read_text()
