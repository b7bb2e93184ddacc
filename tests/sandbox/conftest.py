"""Fixtures for the sandbox tests: every test runs once per backend (bubblewrap, and the fallback, asked for by
its opt-in name ``rlimit-without-isolation``)."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests import tiers
from trainer.sandbox import backends

SANDBOX_UID_MIN = 10000  # allocate_uid never hands out anything below this


def _bwrap_problem() -> str | None:
    try:
        backends.resolve("bwrap")
    except backends.SandboxUnavailable as e:
        return str(e)
    return None


@pytest.fixture(params=[backends.BWRAP, backends.UNISOLATED])
@tiers.starts("runs programs in the sandbox")
def backend(request) -> str:
    """What a test asks for: ``bwrap``, or the fallback by its opt-in name (plain ``rlimit`` is refused)."""
    if request.param == backends.BWRAP:
        why = _bwrap_problem()
        if why:
            pytest.skip(f"bubblewrap unavailable here ({why}); the fallback is tested instead")
    return request.param


def kind_of(requested: str) -> str:
    """The Backend.kind a request resolves to (the opt-in name resolves to the ``rlimit`` fallback)."""
    return backends.RLIMIT if requested == backends.UNISOLATED else requested


def ours() -> set[int]:
    """This process and its live descendants (its Ray instance's workers among them): the processes
    whose sandboxes this test process started. Other processes' sandboxes (another xdist worker's run,
    with its own Ray instance) come and go meanwhile and are not the test's to count."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [os.getpid()]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo.extend(children.get(pid, []))
    return found


def sandbox_processes(owners: set[int] | None = None) -> list[tuple[int, int, str]]:
    """(pid, uid, name) of live processes running as a sandbox uid (only meaningful as root): those
    whose uid one of ``owners`` allocated (backends.allocated_by), or all with ``owners=None``."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        uid = int(fields.get("Uid", "0").split()[0])
        if (
            uid >= SANDBOX_UID_MIN
            and uid != os.getuid()
            and not fields.get("State", "").strip().startswith("Z")
            and (owners is None or backends.allocated_by(uid) in owners)
        ):
            found.append((int(entry.name), uid, fields.get("Name", "").strip()))
    return found


def sandbox_dirs(owners: set[int]) -> set[Path]:
    """The fallback's sandbox directories (``kuberl-sandbox-<pid>-*``) that one of ``owners`` made."""
    return {
        d
        for d in Path(tempfile.gettempdir()).glob("kuberl-sandbox-*-*")
        if d.name.split("-")[2].isdigit() and int(d.name.split("-")[2]) in owners
    }


@pytest.fixture
def no_leftovers():
    """Fails the test if a sandbox process this test process started (checked as root, where sandboxes
    get own uids) or a fallback sandbox's directory it made outlives the test."""
    before = {p for p, _, _ in sandbox_processes(ours())}
    dirs_before = sandbox_dirs(ours())
    yield
    deadline = time.monotonic() + 3.0  # a sandbox's own cleanup may still be running: let it end
    while new_dirs := sandbox_dirs(ours()) - dirs_before:
        if time.monotonic() > deadline:
            pytest.fail(f"sandbox directories left behind: {sorted(new_dirs)}")
        time.sleep(0.1)
    if os.geteuid() != 0:
        return
    deadline = time.monotonic() + 3.0
    left = []
    while time.monotonic() < deadline:
        left = [p for p in sandbox_processes(ours()) if p[0] not in before]
        if not left:
            return
        time.sleep(0.1)
    pytest.fail(f"sandbox processes outlived the call: {left[:10]}")


@pytest.fixture
def canary():
    """A process of ours that hostile code would love to kill."""
    p = subprocess.Popen(["sleep", "120"])
    yield p
    alive = p.poll() is None
    p.kill()
    p.wait()
    assert alive, "sandboxed code killed a process outside the sandbox"
