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
