"""Backend choice, uid allocation, and both backends when the trainer does not run as root."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trainer.config import ConfigError
from trainer.sandbox import backends

from .conftest import sandbox_dirs, sandbox_processes

REPO = Path(__file__).resolve().parents[2]


def test_should_hand_out_distinct_unprivileged_uids_when_called_repeatedly():
    uids = [backends.allocate_uid() for _ in range(256)]
    assert len(set(uids)) == 256
    assert min(uids) >= 10000 and max(uids) < 2**32 - 1


def test_should_name_the_valid_backends_when_given_an_unknown_one():
    with pytest.raises(ValueError, match="expected one of bwrap, auto, rlimit-without-isolation"):
        backends.resolve("docker")


@pytest.mark.integration  # runs unshare
def test_should_use_the_fallback_when_the_environment_opts_in_by_name(monkeypatch):
    monkeypatch.setenv("KUBERL_SANDBOX", backends.UNISOLATED)
    b = backends.resolve()
    assert b.kind == backends.RLIMIT and backends.UNISOLATED in b.reason
    assert b.switch_uid == (os.geteuid() == 0)


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_should_refuse_plain_rlimit_in_one_line_naming_the_opt_in_when_asked_for_it(monkeypatch, how):
    monkeypatch.setattr(backends, "_cache", {})
    if how == "environment":
        monkeypatch.setenv("KUBERL_SANDBOX", "rlimit")
    with pytest.raises(backends.SandboxUnavailable) as e:
        backends.resolve("rlimit" if how == "argument" else None)
    line = str(e.value)
    assert "\n" not in line and f"KUBERL_SANDBOX={backends.UNISOLATED}" in line
    assert isinstance(e.value, ConfigError)


def test_should_refuse_without_falling_back_when_bubblewrap_cannot_start_under_auto(monkeypatch):
    """No unisolated fallback by default: ``auto`` is bubblewrap or one line naming the opt-in."""
    monkeypatch.setattr(backends, "_cache", {})
    monkeypatch.delenv("KUBERL_SANDBOX", raising=False)
    monkeypatch.setattr(
        backends, "_bwrap_backend", lambda need_world: (_ for _ in ()).throw(RuntimeError("no bwrap"))
    )
    with pytest.raises(backends.SandboxUnavailable) as e:
        backends.resolve()
    line = str(e.value)
    assert "\n" not in line and "bubblewrap cannot start here (no bwrap)" in line
    assert f"KUBERL_SANDBOX={backends.UNISOLATED}" in line


def test_should_refuse_bubblewrap_without_seccomp_unless_opted_out_when_libseccomp_is_missing(monkeypatch):
    from trainer.sandbox import seccomp

    def missing():
        raise seccomp.SeccompUnavailable("libseccomp.so.2 (libseccomp) is not installed")

    monkeypatch.setattr(seccomp, "bpf", missing)
    monkeypatch.setattr(backends, "_cache", {})
    monkeypatch.delenv(backends.WITHOUT_SECCOMP_ENV, raising=False)
    with pytest.raises(backends.SandboxUnavailable) as e:
        backends.resolve("bwrap")
    line = str(e.value)
    assert "\n" not in line and "libseccomp" in line and f"{backends.WITHOUT_SECCOMP_ENV}=1" in line
    if _bwrap_works():
        monkeypatch.setenv(backends.WITHOUT_SECCOMP_ENV, "1")
        b = backends.resolve("bwrap")
        assert b.kind == backends.BWRAP and b.seccomp is None
        argv = backends.bwrap_argv(b, ["python3"], seccomp_fd=backends.seccomp_fd(b))
        assert "--seccomp" not in argv


@pytest.mark.integration  # runs bubblewrap
def test_should_load_the_seccomp_filter_into_bubblewrap_when_it_resolves():
    if not _bwrap_works():
        pytest.skip("bubblewrap unavailable here")
    b = backends.resolve("bwrap")
    assert b.seccomp and len(b.seccomp) % 8 == 0
    fd = backends.seccomp_fd(b)
    try:
        argv = backends.bwrap_argv(b, ["python3"], seccomp_fd=fd)
        assert argv[argv.index("--seccomp") + 1] == str(fd) and argv.index("--seccomp") < argv.index("--")
        assert os.read(fd, len(b.seccomp) + 1) == b.seccomp  # at offset 0: bubblewrap reads it whole
    finally:
        os.close(fd)


def _bwrap_works() -> bool:
    try:
        backends.resolve("bwrap")
    except backends.SandboxUnavailable:
        return False
    return True


def test_should_refuse_in_one_line_when_bwrap_is_forced_and_cannot_start(monkeypatch):
    monkeypatch.setattr(backends, "_cache", {})
    monkeypatch.setenv("PATH", "/nonexistent")  # no bwrap to be found
    with pytest.raises(backends.SandboxUnavailable) as e:
        backends.resolve("bwrap")
    line = str(e.value)
    assert "\n" not in line and line.startswith("KUBERL_SANDBOX=bwrap, but bubblewrap cannot start here")
    assert "sandbox.enabled=true" in line
    assert isinstance(e.value, ConfigError)  # python -m trainer prints it as one line and exits 2


@pytest.mark.parametrize("requested", [backends.UNISOLATED])
def test_should_refuse_the_fallback_when_it_cannot_take_the_network_away(monkeypatch, requested):
    monkeypatch.setattr(backends, "_cache", {})
    monkeypatch.setattr(
        backends, "_bwrap_backend", lambda need_world: (_ for _ in ()).throw(RuntimeError("no bwrap"))
    )
    monkeypatch.setattr(backends, "_can_unshare", lambda *flags: False)
    with pytest.raises(backends.SandboxUnavailable, match="cannot unshare a network namespace") as e:
        backends.resolve(requested)
    assert "\n" not in str(e.value)


@pytest.mark.integration  # runs unshare
def test_should_give_the_fallback_its_own_network_namespace_when_it_resolves(monkeypatch):
    monkeypatch.setattr(backends, "_cache", {})
    b = backends.resolve(backends.UNISOLATED)
    assert b.netns in (backends.NETNS_ROOT, backends.NETNS_USER)


@pytest.mark.integration  # runs the sandbox runner
def test_should_exit_before_running_anything_when_the_runner_cannot_unshare_the_network(monkeypatch):
    """The runner's own guard: a namespace it cannot make stops it, whatever resolve() believed."""
    from trainer.sandbox import executor

    monkeypatch.setattr(backends, "_cache", {})
    real = backends.resolve(backends.UNISOLATED)
    # A flag the kernel rejects (EINVAL) stands in for a refused unshare.
    monkeypatch.setattr(
        executor.backends, "resolve", lambda backend=None: dataclasses.replace(real, netns="user")
    )
    code = "print('ran')"
    src = executor.RUNNER_SOURCE.replace("CLONE_NEWUSER = 0x10000000", "CLONE_NEWUSER = 0x7fffffff")
    monkeypatch.setattr(executor, "RUNNER_SOURCE", src)
    result = executor.run_tests("python", code, [""])
    assert result.runs[0].stdout == b"" and "cannot unshare a network namespace" in (result.error or "")


def test_should_switch_uid_through_setpriv_when_it_exists():
    argv, kw = backends.as_uid(["true"], 123456)
    if shutil.which("setpriv"):
        assert argv[-1] == "true" and "--reuid=123456" in argv and kw == {}
    else:
        assert kw == {"user": 123456, "group": 123456, "extra_groups": []}


def test_should_mount_only_system_directories_when_building_the_bwrap_command():
    b = backends.Backend(
        backends.BWRAP, "/usr/bin/python3", "/usr/bin/bwrap", ("--size", "--disable-userns", "--perms")
    )
    argv = backends.bwrap_argv(b, ["python3", "-c", "pass"])
    binds = {
        argv[i + 1] for i, a in enumerate(argv) if a in ("--ro-bind", "--bind", "--ro-bind-try", "--bind-try")
    }
    assert binds <= {
        "/usr",
        "/bin",
        "/sbin",
        "/lib",
        "/lib32",
        "/lib64",
        "/libx32",
        "/etc/ld.so.cache",
        "/etc/alternatives",
    }
    assert "--bind" not in argv  # nothing of the host is writable
    assert {
        "--unshare-all",
        "--unshare-user",
        "--die-with-parent",
        "--new-session",
        "--disable-userns",
    } <= set(argv)
    assert argv[-3:] == ["python3", "-c", "pass"]
    assert argv[argv.index("--proc") + 1] == "/proc"


def test_should_mount_no_proc_at_all_when_the_runtime_masks_the_containers_proc():
    """Where a new procfs is refused (a masked /proc: procMount Default), the sandbox gets none rather
    than the container's own (the runner needs none under bubblewrap's PID namespace)."""
    b = backends.Backend(backends.BWRAP, "/usr/bin/python3", "/usr/bin/bwrap", proc=False)
    argv = backends.bwrap_argv(b, ["python3", "-c", "pass"])
    assert "--proc" not in argv and "/proc" not in argv and "--unshare-all" in argv


NON_ROOT_UID = 54321

NON_ROOT_SCRIPT = textwrap.dedent(
    """
    import json, logging, sys
    from trainer.sandbox import Limits, run_tests
    out = {}
    port = int(sys.argv[1])
    for be in sys.argv[2:]:
        add = run_tests("python", "a, b = map(int, input().split())\\nprint(a + b)", ["1 2\\n"], backend=be)
        cpp = run_tests("cpp", "#include <cstdio>\\nint main(){int a,b;scanf(\\"%d%d\\",&a,&b);printf(\\"%d\\\\n\\",a+b);}",
                        ["3 4\\n"], backend=be)
        bomb = run_tests("python", "import os\\nwhile True:\\n    try:\\n        os.fork()\\n    except OSError:\\n        pass",
                         [""], Limits(time_s=0.5), backend=be)
        net = run_tests("python", f"import socket\\ns = socket.socket()\\nprint(s.connect_ex(('127.0.0.1', {port})) == 0)",
                        [""], backend=be)
        out[be] = [add.runs[0].stdout.decode(), cpp.runs[0].stdout.decode(), bomb.runs[0].status, add.error, cpp.error,
                   net.runs[0].stdout.decode()]
    print(json.dumps(out))
    """
)


@pytest.mark.timeout(120)
@pytest.mark.integration  # a Python interpreter of its own
def test_should_work_without_root_when_the_trainer_is_unprivileged():
    if os.geteuid() != 0:
        pytest.skip("needs root to start a process as another uid")
    readable = os.stat(REPO / "trainer" / "__init__.py").st_mode & stat.S_IROTH
    if not (readable and backends._world_usable(str(REPO / "trainer"))) or not shutil.which("setpriv"):
        pytest.skip("the checkout is not readable by other uids here")
    python = backends.resolve(backends.UNISOLATED).python
    kinds = [backends.UNISOLATED]
    try:
        backends.resolve(backends.BWRAP)
        kinds.append(backends.BWRAP)
    except backends.SandboxUnavailable:
        pass
    # KUBERL_SANDBOX_PCH=0: as this uid the shared header folder (/tmp/kuberl-pch) would be created as
    # this uid's, and every later run as root would then refuse it as not its own.
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(REPO),
        "HOME": "/tmp",
        "LANG": "C.UTF-8",
        "KUBERL_SANDBOX_PCH": "0",
    }
    server = socket.socket()  # a socket of the host that no sandbox may reach
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    argv = backends.as_uid(
        [python, "-c", NON_ROOT_SCRIPT, str(server.getsockname()[1]), *kinds], NON_ROOT_UID
    )[0]
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=100, env=env, cwd="/tmp")
    finally:  # whatever happened, nothing of that uid survives the test
        subprocess.run(backends.as_uid(["kill", "-9", "-1"], NON_ROOT_UID)[0], capture_output=True)
        server.close()
    assert p.returncode == 0, p.stderr[-2000:]
    results = json.loads(p.stdout.strip().splitlines()[-1])
    for kind in kinds:
        assert results[kind] == ["3\n", "7\n", "timeout", None, None, "False\n"], (kind, p.stderr[-1000:])
    if backends.UNISOLATED in kinds:
        assert "as the trainer's own uid" in p.stderr  # the one warning says what the fallback cannot do
    left = [d for d in Path("/tmp").glob("kuberl-sandbox-*") if d.stat().st_uid == NON_ROOT_UID]
    assert not left, f"the fallback left its directories behind: {left}"


@pytest.mark.integration  # a Python interpreter of its own
def test_should_not_import_anything_heavy_when_imported():
    code = "import sys, trainer.sandbox, trainer.rewards.code; print(sorted(m for m in ('torch', 'ray', 'datasets') if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True
    ).stdout
    assert out.strip() == "[]"


@pytest.mark.timeout(60)
def test_should_stop_the_sandbox_when_its_caller_is_killed(backend):
    """A reward timeout cancels the Ray task, killing the worker mid-run: the sandbox must go too."""
    if os.geteuid() != 0:
        pytest.skip("sandbox processes are told apart by their own uids only when we are root")
    code = (
        "import sys\n"
        "from trainer.sandbox import run_tests\n"
        "print('started', flush=True)\n"
        f"run_tests('python', 'import os, time\\nos.fork()\\ntime.sleep(60)', [''] * 5, backend={backend!r})\n"
    )
    caller = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert caller.stdout.readline().strip() == "started"
    deadline = time.monotonic() + 20
    # The runner, the test's child and its own child (each sandbox's uid names the caller that made it):
    # the program is running.
    while len([p for p in sandbox_processes({caller.pid}) if p[2] != "bwrap"]) < 3:
        assert time.monotonic() < deadline, "the sandboxed program never started"
        time.sleep(0.05)
    caller.kill()
    caller.wait()
    deadline = time.monotonic() + 5
    while left := sandbox_processes({caller.pid}):
        assert time.monotonic() < deadline, f"sandbox processes outlived their caller: {left}"
        time.sleep(0.1)
    for d in sandbox_dirs({caller.pid}):  # what the killed caller could not remove
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_should_stop_a_code_reward_run_in_one_line_when_bwrap_is_forced_and_cannot_start(tmp_path):
    """What a pod of the chart does (KUBERL_SANDBOX=bwrap) where its security context keeps bubblewrap
    from starting: the run refuses before any code from the model runs, with one line and no fallback.
    An interpreter that does not exist makes bubblewrap fail here whether or not it is installed."""
    env = dict(
        os.environ, KUBERL_SANDBOX="bwrap", KUBERL_SANDBOX_PYTHON="/nonexistent/python3", PYTHONPATH=str(REPO)
    )
    p = subprocess.run(
        [sys.executable, "-m", "trainer", "experiment=tiny", "rewards=code_unit_tests", "grpo.max_num_steps=1",
         f"logger.log_dir={tmp_path / 'logs'}", f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}"],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=280,
    )  # fmt: skip
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    ours = [ln for ln in p.stderr.splitlines() if ln.startswith("kuberl:")]
    assert len(ours) == 1 and ours[0].startswith(
        "kuberl: error: KUBERL_SANDBOX=bwrap, but bubblewrap cannot start here"
    )
    assert not (tmp_path / "logs").exists() or not list((tmp_path / "logs").rglob("train_data_step*.jsonl"))
