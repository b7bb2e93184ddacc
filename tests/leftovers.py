"""No process a test started outlives the test session: the check behind ``tests/conftest.py``.

Every process the session starts inherits one environment variable with the session's id (Ray's
GCS, raylet, agents and workers, trainers, receivers, vLLM engines, a ``make up`` cluster: they all
start from this environment). Orphans are re-parented away from pytest, so the check does not walk
the process tree: at the end it reads each process's environment for the id. A process still there
after a grace period is a leftover: the suite fails, naming it, and the process is killed so it does
not outlive the session either.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

MARK = "KUBERL_TEST_SESSION"


def mark_session() -> str:
    """Give this process (and so every process it starts) a new session id, after any it inherited.

    A test may start a pytest session of its own; that one's check must look only at what it started,
    not at its parent session's processes (a Ray cluster the parent still uses), so each session
    appends its id: ``outer:inner``. The outer session's check still sees what the inner one left.
    """
    session = uuid.uuid4().hex
    os.environ[MARK] = ":".join(filter(None, (os.environ.get(MARK), session)))
    return session


def _marked(session: str) -> dict[int, str]:
    """pid -> command line of every live process carrying ``session``'s id, other than this one."""
    prefix = f"{MARK}=".encode()
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        pid = int(proc.name)
        if pid == os.getpid():
            continue
        try:
            marks = [
                v[len(prefix) :] for v in (proc / "environ").read_bytes().split(b"\0") if v.startswith(prefix)
            ]
            if not marks or session.encode() not in marks[0].split(b":"):
                continue
            state, parent = (proc / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            if state == "Z":
                continue  # exited, not yet reaped: not running
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            if "multiprocessing.resource_tracker" in cmdline and int(parent) == os.getpid():
                continue  # this interpreter's own helper: it ends when this process does
        except OSError:  # gone meanwhile, or not ours to read
            continue
        found[pid] = cmdline
    return found


def leftovers(session: str, grace_s: float = 20.0) -> dict[int, str]:
    """The session's processes still alive after ``grace_s`` (those shutting down get that long)."""
    deadline = time.monotonic() + grace_s
    while True:
        found = _marked(session)
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def wait_all(procs, timeout: float) -> list[int]:
    """Each process's exit code, waiting at most ``timeout`` for each; whatever is still running after
    (a timeout, or an error on the way) is killed and reaped, so no test leaves one behind."""
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
