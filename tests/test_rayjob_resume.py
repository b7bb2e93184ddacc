"""The RayJob's retry path, run locally: the entrypoint that `job.enabled` renders is run as KubeRay
would run it (a shell on the head), killed with SIGKILL in the middle of a run (a lost pod: no
SIGTERM, no last save), and run again unchanged, as KubeRay's next attempt would. The retry must
resume from the last complete checkpoint and end at the same final step."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from . import faults
from .conftest import REPO

pytestmark = pytest.mark.slow

STEPS = 4
HALF_SAVED = 3  # the step whose save is in flight when the pod is lost
HELM = REPO / "bin" / "helm"


def _entrypoint(tmp: Path) -> str:
    if not HELM.exists():
        pytest.skip("bin/helm is missing: run `make helm` (make test does it)")
    values = {
        "experiment": "tiny",
        "gpu": {"type": "none"},
        "workerGroups": {"train": {"replicas": 1, "gpus": 0}},
        "storage": {"type": "emptyDir", "mountPath": str(tmp / "data")},
        "secrets": {"hfToken": {"secretName": ""}},
        "job": {
            "enabled": True,
            "overrides": [
                f"grpo.max_num_steps={STEPS}",
                "checkpointing.save_period=1",
                "cluster.cpu_workers_per_node=1",
            ],
        },  # one policy rank: two prove nothing more here
    }
    (tmp / "values.yaml").write_text(yaml.safe_dump(values))
    out = subprocess.run([str(HELM), "template", "tiny", str(REPO / "charts" / "kuberl"), "-f", str(tmp / "values.yaml")],
                         capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    (job,) = [d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "RayJob"]
    return job["spec"]["entrypoint"]


def _shell(entrypoint: str) -> subprocess.Popen:
    """The entrypoint under a shell, with this venv's python first on PATH (the image's, on GKE)."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    return subprocess.Popen(["/bin/sh", "-c", entrypoint], cwd=REPO, env={**os.environ, "PATH": path},
                            start_new_session=True, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip


def test_should_resume_from_the_last_complete_checkpoint_when_the_rayjob_retries_after_a_lost_pod(
    tmp_path,
) -> None:
    entrypoint = _entrypoint(tmp_path)
    assert "checkpointing.resume=auto" in entrypoint and str(tmp_path / "data" / "checkpoints") in entrypoint

    # First attempt: the same command with a fault applied in the driver (tests/faults.py): the save
    # of step HALF_SAVED stops before its commit marker, and then the pod is lost.
    words = shlex.split(entrypoint)
    assert words[:4] == ["exec", "python", "-m", "trainer"], entrypoint
    first = subprocess.Popen(faults.launch(f"hold_before_marker={HALF_SAVED}", words[4:]), cwd=REPO,
                             start_new_session=True, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    lines: list[str] = []
    deadline = time.monotonic() + 240
    try:
        for line in first.stdout:
            lines.append(line)
            if f"holding step {HALF_SAVED} before its commit marker" in line:
                break
            assert time.monotonic() < deadline, "timed out waiting for the first attempt"
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the driver and the Ray processes it started
        first.wait()
    log = "".join(lines)
    saved = [int(s) for s in re.findall(r"saved checkpoint \S*step_(\d+)", log)]
    assert saved == list(range(1, HALF_SAVED)), log[-2000:]

    # The retry: the same entrypoint, unchanged, as KubeRay's next attempt runs it.
    retry = _shell(entrypoint)
    out, _ = retry.communicate(timeout=300)
    assert retry.returncode == 0, out[-3000:]
    resumed = re.search(r"resumed from (\S+) \(step (\d+)", out)
    assert resumed, out[-3000:]
    assert int(resumed[2]) == HALF_SAVED - 1 and resumed[1].endswith(f"step_{HALF_SAVED - 1}")
    assert f"step {STEPS:>4}/{STEPS}" in out
    assert re.findall(r"saved checkpoint \S*step_(\d+)", out)[-1] == str(STEPS)
    assert not re.search(rf"step {HALF_SAVED - 1:>4}/{STEPS} \|", out), "the retry repeated a finished step"
