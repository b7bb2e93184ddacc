"""Exit codes and the permanent-error marker (trainer/__main__.py, trainer/failures.py).

Each error a run can end with has its exit status, and a permanent one (a retry of the same command fails the
same way) says so without "resubmit" and without colour. Under a RayJob, which retries every failed Ray job
whatever its exit code, a permanent error is written to ``PERMANENT_ERROR.json`` in the checkpoint directory;
the next attempt under the same config ends at once with the same line, before a name is checked or Ray
starts; a changed config runs (and removes the marker); a transient error writes nothing; and a run that no
RayJob retries neither writes nor reads it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from ray.exceptions import RayActorError

from tests.cli import REPO, refuse_ray, run_main
from trainer import failures, prestart
from trainer.__main__ import exit_code
from trainer.__main__ import main as trainer_main
from trainer.checkpoint import CheckpointError
from trainer.cluster import ClusterError
from trainer.config import ConfigError
from trainer.generation.placement import GenerationError
from trainer.lease import LeaseError
from trainer.models import ModelNotFoundError
from trainer.preemption import Preempted
from trainer.prestart import SetupError
from trainer.rewards.actors import RewardModelError
from trainer.rewards.runner import RewardFailureError
from trainer.watchdog import Lost

RAYJOB = {failures.JOB_CONFIG_ENV: json.dumps({"metadata": {"kuberl.dev/retried-by": "RayJob"}})}
ANSI = re.compile(r"\x1b\[")

# Ray's error for an actor whose constructor raised, as Ray 2.x words it (colour and all).
INIT_FAILED = (
    "The actor died because of an error raised in its creation task, \x1b[36mray::RewardModelWorker.__init__()"
    "\x1b[39m (pid=17089, ip=192.0.2.2, actor_id=51d5, repr=<RewardModelWorker object at 0x7f5d>)\n"
    '  File "/work/main/trainer/rewards/reward_model.py", line 199, in __init__\n'
    "    AutoModelForSequenceClassification.from_pretrained(\n"
    "RuntimeError: You set `ignore_mismatched_sizes` to `False`, thus raising an error.\n"
)


def _init_failed(text: str = INIT_FAILED) -> RayActorError:
    return RayActorError(actor_id=None, error_msg=text, actor_init_failed=True)


@pytest.mark.parametrize(
    "error, code",
    [
        (ConfigError("reward_model.name=/rm: the directory holds no weights"), 2),
        (SetupError("model=m: its chat template cannot end an assistant turn"), 2),
        (ModelNotFoundError("unknown model 'builtin:nope'"), 2),
        (CheckpointError("checkpointing.resume=/c/step_3: incomplete"), 2),
        (_init_failed(), 2),  # a constructor that raised: a model of the wrong architecture, say
        (LeaseError("checkpointing: /c is held by a run of tiny"), 3),
        (ClusterError("policy: the Ray cluster has not offered {'GPU': 8} within 600s"), 3),
        (GenerationError("generation engine 0 did not start within 600s"), 3),
        (RewardModelError("1 of 2 reward model replicas did not load m within 600s"), 3),
        (RewardFailureError("9 of 16 samples lost their reward this step"), 3),
        # a check that reads a server fails the same way when it does not answer: a retry may pass
        (
            SetupError(
                "data.name=gsm8k split=train: Couldn't reach 'openai/gsm8k' on the Hub (ConnectionError)"
            ),
            3,
        ),
        (
            ConfigError(
                "reward_model.name=org/rm: cannot read its config: 503 Server Error: Service Unavailable"
            ),
            3,
        ),
        (
            _init_failed(
                INIT_FAILED.replace("RuntimeError: You set", "requests.exceptions.ConnectionError: (")
            ),
            3,
        ),
        (Lost("lost policy rank 1 (its process is gone) in step 3; resubmit"), 4),
        (Preempted(3, 2), 143),
        (KeyboardInterrupt(), 130),
        (RayActorError(actor_id=None, error_msg="the actor's node died", actor_init_failed=False), None),
        (ValueError("a bug"), None),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_should_give_each_error_its_exit_code_when_a_run_ends_with_it(error, code) -> None:
    assert exit_code(error) == code


def test_should_make_an_actors_constructor_error_one_plain_line_naming_the_actor_and_the_cause() -> None:
    assert failures.actor_init_failure(_init_failed()) == (
        "RewardModelWorker could not start: RuntimeError: You set `ignore_mismatched_sizes` to `False`, thus "
        "raising an error."
    )
    assert failures.actor_init_failure(ValueError("x")) is None
    assert failures.plain("\x1b[36mray::W.__init__()\x1b[39m ok \x1b[0m") == "ray::W.__init__() ok "


def test_should_read_a_rayjob_only_from_the_ray_job_metadata_the_chart_sets() -> None:
    assert failures.retried_by_rayjob(RAYJOB)
    assert not failures.retried_by_rayjob({})
    assert not failures.retried_by_rayjob(
        {failures.JOB_CONFIG_ENV: json.dumps({"metadata": {"job_submission_id": "x"}})}
    )
    assert not failures.retried_by_rayjob({failures.JOB_CONFIG_ENV: "not json"})


# ----- through python -m trainer's main -------------------------------------------------------------------


def _argv(tmp_path: Path, *extra: str) -> list[str]:
    return ["experiment=tiny", f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
            f"logger.log_dir={tmp_path / 'logs'}", *extra]  # fmt: skip


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != failures.JOB_CONFIG_ENV}
    return {**env, **extra}


def _ending_with(monkeypatch, error: BaseException) -> None:
    """The run's train() raises ``error`` (each class is raised for real by the tests of its own module)."""
    import trainer.run

    def train(cfg):
        raise error

    refuse_ray(monkeypatch)
    monkeypatch.setattr(trainer.run, "train", train)


def _errors(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("kuberl: error:")]


@pytest.mark.parametrize(
    "error, code",
    [(SetupError("model=m: no chat template"), 2), (_init_failed(), 2), (ClusterError("no GPUs in time"), 3),
     (Lost("lost policy rank 1 in step 3; resubmit to continue"), 4), (Preempted(3, 2), 143)],
    ids=["setup", "actor_init", "cluster", "lost", "preempted"],
)  # fmt: skip
def test_should_end_in_one_plain_line_with_the_code_and_no_resubmit_for_a_permanent_error(
    error, code, tmp_path, monkeypatch
) -> None:
    _ending_with(monkeypatch, error)
    proc = run_main(trainer_main, _argv(tmp_path), _env())
    (line,) = _errors(proc)
    assert proc.returncode == code and "Traceback" not in proc.stderr and not ANSI.search(proc.stderr), (
        proc.stderr
    )
    assert ("resubmit" in line) == (code == 4)
    assert not (
        tmp_path / "ckpt" / "tiny" / failures.MARKER
    ).exists()  # no RayJob retries this run: no marker


def test_should_stop_the_next_attempt_at_start_when_a_rayjob_attempt_ended_in_a_permanent_error(
    tmp_path, monkeypatch
) -> None:
    _ending_with(monkeypatch, SetupError("model=m: its chat template cannot end an assistant turn"))
    first = run_main(trainer_main, _argv(tmp_path), _env(**RAYJOB))
    marker = tmp_path / "ckpt" / "tiny" / failures.MARKER
    (line,) = _errors(first)
    assert first.returncode == 2 and line.startswith(
        "kuberl: error: model=m: its chat template cannot end an assistant turn [permanent: a retry fails the same "
        "way; the RayJob's further attempts stop at start"
    ), first.stderr
    assert str(marker) in line and "resubmit" not in line
    assert json.loads(marker.read_text())["line"] == "model=m: its chat template cannot end an assistant turn"

    def checked(cfg) -> None:
        raise AssertionError("the attempt checked names; it should have stopped before")

    check_names = prestart.check_names
    monkeypatch.setattr(prestart, "check_names", checked)  # and refuse_ray: nothing past the config starts
    again = run_main(trainer_main, _argv(tmp_path), _env(**RAYJOB))
    (line,) = _errors(again)
    assert again.returncode == 2 and again.stdout == "", again.stdout + again.stderr
    assert line.startswith("kuberl: error: model=m: its chat template cannot end an assistant turn [permanent, "
                           "found by an earlier attempt at ")  # fmt: skip
    assert line.endswith(f"not retried: fix the cause and resubmit (a changed config or image runs again), or "
                         f"remove {marker} to run this config again]")  # fmt: skip
    monkeypatch.setattr(prestart, "check_names", check_names)
    # --cfg still prints the config; a run no RayJob retries does not read the marker (it runs, into its error)
    assert run_main(trainer_main, [*_argv(tmp_path), "--cfg"], _env(**RAYJOB)).returncode == 0
    by_hand = run_main(trainer_main, _argv(tmp_path), _env())
    assert _errors(by_hand) == ["kuberl: error: model=m: its chat template cannot end an assistant turn"]


def test_should_run_and_remove_the_marker_when_the_config_or_the_image_changed(tmp_path, monkeypatch) -> None:
    _ending_with(monkeypatch, SetupError("model=m: no chat template"))
    assert run_main(trainer_main, _argv(tmp_path), _env(**RAYJOB)).returncode == 2
    marker = tmp_path / "ckpt" / "tiny" / failures.MARKER
    assert marker.is_file()
    _ending_with(monkeypatch, ClusterError("no GPUs in time"))  # this attempt gets as far as train()
    image = run_main(trainer_main, _argv(tmp_path), _env(**RAYJOB, KUBERL_IMAGE="registry/kuberl:fixed"))
    assert image.returncode == 3 and not marker.exists(), image.stderr
    assert f"kuberl: removed {marker}: a permanent error under another config or image" in image.stdout
    _ending_with(monkeypatch, SetupError("model=m: no chat template"))
    assert run_main(trainer_main, _argv(tmp_path), _env(**RAYJOB)).returncode == 2 and marker.is_file()
    _ending_with(monkeypatch, ClusterError("no GPUs in time"))
    changed = run_main(trainer_main, _argv(tmp_path, "grpo.max_num_steps=3"), _env(**RAYJOB))
    assert changed.returncode == 3 and not marker.exists(), changed.stderr


@pytest.mark.parametrize(
    "error", [ClusterError("no GPUs in time"), Lost("lost the Ray cluster"), Preempted(3, 2),
              SetupError("data.name=gsm8k split=train: Couldn't reach 'openai/gsm8k' on the Hub (ConnectionError)")],
    ids=["cluster", "lost", "preempted", "hub_unreachable"],
)  # fmt: skip
def test_should_write_no_marker_when_a_rayjob_attempt_ends_in_an_error_a_retry_may_fix(
    error, tmp_path, monkeypatch
) -> None:
    _ending_with(monkeypatch, error)
    proc = run_main(trainer_main, _argv(tmp_path), _env(**RAYJOB))
    assert proc.returncode in (3, 4, 143) and "permanent" not in proc.stderr, proc.stderr
    assert not (tmp_path / "ckpt" / "tiny" / failures.MARKER).exists()


def test_should_write_no_marker_when_checkpointing_is_off(tmp_path, monkeypatch) -> None:
    _ending_with(monkeypatch, SetupError("model=m: no chat template"))
    proc = run_main(trainer_main, _argv(tmp_path, "checkpointing.enabled=false"), _env(**RAYJOB))
    assert proc.returncode == 2 and _errors(proc) == ["kuberl: error: model=m: no chat template"], proc.stderr
    assert not (tmp_path / "ckpt").exists()


# ----- real processes ------------------------------------------------------------------------------------


@pytest.mark.integration  # starts python -m trainer twice
def test_should_end_a_second_rayjob_attempt_in_seconds_when_the_first_found_a_permanent_error(
    tmp_path,
) -> None:
    """A real permanent error (a SetupError the run raises before Ray: a log directory under a file), in a real
    `python -m trainer` as a RayJob's Ray job runs it; then the same command again, as KubeRay's retry."""
    (tmp_path / "file").write_text("")
    argv = [sys.executable, "-m", "trainer", *_argv(tmp_path, f"logger.log_dir={tmp_path / 'file' / 'logs'}")]

    def attempt() -> subprocess.CompletedProcess:
        return subprocess.run(argv, cwd=REPO, env=_env(**RAYJOB), capture_output=True, text=True, timeout=300)

    first = attempt()
    (line,) = _errors(first)
    assert first.returncode == 2 and "Traceback" not in first.stderr, (
        first.stdout[-2000:] + first.stderr[-2000:]
    )
    assert (
        line.startswith(f"kuberl: error: logger.log_dir={tmp_path / 'file' / 'logs'}")
        and "[permanent: " in line
    )
    second = attempt()
    (again,) = _errors(second)
    assert second.returncode == 2 and "found by an earlier attempt" in again, second.stderr
    assert again.split(" [permanent")[0] == line.split(" [permanent")[0]
    assert "kuberl: precision" not in first.stdout + second.stdout  # neither got as far as starting Ray


@pytest.mark.integration  # builds and loads a reward model on Ray actors
def test_should_end_in_one_plain_permanent_line_when_the_reward_model_cannot_load_its_weights(
    tmp_path, trainer_env
) -> None:
    """Issue 62's reproduction, the case check() cannot see: weights whole on disk but of another shape than
    the config (a model of the wrong architecture). Its replicas' constructors raise; the run ended in Ray's
    raw ActorDiedError traceback, in colour."""
    import shutil

    from tests.rewards import tiny_rm

    built = tiny_rm.build_arithmetic_rm(str(tmp_path / "rm"), steps=1)
    wrong = tmp_path / "wrong"
    shutil.copytree(built, wrong)
    config = json.loads((wrong / "config.json").read_text())
    config["intermediate_size"] *= 2  # the weights are of the original shape
    (wrong / "config.json").write_text(json.dumps(config))
    argv = _argv(
        tmp_path, "env.reward_functions=[{name: reward_model, weight: 1.0}]", f"reward_model.name={wrong}"
    )
    proc = subprocess.run([sys.executable, "-m", "trainer", *argv], cwd=REPO, env={**trainer_env, **RAYJOB},
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    (line,) = _errors(proc)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert line.startswith(
        "kuberl: error: RewardModelWorker could not start: RuntimeError: "
    ) and not ANSI.search(line)
    assert (tmp_path / "ckpt" / "tiny" / failures.MARKER).is_file()
