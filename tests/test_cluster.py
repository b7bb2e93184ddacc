"""Process set-up for CPU workers, and the environment the workers of a run's local Ray instance get."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid

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
@pytest.mark.integration  # a Python interpreter of its own
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


# ----- cluster.cpu_pinning ---------------------------------------------------------------------------


def test_should_split_the_cores_into_contiguous_near_equal_shares(monkeypatch):
    import os

    from trainer.cluster import slot_cores

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6})
    shares = [slot_cores(s, 3) for s in range(3)]
    assert shares == [[0, 1, 2], [3, 4], [5, 6]]


def test_should_pin_the_policy_rank_and_the_generation_worker_to_their_own_cores(monkeypatch):
    import os

    import torch

    from trainer.cluster import setup_cpu_process
    from trainer.config import load

    cfg = load(
        [
            "experiment=tiny",
            "generation.placement=disaggregated",
            "cluster.cpu_workers_per_node=1",
            "cluster.cpu_pinning=true",
            "cluster.keep_freed_memory=false",
        ]
    )
    pinned = {}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cores: pinned.setdefault("cores", list(cores)))
    threads = torch.get_num_threads()
    try:
        setup_cpu_process(cfg, 4, slot=1)  # the generation worker's slot
        assert pinned["cores"] == [2, 3] and torch.get_num_threads() == 2
        pinned.clear()
        setup_cpu_process(cfg, 4, slot=0)  # policy rank 0's
        assert pinned["cores"] == [0, 1]
        pinned.clear()
        setup_cpu_process(load(["experiment=tiny", "cluster.keep_freed_memory=false"]), 4, slot=0)
        assert not pinned and torch.get_num_threads() == 4  # off by default: every process sees every core
        overlap = load(
            [
                "experiment=tiny",
                "generation.placement=disaggregated",
                "cluster.cpu_workers_per_node=1",
                "grpo.async.max_staleness=1",
                "cluster.keep_freed_memory=false",
            ]
        )
        setup_cpu_process(overlap, 4, slot=1)
        assert not pinned and torch.get_num_threads() == 2  # async, unpinned: its share of threads, any core
    finally:
        torch.set_num_threads(threads)


def test_should_refuse_more_pinned_processes_than_cores():
    import os

    from trainer.config import load
    from trainer.prestart import SetupError, check_cpu_pinning

    cores = len(os.sched_getaffinity(0))
    cfg = load(
        [
            "experiment=tiny",
            "generation.placement=disaggregated",
            f"cluster.cpu_workers_per_node={cores}",
            "cluster.cpu_pinning=true",
        ]
    )
    with pytest.raises(SetupError, match="cluster.cpu_pinning"):
        check_cpu_pinning(cfg)


# A run without RAY_ADDRESS: its local instance, and what one of its workers sees.
_LOCAL = textwrap.dedent(
    """
    import json, os, ray
    from trainer.cluster import init_ray
    from trainer.config import load

    init_ray(load(["experiment=tiny"]))

    @ray.remote(num_cpus=1)
    def seen():
        keys = ("TRANSFORMERS_VERBOSITY", "TOKENIZERS_PARALLELISM", "KUBERL_CACHE")
        return {"env": {k: os.environ.get(k) for k in keys}, "runtime_env": dict(ray.get_runtime_context().runtime_env)}

    try:
        print(json.dumps(ray.get(seen.remote())))
    finally:
        ray.shutdown()
    """
)


@pytest.mark.integration  # a Python interpreter of its own
def test_should_give_a_local_instances_workers_this_processs_environment_without_a_runtime_env(tmp_path):
    """The workers of a run's own instance inherit its environment: the quiet defaults, and the user's own
    values over them. No runtime env, which would start every worker through a second Python."""
    from trainer.cluster import QUIET_ENV

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and k not in QUIET_ENV}
    env.update({"TOKENIZERS_PARALLELISM": "true", "KUBERL_CACHE": str(tmp_path)})
    out = subprocess.run(
        [sys.executable, "-c", _LOCAL], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen["env"] == {
        "TRANSFORMERS_VERBOSITY": QUIET_ENV["TRANSFORMERS_VERBOSITY"],
        "TOKENIZERS_PARALLELISM": "true",
        "KUBERL_CACHE": str(tmp_path),
    }
    assert seen["runtime_env"] == {}


# A SIGTERM that lands while ray.init starts the local instance: after its processes started, before ray.init
# returns (and so before ray.shutdown or the run's own preemption handling know of them).
_TERM_DURING_INIT = textwrap.dedent(
    """
    import os, signal
    import ray._private.node as node
    from trainer.cluster import init_ray
    from trainer.config import load

    started = node.Node.start_ray_processes

    def start_then_term(self):
        started(self)
        os.kill(os.getpid(), signal.SIGTERM)

    node.Node.start_ray_processes = start_then_term
    init_ray(load(["experiment=tiny"]))
    print("init_ray returned")
    """
)


@pytest.mark.integration  # a Python interpreter and a Ray instance of its own
def test_should_leave_no_ray_agent_behind_when_sigterm_lands_while_the_local_instance_starts():
    from tests.leftovers import MARK, kill, leftovers

    session = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env[MARK] = ":".join(filter(None, (os.environ.get(MARK), session)))
    out = subprocess.run(
        [sys.executable, "-c", _TERM_DURING_INIT],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert out.returncode == signal.SIGTERM and "init_ray returned" not in out.stdout, out.stderr[-3000:]
    left = leftovers(session, grace_s=20)
    kill(left)
    assert not left, f"still running after the run ended: {sorted(left.values())}"


@pytest.mark.parametrize("key", ["policy.compile", "policy.fused_head"])
def test_should_refuse_in_one_line_when_a_cpu_run_compiles_without_a_cpp_compiler(key, monkeypatch):
    from torch._inductor import cpp_builder, exc

    from trainer.config import load
    from trainer.prestart import SetupError, check_compiler

    def no_compiler():
        raise exc.InvalidCxxCompiler

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    with pytest.raises(
        SetupError, match=rf"^{key}=true on CPU .* no C\+\+ compiler runs here .* set {key}=false$"
    ):
        check_compiler(load(["experiment=tiny", f"{key}=true"]))
    check_compiler(load(["experiment=tiny"]))  # null compiles nothing on CPU: no compiler asked for

    asked = []
    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", lambda: asked.append(1) or "g++")
    check_compiler(load(["experiment=tiny", f"{key}=true"]))
    assert asked == [1]
