"""One instance of something costly (a Ray instance) for all the processes of a test session.

Under xdist every worker is a process of its own, with session fixtures of its own. A worker that asks
for the instance when no live one is registered starts it and becomes its owner; the others attach.
Each attached worker registers itself until its session ends; the owner stops the instance only when
no registered worker is still alive. From the moment the owner starts to stop it, no one attaches
any more: a worker that asks later starts an instance of its own. All of this happens under one
lock file, in a folder that only this test session's processes use.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ADDRESS, LOCK, USERS = "address", "lock", "users"


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    with open(folder / LOCK, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _registered(folder: Path) -> str | None:
    """The address of the live instance registered in ``folder``; None if none is, or its owner is gone."""
    try:
        address, owner = (folder / ADDRESS).read_text().split()
    except (FileNotFoundError, ValueError):
        return None
    return address if _alive(int(owner)) else None


def live_users(folder: Path) -> list[int]:
    """The pids of the attached processes still alive (the files of the dead are removed)."""
    pids = []
    for entry in (folder / USERS).iterdir():
        if _alive(int(entry.name)):
            pids.append(int(entry.name))
        else:
            entry.unlink(missing_ok=True)
    return pids


@contextlib.contextmanager
def shared(
    folder: Path,
    start: Callable[[], contextlib.AbstractContextManager[str]],
    wait_s: float = 3600,
    poll_s: float = 1.0,
) -> Iterator[str]:
    """The address of the instance shared through ``folder``, started with ``start()`` (a context manager
    that yields the address and stops the instance on exit) if none is registered. The owner's exit waits
    (at most ``wait_s``) for the processes attached to it to exit theirs."""
    (folder / USERS).mkdir(parents=True, exist_ok=True)
    me = folder / USERS / str(os.getpid())
    with contextlib.ExitStack() as instance:
        with _locked(folder):
            address = _registered(folder)
            attached = address is not None
            if attached:
                me.touch()
            else:
                address = instance.enter_context(start())
                (folder / ADDRESS).write_text(f"{address} {os.getpid()}\n")
        try:
            yield address
        finally:
            if attached:
                me.unlink(missing_ok=True)
            else:
                with _locked(folder):
                    (folder / ADDRESS).unlink(missing_ok=True)  # from now on, no one attaches
                deadline = time.monotonic() + wait_s
                while live_users(folder) and time.monotonic() < deadline:
                    time.sleep(poll_s)
