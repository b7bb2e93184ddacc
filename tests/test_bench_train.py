"""`make bench-train` at the smallest size, as a new user runs it: the benchmark is part of the product, and it
once crashed in torch's FSDPMemTracker (the policy never calls the root module's forward, where the tracker
opens its record) without a test noticing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import REPO

pytestmark = pytest.mark.slow


def test_should_run_bench_train_with_its_memory_pass_and_print_the_table() -> None:
    out = subprocess.run(
        [sys.executable, "bench/bench_train.py", "--prompts", "1", "--group", "2", "--max-response", "32",
         "--repeats", "1", "--layouts", "packed", "--no-profile", "--memory"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    lines = out.stdout.splitlines()
    assert any(line.startswith("packed ") and "%" in line for line in lines), out.stdout  # tokens/s, MFU
    assert any("peak of live tensors in a step" in line for line in lines), out.stdout
