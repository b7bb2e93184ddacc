"""A Ray cluster in a process of its own, for tests that connect to it from other processes (a driver may
join one Ray cluster at a time, and an xdist worker is already one): the process prints the cluster's
address, then holds the cluster until its stdin closes, and ends everything it started on the way out."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def ray_process(start: str, stop: str, env: dict[str, str], what: str) -> Iterator[str]:
    """Run ``start`` (Python that starts a cluster and leaves its address in ``address``), print the address,
    wait for stdin to close, run ``stop``; yields the address. ``what`` names it in a failure."""
    code = f"import sys\n{start}\nprint(address, flush=True)\nsys.stdin.read()\n{stop}\n"
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        address = proc.stdout.readline().strip() if proc.stdout else ""
        if not address:
            pytest.fail(f"{what} did not start (exit {proc.wait(timeout=60)})")
        yield address
    finally:
        if proc.stdin:
            proc.stdin.close()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
