"""tests.shared_instance: xdist workers share one instance, and its owner ends it only after the last user."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.leftovers import wait_all
from tests.shared_instance import ADDRESS, live_users, shared

from .conftest import REPO

pytestmark = pytest.mark.integration  # its users are Python interpreters of their own

# A process that takes the instance in `folder`, prints its address, holds it until its stdin closes.
USER = """
import contextlib, os, sys
from pathlib import Path
from tests.shared_instance import shared
folder, log = Path(sys.argv[1]), Path(sys.argv[2])

@contextlib.contextmanager
def start():
    with log.open("a") as f: f.write(f"start {os.getpid()}\\n")
    yield f"addr-{os.getpid()}"
    with log.open("a") as f: f.write(f"stop {os.getpid()}\\n")

with shared(folder, start, poll_s=0.05) as address:
    print(address, flush=True)
    sys.stdin.read()
"""


def _user(folder: Path, log: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", USER, str(folder), str(log)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    return proc, proc.stdout.readline().strip()


def test_should_share_one_instance_and_stop_it_after_its_last_user_when_workers_attach(tmp_path):
    folder, log = tmp_path / "shared", tmp_path / "log"
    procs = []
    try:
        owner, first = _user(folder, log)
        procs.append(owner)
        user, address = _user(folder, log)
        procs.append(user)
        assert address == first == f"addr-{owner.pid}"
        assert live_users(folder) == [user.pid]

        owner.stdin.close()  # the owner's session ends while the other's goes on
        while (folder / ADDRESS).exists():
            time.sleep(0.05)
        late, own = _user(folder, log)  # asks after that: an instance of its own
        procs.append(late)
        assert own == f"addr-{late.pid}"
        time.sleep(0.5)
        assert owner.poll() is None  # still waiting for its user
        assert log.read_text().splitlines() == [f"start {owner.pid}", f"start {late.pid}"]

        user.stdin.close()
        late.stdin.close()
        assert wait_all([owner, user, late], timeout=30) == [0, 0, 0]
        lines = log.read_text().splitlines()
        assert f"stop {owner.pid}" in lines and f"stop {late.pid}" in lines
    finally:
        for proc in procs:  # after a failed assertion: none outlives the test
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_should_start_anew_when_the_registered_owner_is_gone(tmp_path):
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    (tmp_path / "users").mkdir()
    (tmp_path / ADDRESS).write_text(f"addr-dead {gone.stdout.strip()}\n")
    started = []

    @contextlib.contextmanager
    def start():
        started.append(1)
        yield "addr-new"

    with shared(tmp_path, start) as address:
        assert address == "addr-new"
    assert started == [1] and not (tmp_path / ADDRESS).exists()
