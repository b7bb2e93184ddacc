"""Process set-up for CPU workers."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# A 64 MiB block, allocated, touched and freed 10 times; prints the page faults of the last 8 rounds
# (the first ones may still place the block in a grown heap).
_FAULTS = textwrap.dedent(
    """
    import resource, sys, torch
    if sys.argv[1] == "keep":
        from trainer.cluster import keep_freed_memory
        assert keep_freed_memory()
    faults = []
    for _ in range(10):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.ones(16 * 2**20, dtype=torch.float32)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(sum(faults[2:]))
    """
)


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning")
def test_should_reuse_freed_blocks_instead_of_faulting_them_in_again_when_freed_memory_is_kept():
    pages = 64 * 2**20 // 4096
    default, keep = _faults("default"), _faults("keep")
    assert default > 6 * pages  # each round maps a fresh block: every page faults again
    assert keep < 3 * pages  # the freed block is reused (a round or two may still grow the heap)


def test_should_tune_the_allocator_of_cpu_workers_only_when_configured(monkeypatch):
    from trainer import cluster
    from trainer.config import load

    calls = []
    monkeypatch.setattr(cluster, "keep_freed_memory", lambda: calls.append(1) or True)
    monkeypatch.setattr("torch.set_num_threads", lambda n: calls.append(("threads", n)))
    cluster.setup_cpu_process(load(["experiment=tiny"]), 3)
    cluster.setup_cpu_process(load(["experiment=tiny", "cluster.keep_freed_memory=false"]), 0)
    assert calls == [("threads", 3), 1, ("threads", 1)]
