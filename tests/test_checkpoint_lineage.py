"""One run per checkpoint lineage (trainer/lease.py) and resumes that know what changed
(trainer.checkpoint.config_changes).

Two runs on one checkpoint directory used to delete each other's work: the second removed the first's
save in flight as "incomplete", resumed from its checkpoints and pruned them. Here two real runs share a
directory (the second refuses in one line and touches nothing), two processes race for a free directory
(exactly one holds it), and each way a lease is taken over, or not, is checked on the lease file itself.
A resume under a changed learning rate refuses in one line naming the key.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trainer import lease as lease_mod
from trainer.checkpoint import MAY_CHANGE, Checkpointer, config_changes, config_hash, write_atomic
from trainer.config import CheckpointConfig, Config, to_dict
from trainer.lease import Lease, LeaseError

from .conftest import REPO
from .tiny_run import run_in_process


@pytest.fixture(autouse=True)
def quick_settle(monkeypatch):
    monkeypatch.setattr(lease_mod, "SETTLE_S", 0.05)


def _lease(root: Path, **kw) -> Lease:
    return Lease(root, "exp", kw.pop("stale_after_s", 600.0), **kw)


def _foreign(root: Path, **fields) -> dict:
    """A lease file as another run on another host would have written it."""
    lease = {
        "owner": "alice@other-host",
        "run_id": "f" * 32,
        "experiment": "exp",
        "host": "other-host",
        "pid": 4242,
        "started_at": time.time() - 60,
        "heartbeat_at": time.time() - 5,
        **fields,
    }
    root.mkdir(parents=True, exist_ok=True)
    write_atomic(root / lease_mod.NAME, json.dumps(lease))
    return lease


# ----- the lease --------------------------------------------------------------------------------------


def test_should_refuse_in_one_line_naming_the_holder_when_another_live_run_holds_the_directory(tmp_path):
    _foreign(tmp_path)
    with pytest.raises(LeaseError) as e:
        _lease(tmp_path).acquire()
    msg = str(e.value)
    assert "\n" not in msg
    assert "held by a run of exp by alice@other-host (pid 4242 on other-host" in msg
    assert "checkpointing.checkpoint_dir" in msg and "checkpointing.take_over=true" in msg
    assert json.loads((tmp_path / lease_mod.NAME).read_text())["run_id"] == "f" * 32  # untouched


@pytest.mark.integration  # a Python interpreter of its own
def test_should_take_over_with_a_line_when_the_holder_is_stale_dead_or_an_earlier_attempt(
    tmp_path, monkeypatch
):
    cases = []
    _foreign(tmp_path / "stale", heartbeat_at=time.time() - 900)
    cases.append(("stale", {}, "no heartbeat for 15 min (checkpointing.lease_stale_after_s=600)"))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _foreign(tmp_path / "dead", host=socket.gethostname(), pid=dead.pid)
    cases.append(("dead", {}, f"its process (pid {dead.pid} on {socket.gethostname()}) is gone"))
    _foreign(tmp_path / "forced")
    cases.append(("forced", {"take_over": True}, "checkpointing.take_over=true"))
    for name, kw, why in cases:
        lease = _lease(tmp_path / name, **kw)
        line = lease.acquire()
        try:
            assert line is not None and line.endswith(why), line
            assert json.loads((tmp_path / name / lease_mod.NAME).read_text())["run_id"] == lease.me["run_id"]
        finally:
            lease.release()
    # A RayJob's retry: the same release, on the new head pod.
    monkeypatch.setenv("KUBERL_RELEASE", "team-a/qwen-grpo")
    _foreign(tmp_path / "retry", owner="release team-a/qwen-grpo", host="qwen-grpo-abcde-head-1")
    lease = _lease(tmp_path / "retry")
    assert lease.acquire().endswith("an earlier attempt of release team-a/qwen-grpo on qwen-grpo-abcde-head-1, "
                                    "which this attempt replaces")  # fmt: skip
    lease.release()
    # Another release on a shared directory is not an earlier attempt of this one.
    _foreign(tmp_path / "other", owner="release team-b/qwen-grpo", host="qwen-grpo-xyz-head-0")
    with pytest.raises(LeaseError, match="by release team-b/qwen-grpo"):
        _lease(tmp_path / "other").acquire()


def test_should_hand_the_directory_on_silently_within_one_process_and_release_only_its_own(tmp_path):
    first = _lease(tmp_path)
    assert first.acquire() is None
    first.release()
    assert not (tmp_path / lease_mod.NAME).exists()
    # An earlier run of this process that did not release (a test's simulated crash): taken silently.
    crashed = _lease(tmp_path)
    crashed.acquire()
    second = _lease(tmp_path)
    assert second.acquire() is None
    crashed.release()  # no longer its lease: leaves it alone
    assert json.loads((tmp_path / lease_mod.NAME).read_text())["run_id"] == second.me["run_id"]
    second.release()


def test_should_write_nothing_once_another_run_has_taken_the_lease_over(tmp_path):
    lease = _lease(tmp_path / "exp")
    lease.acquire()
    ck = Checkpointer(CheckpointConfig(checkpoint_dir=str(tmp_path)), "exp", guard=lease.check)
    (tmp_path / "exp" / "step_3" / "policy").mkdir(parents=True)  # the new holder's save in flight
    _foreign(tmp_path / "exp", take="over")
    with pytest.raises(LeaseError, match="no longer holds .* now held by a run of exp by alice@other-host"):
        ck.clean_stale()
    with pytest.raises(LeaseError):
        ck.begin(3)
    assert (tmp_path / "exp" / "step_3" / "policy").is_dir()
    lease.release()
    assert json.loads((tmp_path / "exp" / lease_mod.NAME).read_text())["run_id"] == "f" * 32


@pytest.mark.integration  # a Python interpreter of its own
def test_should_let_exactly_one_of_two_processes_racing_for_a_free_directory_hold_it(tmp_path):
    """Two processes that both find the directory free write the lease at once and read it back after
    the real settle time: the later write wins and the other refuses. Five races, each one winner."""
    script = textwrap.dedent(
        """
        import sys, time
        from pathlib import Path
        from trainer.lease import Lease, LeaseError
        go = float(sys.argv[2])
        time.sleep(max(0.0, go - time.time()))
        lease = Lease(Path(sys.argv[1]), "exp", 600.0)
        try:
            lease.acquire()
            print("held", flush=True)
            time.sleep(1.0)  # still holding while the other reads back
        except LeaseError as e:
            print("refused", e, flush=True)
        """
    )
    for race in range(5):
        root = tmp_path / f"race{race}"
        go = str(time.time() + 2.5)  # both past their imports, then both at once
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", script, str(root), go],
                cwd=REPO,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )  # fmt: skip
            for _ in range(2)
        ]
        outs = [p.communicate(timeout=60) for p in procs]
        verdicts = sorted(out.split()[0] if out else err for out, err in outs)
        assert verdicts == ["held", "refused"], outs


# ----- what changed since the checkpoint -----------------------------------------------------------------


def _saved(tmp_path: Path, cfg: Config) -> Path:
    import yaml

    path = tmp_path / "step_2"
    path.mkdir()
    (path / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    (path / "training_info.json").write_text(json.dumps({"step": 2, "provenance": {"image": "kuberl:1.0"}}))
    return path


def test_should_name_each_changed_key_and_let_where_and_how_fast_change_freely(tmp_path, monkeypatch):
    saved = _saved(tmp_path, Config())
    now = Config()
    now.policy.learning_rate = 0.5
    now.grpo.loss.ratio_clip_max = 0.3  # a nested key
    now.grpo.max_num_steps += 100  # may change: extend the run
    now.policy.micro_batch_size = 1  # may change: memory, not maths
    now.cluster.num_nodes = 4
    assert config_changes(saved, to_dict(now)) == [
        "grpo.loss.ratio_clip_max: 0.2 -> 0.3",
        "policy.learning_rate: 1e-06 -> 0.5",
    ]
    monkeypatch.setenv("KUBERL_IMAGE", "kuberl:1.1")
    assert config_changes(saved, to_dict(Config()))[-1] == "image: kuberl:1.0 -> kuberl:1.1"
    assert config_hash(to_dict(Config())) != config_hash(to_dict(now))
    fast = Config()
    fast.policy.micro_batch_size = 1
    assert config_hash(to_dict(Config())) == config_hash(to_dict(fast))


def test_should_name_only_real_keys_among_those_that_may_change():
    from trainer.checkpoint import _flat

    keys = _flat(to_dict(Config()))
    for name in MAY_CHANGE:
        assert any(k == name or k.startswith(name + ".") for k in keys), f"MAY_CHANGE names no key: {name}"


# ----- two real runs ------------------------------------------------------------------------------------


def _overrides(tmp: Path, steps: int, *extra: str) -> list[str]:
    return [
        "experiment=tiny",
        f"grpo.max_num_steps={steps}",
        "checkpointing.save_period=1",
        "checkpointing.keep_top_k=2",
        "cluster.cpu_workers_per_node=1",
        f"logger.log_dir={tmp / 'logs'}",
        f"checkpointing.checkpoint_dir={tmp / 'ckpt'}",
        *extra,
    ]


def _files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_should_refuse_a_second_run_on_a_live_runs_directory_and_touch_nothing_of_it(trainer_env, tmp_path):
    """A live run, paused (SIGSTOP) once it has committed a checkpoint and started the next save or step;
    a second run of the same experiment on the same directory; the first resumed and finished."""
    ckpt = tmp_path / "ckpt" / "tiny"
    first = subprocess.Popen([sys.executable, "-m", "trainer", *_overrides(tmp_path, 8)], cwd=REPO,
                             env=trainer_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while not (ckpt / "step_2" / "COMMITTED").is_file():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0][-3000:]
            time.sleep(0.2)
        os.kill(first.pid, signal.SIGSTOP)  # its files hold still while the second run tries
        try:
            before = _files(ckpt)
            second = run_in_process(_overrides(tmp_path, 8), trainer_env)
            after = _files(ckpt)
        finally:
            os.kill(first.pid, signal.SIGCONT)
        out = second.stdout + second.stderr
        assert second.returncode == 3, out[-3000:]
        (line,) = [ln for ln in out.splitlines() if "is held by" in ln]
        assert (
            f"error: checkpointing: {ckpt} is held by a run of tiny by " in line
            and f"(pid {first.pid} " in line
        )
        assert "kuberl: removed" not in out and "resumed from" not in out
        # SIGSTOP holds the first run's driver, not its Ray ranks: a save they had begun may still land its
        # files in a step not committed before. Anything else, and everything that was there, stays as it was.
        saving = {p.split("/")[0] for p in after if p.startswith("step_")} - {
            p.split("/")[0] for p in before if p.endswith("/COMMITTED")
        }
        assert {p: n for p, n in after.items() if p.split("/")[0] not in saving} == {
            p: n for p, n in before.items() if p.split("/")[0] not in saving
        }
        rest, _ = first.communicate(timeout=900)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, rest[-3000:]
    assert "kuberl: removed" not in rest
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_7", "step_8"]  # keep_top_k=2, both whole
    assert all((ckpt / s / "COMMITTED").is_file() for s in ("step_7", "step_8"))
    assert not (ckpt / lease_mod.NAME).exists()  # released on the way out


@pytest.mark.slow
def test_should_refuse_a_resume_with_a_changed_learning_rate_naming_the_key(trainer_env, tmp_path):
    first = run_in_process(_overrides(tmp_path, 2), trainer_env)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    changed = run_in_process(_overrides(tmp_path, 3, "policy.learning_rate=0.5"), trainer_env)
    out = changed.stdout + changed.stderr
    assert changed.returncode == 2, out[-3000:]  # permanent: the same command fails the same way
    (line,) = [ln for ln in out.splitlines() if "saved under another config" in ln]
    assert "policy.learning_rate: 0.01 -> 0.5." in line and "checkpointing.allow_changed_config=true" in line
    allowed = run_in_process(
        _overrides(tmp_path, 3, "policy.learning_rate=0.5", "checkpointing.allow_changed_config=true"),
        trainer_env,
    )
    out = allowed.stdout + allowed.stderr
    assert allowed.returncode == 0, out[-3000:]
    assert "with a changed policy.learning_rate: 0.01 -> 0.5 (checkpointing.allow_changed_config=true)" in out
    (run_dir,) = (tmp_path / "logs" / "tiny").iterdir()
    assert "policy.learning_rate: 0.01 -> 0.5" in (run_dir / "config_changes.txt").read_text()
