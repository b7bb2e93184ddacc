"""A driver that loses a worker or its cluster: gone within 60 s, with one line saying what it lost,
and a resubmission resumes from the last committed checkpoint.

Each test runs the real entry point on the tiny model, waits for a committed checkpoint, then takes
something away for real: SIGKILL to a policy rank's or a generation actor's process (found in the Ray
instance's actor table, by the run's job), or ``make down`` under a driver attached to a ``make up`` cluster.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from .conftest import REPO
from .tiny_run import run_in_process

pytestmark = pytest.mark.slow

LOST_WITHIN_S = 60
ONE_RANK = "cluster.cpu_workers_per_node=1"


def _overrides(tmp: Path, *extra: str) -> list[str]:
    return [
        "experiment=tiny",
        "checkpointing.save_period=2",
        f"logger.log_dir={tmp / 'logs'}",
        f"checkpointing.checkpoint_dir={tmp / 'ckpt'}",
        *extra,
    ]


def _start(tmp: Path, *extra: str, env: dict | None = None) -> tuple[subprocess.Popen, Path, Path]:
    out, err = tmp / "stdout.txt", tmp / "stderr.txt"
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer", *_overrides(tmp, "grpo.max_num_steps=500", *extra)],
        cwd=REPO,
        env=env,
        stdout=out.open("w"),
        stderr=err.open("w"),
        start_new_session=True,
    )
    return proc, out, err


def _wait_for(proc: subprocess.Popen, path: Path, pattern: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not re.search(pattern, path.read_text()):
        assert proc.poll() is None, f"the run ended before {pattern!r}:\n{path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {pattern!r} within {timeout}s"
        time.sleep(0.2)


def _job_actors(job: str) -> list[dict]:
    """The actors of Ray job ``job`` (hex id) on the session's instance, as its actor table has them."""
    import ray
    from ray._private import state

    return list(state.actors(job_id=ray.JobID.from_hex(job)).values())


def _actor(driver: int, cls: str, timeout: float = 60) -> tuple[psutil.Process, str]:
    """The live process of an actor of class ``cls`` that the run whose driver has pid ``driver`` created on
    the session's Ray instance (the other xdist worker's runs have actors of that class there too), and
    the run's job id."""
    from ray._private import state

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for job in [j["JobID"] for j in state.jobs() if j["DriverPid"] == driver and not j["IsDead"]]:
            for actor in _job_actors(job):
                if actor["ActorClassName"] == cls and actor["State"] == "ALIVE" and actor["Pid"]:
                    return psutil.Process(actor["Pid"]), job
        time.sleep(0.2)
    raise AssertionError(f"no live {cls} actor of the run (driver pid {driver})")


def _actors_end(job: str, timeout: float = 60) -> None:
    """Every actor of the lost run's job is dead, its process gone, within ``timeout`` of the driver's exit:
    a rank left waiting in a collective with the killed one outlives nothing."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [
            a for a in _job_actors(job) if a["State"] != "DEAD" or (a["Pid"] and psutil.pid_exists(a["Pid"]))
        ]
        if not alive:
            return
        assert time.monotonic() < deadline, (
            f"actors of the lost run still alive: {[a['ActorClassName'] for a in alive]}"
        )
        time.sleep(0.5)


def _ends_with_one_line(proc: subprocess.Popen, err: Path, since: float, what: str) -> str:
    """The driver exits with LOST_EXIT within LOST_WITHIN_S of ``since``, with one line starting ``what``."""
    from trainer.watchdog import LOST_EXIT

    try:
        code = proc.wait(timeout=LOST_WITHIN_S + 30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(
            f"the driver was still running {LOST_WITHIN_S + 30}s after losing {what}"
        ) from None
    took = time.monotonic() - since
    text = err.read_text()
    errors = [line for line in text.splitlines() if line.startswith("kuberl: error:")]
    assert code == LOST_EXIT and "Traceback" not in text and len(errors) == 1, f"exit {code}:\n{text[-3000:]}"
    assert re.match(f"kuberl: error: lost {what}[ :]", errors[0]), errors[0]
    assert took < LOST_WITHIN_S, f"the driver took {took:.0f}s to end"
    return errors[0]


def _resumes(tmp: Path, line: str, *extra: str, env: dict | None = None) -> None:
    """A new run with the same directories and overrides resumes from the checkpoint the line named, and
    trains on."""
    committed = re.search(r"the next run resumes from (\S+?step_(\d+))", line)
    assert committed, line
    path, step = committed.group(1), int(committed.group(2))
    assert (Path(path) / "COMMITTED").is_file()
    # python -m trainer's main in this process (tests.tiny_run.run_in_process): the resumed run's process is
    # not what the test checks.
    run = run_in_process(_overrides(tmp, f"grpo.max_num_steps={step + 1}", *extra), env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"kuberl: resumed from {path} (step {step}," in run.stdout
    assert f"step {step + 1:4d}/{step + 1}" in run.stdout


def _kill_actor_and_resume(env: dict, tmp: Path, cls: str, what: str, *extra: str) -> None:
    proc, out, err = _start(tmp, *extra, env=env)
    try:
        _wait_for(proc, out, r"kuberl: saved checkpoint \S+step_2 ")
        victim, job = _actor(proc.pid, cls)
        victim.kill()
        line = _ends_with_one_line(proc, err, time.monotonic(), what)
        _actors_end(job)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # Resubmitted on one rank whatever the run had (a checkpoint reshards): a second rank proves nothing here.
    _resumes(
        tmp, line, *[e for e in extra if not e.startswith("cluster.cpu_workers_per_node=")], ONE_RANK, env=env
    )


# The killed run and its resubmission attach to the session's Ray instance (``trainer_env``), as runs on a
# cluster do; the test finds the victim through the instance's actor table (``ray_local``).
# Two policy ranks where one is killed (the other is left in a collective with it); one elsewhere.
def test_should_exit_in_one_line_and_resume_when_a_policy_rank_is_killed_mid_step(
    tmp_path, trainer_env, ray_local
):
    _kill_actor_and_resume(
        trainer_env, tmp_path, "PolicyWorker", r"policy rank \d", "cluster.cpu_workers_per_node=2"
    )


def test_should_exit_in_one_line_and_resume_when_a_generation_actor_is_killed_mid_step(
    tmp_path, trainer_env, ray_local
):
    _kill_actor_and_resume(
        trainer_env,
        tmp_path,
        "GenerationWorker",
        "generation worker 0",
        "generation.placement=disaggregated",
        ONE_RANK,
    )


def _make(env: dict, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "--no-print-directory", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=timeout,
    )


def test_should_exit_in_one_line_and_resume_when_the_ray_cluster_is_stopped_under_the_driver(
    tmp_path, trainer_env
):
    from tests.cli import no_cluster_env
    from trainer.ports import free_port

    env = no_cluster_env(tmp_path)
    port = free_port("127.0.0.1")
    up = _make(
        env, "up", f"RAY_PORT={port}", f"RAY_DASHBOARD_PORT={free_port('127.0.0.1')}", "RAY_NUM_CPUS=8"
    )
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        attached = dict(env, RAY_ADDRESS=f"127.0.0.1:{port}", RAY_AUTH_MODE="token")
        proc, out, err = _start(tmp_path, ONE_RANK, env=attached)
        try:
            _wait_for(proc, out, r"kuberl: saved checkpoint \S+step_2 ")
        finally:
            stopped = time.monotonic()
            down = _make(env, "down")
        assert down.returncode == 0, down.stdout + down.stderr
        try:
            line = _ends_with_one_line(proc, err, stopped, "the Ray cluster")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    finally:
        _make(env, "down")
    _resumes(tmp_path, line, ONE_RANK, env=trainer_env)  # resubmitted to another cluster


# A refit that fails or stalls on the receiving side (tests/faults.py patches the driver's generation actor
# class): the run ends in one line naming the engine, within the refit's bound, and leaves nothing behind,
# though policy rank 0 may be blocked in a broadcast that nobody receives (NCCL never times out; gloo after
# 10 minutes). Small buckets, so that the refit has several chunks and the receiver fails after the first.
@pytest.mark.parametrize(
    "fault, says",
    [
        (
            "fail_refit_after_first_chunk",
            "generation engine 0 failed in the weight refit: RuntimeError: fault: the receiver failed after its first chunk",
        ),
        ("hang_refit", ": the weight refit did not finish within generation.refit_timeout_s=10s"),
    ],
    ids=["raises", "hangs"],
)
def test_should_exit_in_one_line_with_nothing_left_when_a_receiver_fails_mid_refit(
    tmp_path, trainer_env, ray_local, fault, says
):
    from .faults import launch

    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    overrides = _overrides(
        tmp_path,
        "grpo.max_num_steps=3",
        "generation.placement=disaggregated",
        ONE_RANK,
        "generation.refit_bucket_mb=0.01",
        "generation.refit_timeout_s=10",
    )
    proc = subprocess.Popen(
        launch(fault, overrides),
        cwd=REPO,
        env=trainer_env,
        stdout=out.open("w"),
        stderr=err.open("w"),
        start_new_session=True,
    )
    try:
        _, job = _actor(proc.pid, "PolicyWorker", timeout=240)
        try:
            code = proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the run was still running 240 s after it started:\n{out.read_text()[-2000:]}"
            ) from None
        text = err.read_text()
        errors = [line for line in text.splitlines() if line.startswith("kuberl: error:")]
        assert code == 3 and "Traceback" not in text and len(errors) == 1, f"exit {code}:\n{text[-3000:]}"
        assert says in errors[0] and "generation engine 0" in errors[0], errors[0]
        assert errors[0].endswith("(step 1); the next run starts from scratch (no complete checkpoint)"), (
            errors[0]
        )
        _actors_end(job)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
