"""trainer.heap: the collector is off only while a process imports, and on, with the imports frozen, after.
The policy ranks, the generation actors, and other actors and tasks are checked on Ray in
tests/policy/test_policy_group.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import REPO


@pytest.mark.integration  # a Python interpreter of its own
def test_should_freeze_the_imports_and_collect_again_when_a_driver_settles():
    code = (
        "import gc, sys\n"
        "from trainer import heap\n"
        "heap.pause()\n"
        "assert not gc.isenabled()\n"
        "heap.settle('json')\n"
        "assert 'json' in sys.modules and gc.isenabled() and gc.get_freeze_count() > 1000\n"
        "heap.pause()\n"  # once settled, a later pause (another module's import) changes nothing
        "assert gc.isenabled()\n"
        "class Cycle: pass\n"
        "a, b = Cycle(), Cycle(); a.b, b.a = b, a; del a, b\n"
        "assert gc.collect() >= 2\n"  # what the process makes after settling is collected
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_should_collect_nothing_inside_and_restore_the_collector_when_an_import_is_paused():
    import gc

    from trainer import heap

    assert gc.isenabled()
    with heap.paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with heap.paused():  # a process that has the collector off keeps it off
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
