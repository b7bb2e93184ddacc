"""The leftovers check (tests.leftovers): what a session started and left running is named; what ends with
the checking process itself is not."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import REPO

# A session of its own in a fresh interpreter: multiprocessing's resource tracker (which vLLM, torch and
# W&B start in a test process, and which ends only when that process does) and a process left running.
_SESSION = """
import subprocess
from multiprocessing import resource_tracker
from tests.leftovers import kill, leftovers, mark_session
session = mark_session()
resource_tracker.ensure_running()
subprocess.Popen(["sleep", "60"])
left = leftovers(session, grace_s=0)
kill(left)
print(sorted(cmd.split()[0] for cmd in left.values()))
"""


@pytest.mark.integration  # a Python interpreter of its own
def test_should_name_a_process_left_running_and_not_the_interpreters_own_resource_tracker():
    out = subprocess.run(
        [sys.executable, "-c", _SESSION], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['sleep']"
