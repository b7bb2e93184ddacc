"""Tools for the tools environment's tests (``tests.envs.tool_funcs:NAME``): standard library only, as a
tool module a run names would be; some misbehave on purpose."""

from __future__ import annotations

import os
import time


# Tools that misbehave, for the tools environment's bounds (module:function, schemas from their docstrings).
def sleepy(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "awake"


def hog(megabytes: int) -> str:
    """Allocate memory.

    Args:
        megabytes: How much.
    """
    return str(len(bytearray(megabytes << 20)))


def crash() -> str:
    """End its own process without a word."""
    os._exit(3)


def lookup(key: str, count: int = 1) -> dict:
    """Look a key up.

    Args:
        key: The key.
        count: How many copies.
    """
    return {"key": key, "values": [key.upper()] * count}


def undocumented(x):
    return x


def roll() -> str:
    """Roll a ten-sided die and return the digit it shows."""
    import random

    return str(random.SystemRandom().randrange(10))  # not the fork server's seeded state: every call its own


def background(path: str, seconds: float) -> str:
    """Start `sleep 30` in the background, write its pid to a file, then sleep.

    Args:
        path: Where to write the background process's pid.
        seconds: How long to sleep after starting it.
    """
    import subprocess

    child = subprocess.Popen(["sleep", "30"])  # on purpose: it must not outlive the call
    with open(path, "w") as f:
        f.write(str(child.pid))
    time.sleep(seconds)
    return "started"


def spin() -> str:
    """Compute forever."""
    while True:
        pass


def limits() -> dict:
    """Report the call's own process group and limits."""
    import resource

    return {
        "pid": os.getpid(),
        "pgid": os.getpgid(0),
        "sid": os.getsid(0),
        "as": list(resource.getrlimit(resource.RLIMIT_AS)),
        "cpu": list(resource.getrlimit(resource.RLIMIT_CPU)),
        "nproc": list(resource.getrlimit(resource.RLIMIT_NPROC)),
    }


def threads(count: int) -> str:
    """Start threads that wait.

    Args:
        count: How many.
    """
    import threading

    done = threading.Event()
    started = []
    try:
        for _ in range(count):
            t = threading.Thread(target=done.wait)
            t.start()
            started.append(t)
    finally:
        done.set()
        for t in started:
            t.join()
    return str(len(started))
