"""The chart's bash under shellcheck, and its template files kept by concern: `make check-chart` does the
same. The start-up script (files/ray-start.sh.tpl) is a template, so it is checked as rendered for every
values file (mk/render_scripts.py); files/test-ray-status.sh as it is."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess

import pytest
from chartlib import CHART, REPO, helm_binary


def _shellcheck() -> str:
    found = shutil.which("shellcheck")
    if not found:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck); make check-chart needs it too")
    return found


def _render_scripts():
    spec = importlib.util.spec_from_file_location("render_scripts", REPO / "mk" / "render_scripts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.integration  # runs shellcheck
def test_should_pass_shellcheck_when_the_scripts_are_rendered_for_every_values_file(tmp_path) -> None:
    shellcheck = _shellcheck()
    rendered = _render_scripts().render_all(tmp_path, helm_binary())
    kinds = {("gib" if "set_nccl_env.sh" in p.read_text() else "") + ("tb" if "tensorboard" in p.read_text() else "")
             for p in rendered}  # fmt: skip
    assert {"gib", "tb"} <= kinds  # the RDMA worker's and the head's variants are among them
    plain = sorted((CHART / "files").glob("*.sh"))
    assert plain, "charts/kuberl/files has no plain script"
    # SC1091: the script sources the node's gIB file, which exists only on a GPU node
    out = subprocess.run([shellcheck, "--shell=bash", "--exclude=SC1091", *map(str, plain + rendered)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout[-4000:]


def test_should_keep_helpers_short_and_the_scripts_in_files_when_the_chart_is_split_by_concern() -> None:
    templates = CHART / "templates"
    assert len((templates / "_helpers.tpl").read_text().splitlines()) < 300
    for concern in (
        "_pods.tpl",
        "_security.tpl",
        "_scheduling.tpl",
        "_storage.tpl",
        "_auth.tpl",
        "_logger.tpl",
    ):
        assert (templates / concern).is_file(), concern
    every = "".join(p.read_text() for p in templates.rglob("*") if p.is_file())
    assert "ulimit -n" not in every and "ray status --address" not in every  # the scripts live in files/
    assert 'Files.Get "files/ray-start.sh.tpl"' in every and 'Files.Get "files/test-ray-status.sh"' in every
