"""Backend choice, uid allocation, and both backends when the trainer does not run as root."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trainer.sandbox import backends

from .conftest import sandbox_dirs, sandbox_processes

REPO = Path(__file__).resolve().parents[2]


def test_should_hand_out_distinct_unprivileged_uids_when_called_repeatedly():
    uids = [backends.allocate_uid() for _ in range(256)]
    assert len(set(uids)) == 256
    assert min(uids) >= 10000 and max(uids) < 2**32 - 1


def test_should_name_the_valid_backends_when_given_an_unknown_one():
    with pytest.raises(ValueError, match="expected one of bwrap, rlimit, auto"):
        backends.resolve("docker")


def test_should_use_the_fallback_when_the_environment_forces_it(monkeypatch):
    monkeypatch.setenv("KUBERL_SANDBOX", "rlimit")
    b = backends.resolve()
    assert b.kind == backends.RLIMIT and b.reason
    assert b.switch_uid == (os.geteuid() == 0)


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


NON_ROOT_UID = 54321

NON_ROOT_SCRIPT = textwrap.dedent(
    """
    import json, logging, sys
    from trainer.sandbox import Limits, run_tests
    out = {}
    for be in sys.argv[1:]:
        add = run_tests("python", "a, b = map(int, input().split())\\nprint(a + b)", ["1 2\\n"], backend=be)
        cpp = run_tests("cpp", "#include <cstdio>\\nint main(){int a,b;scanf(\\"%d%d\\",&a,&b);printf(\\"%d\\\\n\\",a+b);}",
                        ["3 4\\n"], backend=be)
        bomb = run_tests("python", "import os\\nwhile True:\\n    try:\\n        os.fork()\\n    except OSError:\\n        pass",
                         [""], Limits(time_s=0.5), backend=be)
        out[be] = [add.runs[0].stdout.decode(), cpp.runs[0].stdout.decode(), bomb.runs[0].status, add.error, cpp.error]
    print(json.dumps(out))
    """
)


@pytest.mark.timeout(120)
def test_should_work_without_root_when_the_trainer_is_unprivileged():
    if os.geteuid() != 0:
        pytest.skip("needs root to start a process as another uid")
    readable = os.stat(REPO / "trainer" / "__init__.py").st_mode & stat.S_IROTH
    if not (readable and backends._world_usable(str(REPO / "trainer"))) or not shutil.which("setpriv"):
        pytest.skip("the checkout is not readable by other uids here")
    python = backends.resolve().python
    kinds = [backends.RLIMIT]
    try:
        backends.resolve(backends.BWRAP)
        kinds.append(backends.BWRAP)
    except RuntimeError:
        pass
    # KUBERL_SANDBOX_PCH=0: as this uid the shared header folder (/tmp/kuberl-pch) would be created as
    # this uid's, and every later run as root would then refuse it as not its own.
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": "/tmp", "LANG": "C.UTF-8", "KUBERL_SANDBOX_PCH": "0"}
    argv = backends.as_uid([python, "-c", NON_ROOT_SCRIPT, *kinds], NON_ROOT_UID)[0]
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=100, env=env, cwd="/tmp")
    finally:  # whatever happened, nothing of that uid survives the test
        subprocess.run(backends.as_uid(["kill", "-9", "-1"], NON_ROOT_UID)[0], capture_output=True)
    assert p.returncode == 0, p.stderr[-2000:]
    results = json.loads(p.stdout.strip().splitlines()[-1])
    for kind in kinds:
        assert results[kind] == ["3\n", "7\n", "timeout", None, None], (kind, p.stderr[-1000:])
    if backends.RLIMIT in kinds:
        assert "as the trainer's own uid" in p.stderr  # the one warning says what the fallback cannot do
    left = [d for d in Path("/tmp").glob("kuberl-sandbox-*") if d.stat().st_uid == NON_ROOT_UID]
    assert not left, f"the fallback left its directories behind: {left}"


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
