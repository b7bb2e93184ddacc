"""Preemption: SIGKILL in the middle of a save and SIGTERM between steps, then ``resume=auto``.

The resumed run must end with the same weights and log the same rewards as an uninterrupted run of
the same seed. Every random draw of a step is seeded from (seed, step) and the data order from
(seed, epoch), CPU kernels and gloo reductions are deterministic, so we expect equality to float32
rounding; the tolerance (1e-6) only absorbs summation-order noise, it is far below one Adam step
(lr 1e-2) and so would catch a resume that lost or repeated a step.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from .conftest import REPO

pytestmark = pytest.mark.slow

STEPS = 6


def _cmd(tmp: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "trainer", "experiment=tiny", f"grpo.max_num_steps={STEPS}",
            "checkpointing.save_period=2", f"logger.log_dir={tmp / 'logs'}",
            f"checkpointing.checkpoint_dir={tmp / 'ckpt'}", *extra]


def _run(tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(_cmd(tmp, *extra), cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


def _weights(step_dir: Path) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(step_dir / "policy" / "weights"))
    meta = reader.read_metadata()
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()}
    dcp.load(state, storage_reader=reader)
    return state


def _rewards(tmp: Path) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run_dir,) = list((tmp / "logs" / "tiny").iterdir())  # a resumed run appends to its own run
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return [e.value for e in sorted(acc.Scalars("train/reward_mean"), key=lambda e: e.step)]


def _wait_for(proc: subprocess.Popen, predicate, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, "the run ended before the moment the test waits for"
        assert time.monotonic() < deadline, "timed out waiting for the run"
        time.sleep(0.2)


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6, rtol=0), k


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    _run(tmp)
    return _weights(tmp / "ckpt" / "tiny" / f"step_{STEPS}"), _rewards(tmp)


def test_should_match_an_uninterrupted_run_when_killed_during_a_save_and_resumed(tmp_path, reference):
    ref_weights, ref_rewards = reference
    ckpt = tmp_path / "ckpt" / "tiny"
    env = {**os.environ, "KUBERL_FAULT_SLOW_SAVE_STEP": "4"}
    proc = subprocess.Popen(_cmd(tmp_path), cwd=REPO, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(proc, lambda: any(ckpt.glob(".tmp-step_4-*/policy/weights/.metadata")))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and the Ray processes it started
        proc.wait()
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_")) == ["step_2"]
    resumed = _run(tmp_path)
    assert "resumed from" in resumed.stdout and "step_2" in resumed.stdout
    assert not list(ckpt.glob(".tmp-*")), "the half-written checkpoint was not cleaned up"
    _assert_same(_weights(ckpt / f"step_{STEPS}"), ref_weights)
    assert _rewards(tmp_path) == pytest.approx(ref_rewards, abs=1e-6)


def test_should_checkpoint_and_exit_nonzero_when_sigterm_arrives(tmp_path, reference):
    ref_weights, _ = reference
    proc = subprocess.Popen(_cmd(tmp_path), cwd=REPO, start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step    1/"):
            proc.send_signal(signal.SIGTERM)  # the driver only, as `ray job stop` or the kubelet would
            break
    out = "".join(lines) + proc.stdout.read()
    proc.wait(timeout=300)
    assert proc.returncode == 143, out[-2000:]
    assert "SIGTERM received" in out and "preempted after step" in out
    saved = sorted(p.name for p in (tmp_path / "ckpt" / "tiny").iterdir())
    assert saved and saved[-1].startswith("step_")
    _run(tmp_path)
    _assert_same(_weights(tmp_path / "ckpt" / "tiny" / f"step_{STEPS}"), ref_weights)


def test_should_reshard_when_resumed_on_fewer_ranks(tmp_path, reference, tiny_model_path):
    from transformers import AutoModelForCausalLM

    ref_weights, _ = reference
    _run(tmp_path, "grpo.max_num_steps=2")
    resumed = _run(tmp_path, "cluster.cpu_workers_per_node=1")
    assert "resumed from" in resumed.stdout and "step 2" in resumed.stdout
    again = _run(tmp_path, "cluster.cpu_workers_per_node=1")  # already at max_num_steps: says so, exits 0
    assert f"nothing to do: the checkpoint is at step {STEPS}" in again.stdout
    final = _weights(tmp_path / "ckpt" / "tiny" / f"step_{STEPS}")
    # One rank samples its completions from other random streams than two ranks, so the runs part
    # ways after step 2; but they start from the same trained weights, far from the base model.
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()

    def dist(a, b):
        return sum(float((a[k] - b[k]).norm()) for k in ref_weights)

    assert dist(final, ref_weights) < 0.7 * dist(base, ref_weights)


def test_should_start_fresh_in_a_new_run_dir_without_deleting_when_resume_is_never(tmp_path):
    _run(tmp_path, "grpo.max_num_steps=2")
    again = _run(tmp_path, "grpo.max_num_steps=2", "checkpointing.resume=never")
    assert "starting a fresh run (resume=never" in again.stdout
    assert len(list((tmp_path / "logs" / "tiny").iterdir())) == 2
    assert (tmp_path / "ckpt" / "tiny" / "step_2").is_dir()
