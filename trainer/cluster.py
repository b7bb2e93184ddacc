"""Connecting to Ray: the cluster in ``RAY_ADDRESS`` (a Ray job, a KubeRay head), or a local one.

With no address the trainer starts a private local Ray instance, so ``make train`` needs nothing
else running. On a CPU machine Ray's CPU count is only bookkeeping: it is raised so that the policy
ranks, generation actors and reward tasks all fit, and the OS shares the real cores between them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from trainer.config import Config
from trainer.processes import kill_descendants

log = logging.getLogger(__name__)


# Progress bars and advisory warnings from every worker would drown the one line per step.
QUIET_ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "RAY_DEDUP_LOGS": "1",
}


def quiet() -> None:
    """Make :data:`QUIET_ENV` this process's defaults (a value the user set stays), for it and every process
    it starts: an entry point calls this first, before anything it imports reads them."""
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)


# glibc mallopt parameters (malloc.h); values are C ints.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MALLOC_LIMIT = 2**31 - 1
# The same settings for a process not yet started (glibc reads them at start-up), e.g. a comparison run.
KEEP_FREED_MEMORY_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(_MALLOC_LIMIT),
    "MALLOC_TRIM_THRESHOLD_": str(_MALLOC_LIMIT),
}


def keep_freed_memory() -> bool:
    """Make glibc malloc keep freed blocks for reuse instead of handing each large one back to the OS.

    By default every block above a dynamic threshold (at most 32 MiB) is its own mmap, unmapped on
    free, so a tensor allocated anew on every step (an all-gather buffer, a (B, T, vocab) logits
    block) page-faults in all of its pages every time, a cost that grows with the block's size.
    With both thresholds at their maximum, blocks under 2 GiB come from the heap and are reused.
    The cost is that a process keeps its peak heap, a few per cent more peak memory per rank (both
    figures: bench/README.md, "Figures behind choices in the math, the cluster and the heap").
    Returns False where there is no glibc mallopt
    (musl, macOS): nothing changes there.
    """
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MALLOC_LIMIT)) and bool(mallopt(_M_TRIM_THRESHOLD, _MALLOC_LIMIT))


def split(items: list, parts: int) -> list[list[int]]:
    """Contiguous, near-equal index ranges (some may be empty)."""
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for p in range(parts):
        end = start + size + (1 if p < extra else 0)
        out.append(list(range(start, end)))
        start = end
    return out


def cpu_slots(cfg: Config) -> int:
    """Processes that compute on one CPU node: its policy ranks, plus the generation workers when
    generation is disaggregated (``cluster.cpu_pinning`` gives each its own cores)."""
    gen = cfg.generation.resources.num_cpu_workers if cfg.disaggregated else 0
    return max(1, cfg.cluster.cpu_workers_per_node) + gen


def slot_cores(slot: int, slots: int) -> list[int]:
    """The cores of share ``slot`` of ``slots`` contiguous, near-equal shares of this process's cores."""
    cores = sorted(os.sched_getaffinity(0))
    return [cores[i] for i in split(cores, slots)[slot]]


def setup_cpu_process(cfg: Config, threads: int, slot: int | None = None) -> None:
    """A CPU worker's torch threads and, with ``cluster.keep_freed_memory``, its allocator. With
    ``cluster.cpu_pinning`` the process is bound to its own share of the node's cores (``slot`` of
    :func:`cpu_slots`) and runs one thread per core of it, so policy ranks and generation workers
    that run at the same time (async GRPO) do not compete for cores. Async GRPO without pinning
    still gets a thread per core of its share: two processes that each spin a thread per core of the
    whole node run slower than the two taking turns (bench/README.md)."""
    import torch

    overlapping = cfg.grpo.async_.max_staleness >= 1
    if slot is not None and (cfg.cluster.cpu_pinning or overlapping):
        cores = slot_cores(slot, cpu_slots(cfg))
        if cfg.cluster.cpu_pinning:
            os.sched_setaffinity(0, cores)
        threads = len(cores)
    torch.set_num_threads(max(1, threads))
    if cfg.cluster.keep_freed_memory:
        keep_freed_memory()


def free_port() -> int:
    """A TCP port free on this host right now (for a process group's rendezvous; trainer.ports)."""
    from trainer.ports import free_port as pick

    return pick()


def node_address() -> tuple[str, int]:
    """This Ray node's IP address and a free port on it: where a rank can host a TCP store."""
    return ray.util.get_node_ip_address(), free_port()


class ClusterError(RuntimeError):
    """The Ray cluster cannot run this config (unreachable, or too few GPUs/CPUs)."""


def init_ray(cfg: Config) -> None:
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        # A cluster started elsewhere: its workers have that cluster's environment, not this process's. The
        # job's runtime env gives them the quiet settings and this process's hub and cache variables.
        env_vars = dict(QUIET_ENV)
        for key in ("KUBERL_CACHE", "HF_HOME", "HF_TOKEN", "HF_HUB_OFFLINE"):
            if key in os.environ:
                env_vars[key] = os.environ[key]
        try:
            ray.init(address=address, runtime_env={"env_vars": env_vars}, log_to_driver=True)
        except Exception as e:
            raise ClusterError(
                f"cannot connect to the Ray cluster at RAY_ADDRESS={address} ({type(e).__name__}); "
                "unset RAY_ADDRESS to run locally, or start the cluster (make up)"
            ) from None
        return
    # A local instance is this process's child, and its workers inherit this process's environment: the quiet
    # settings (this process's defaults from here on, as python -m trainer makes them) and the hub and cache
    # variables reach them without a runtime env. With one, Ray would start every worker through its
    # setup_worker.py (a Python process that imports Ray, then execs the worker's own) and could not use the
    # workers it starts ahead for the first driver.
    quiet()
    needed = cfg.train_world_size + (cfg.num_generation_workers if cfg.disaggregated else 0) + 2
    # Ray gives its raylet a fixed 30 s to register; on a machine busy with other work that can pass.
    # Once more, then one line instead of Ray's traceback.
    for attempt in (1, 2):
        try:
            ray.init(
                address="local",  # a private instance: never one that `ray start` left in /tmp/ray
                num_cpus=max(os.cpu_count() or 1, needed),
                num_gpus=None if cfg.cluster.use_gpus else 0,
                include_dashboard=False,
                log_to_driver=True,
                logging_level=logging.WARNING,
            )
            return
        except (SystemExit, KeyboardInterrupt):
            # SIGTERM (ray.init's own handler: sys.exit) or Ctrl-C while the instance starts, before ray.shutdown
            # knows it: the GCS and raylet die with this process (Ray's fate sharing), the raylet's dashboard
            # and runtime-env agents would not, and stay behind under PID 1. Take them down while they are ours.
            kill_descendants()
            raise
        except Exception as e:
            if "timed out during startup" not in str(e):
                raise
            ray.shutdown()
            if attempt == 2:
                raise ClusterError(
                    f"the local Ray instance did not start (twice, load average {os.getloadavg()[0]:.0f} on "
                    f"{os.cpu_count()} cores); retry when the machine is less busy, or start one with make up"
                ) from None
            log.warning("the local Ray instance did not start in time; trying once more")


def bundles_for(num_nodes: int, gpus_per_node: int, cpu_workers: int, use_gpus: bool) -> list[dict]:
    if use_gpus:
        return [{"GPU": 1, "CPU": 1} for _ in range(num_nodes * gpus_per_node)]
    return [{"CPU": 1} for _ in range(cpu_workers)]


def reserve(bundles: list[dict], name: str, timeout_s: float = 600) -> PlacementGroup:
    """A placement group, packed onto as few nodes as possible; a clear error if it never fits."""
    import uuid

    pg = placement_group(bundles, strategy="PACK", name=f"{name}-{uuid.uuid4().hex[:6]}")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        total = {k: sum(b.get(k, 0) for b in bundles) for k in ("GPU", "CPU")}
        raise ClusterError(
            f"{name}: the Ray cluster has not offered {total} within {timeout_s:.0f}s "
            f"(it has {ray.cluster_resources()}); check the worker groups and cluster.* in the config"
        )
    return pg


def in_bundle(pg: PlacementGroup, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)
