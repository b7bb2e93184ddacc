"""A process group between policy rank 0 and the generation actors, for weight broadcasts.

The policy ranks already form one torch.distributed world (FSDP); generation actors live in other
processes, possibly on other nodes. Instead of a second global world, this builds a standalone group
from a TCPStore: gloo on CPU, NCCL on GPUs, the same transport the vLLM backend uses for its
weight updates. Rank 0 (the policy's rank 0) hosts the store and is the broadcast root.

Teardown has an order, and :meth:`WeightSyncGroup.close` keeps it on every rank:

1. a barrier, so no rank tears down while another still has a broadcast in flight;
2. the process group is destroyed, which joins its worker threads;
3. every other rank checks out through the store, and rank 0, the store's host, waits for them
   before it lets the store go.

Step 2 is what keeps a process from aborting at exit. A gloo worker thread drops its reference to a
finished broadcast a moment *after* ``wait()`` has returned in the caller; when that reference is
the last one to a tensor created in Python, the thread needs the GIL to free it. If the interpreter
is already finalizing by then, taking the GIL ends the thread with ``pthread_exit`` inside a
``noexcept`` destructor, and the process dies with ``terminate called without an active exception``
(SIGABRT; caught under gdb in ``ProcessGroupGloo::runLoop`` -> ``~AsyncBroadcastWork`` ->
``decref_pyobject`` -> ``take_gil`` -> ``PyThread_exit_thread``). Destroying the group while the
interpreter is alive joins those threads first. A process that never calls ``close`` gets the same
step 2 from an ``atexit`` hook (without the barrier: its peers may be gone).
"""

from __future__ import annotations

import atexit
import datetime
import logging
import time
import weakref
from typing import Protocol, cast

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

_TIMEOUT = datetime.timedelta(minutes=10)
_PREFIX = "kuberl-weight-sync"
_CLOSED_KEY = f"{_PREFIX}/closed"  # how many non-root ranks have checked out
_OPEN: weakref.WeakSet[WeightSyncGroup] = weakref.WeakSet()  # groups not yet closed in this process


class _Backend(Protocol):
    """What the group calls on its process group. torch binds both on every backend (ProcessGroupGloo,
    ProcessGroupNCCL), but its stubs (torch/_C/_distributed_c10d.pyi) declare them on ProcessGroup alone."""

    def broadcast(self, tensor: torch.Tensor, root: int) -> dist.Work: ...

    def barrier(self, opts: dist.BarrierOptions) -> dist.Work: ...


class WeightSyncGroup:
    def __init__(self, host: str, port: int, rank: int, world_size: int, device: torch.device):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.store: dist.TCPStore | None = dist.TCPStore(
            host, port, world_size, is_master=rank == 0, timeout=_TIMEOUT
        )
        prefix = dist.PrefixStore(_PREFIX, self.store)
        # Held by self.pg alone: _drop_pg's assignment is what destroys the group (module docstring, step 2).
        self.pg: _Backend | None
        if device.type == "cuda":
            # torch binds (store, rank, size, timeout=default) too (c10d/init.cpp); its stub has only `options`
            self.pg = cast(_Backend, dist.ProcessGroupNCCL(prefix, rank, world_size))  # type: ignore[call-arg]  # above
        else:
            self.pg = cast(_Backend, dist.ProcessGroupGloo(prefix, rank, world_size, _TIMEOUT))
        _OPEN.add(self)

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Root sends ``tensor``; every other rank receives into it (same shape and dtype)."""
        if self.pg is None:
            raise RuntimeError("weight sync group used after close()")
        tensor = tensor.contiguous()
        self.pg.broadcast(tensor, 0).wait()
        return tensor

    @property
    def closed(self) -> bool:
        return self.pg is None

    def close(self, timeout_s: float = 30.0) -> bool:
        """Leave the group in order (module docstring); every rank calls it, at about the same time.

        Waits at most ``timeout_s`` for the others at each of the two meeting points; a peer that is
        gone or never comes is logged, not waited for. Returns whether everyone was met. Idempotent.
        """
        if self.pg is None:
            return True
        assert self.store is not None  # let go after the group, never before (here and in abandon)
        met = self._barrier(timeout_s)
        self._drop_pg()
        if self.rank != 0:
            try:
                self.store.add(_CLOSED_KEY, 1)
            except Exception as e:  # the host is gone already: nothing left to keep in order
                log.debug("weight sync: check-out failed: %s", e)
                met = False
        else:
            met = self._wait_for_check_outs(timeout_s) and met
        self.store = None  # rank 0: the store's host goes last
        return met

    def abandon(self) -> None:
        """Step 2 alone, for a process on its way out whose peers may be gone (no meeting points)."""
        self._drop_pg()
        self.store = None

    def _barrier(self, timeout_s: float) -> bool:
        opts = dist.BarrierOptions()
        opts.timeout = datetime.timedelta(seconds=timeout_s)
        if self.device.type == "cuda":  # NCCL's barrier is an all-reduce on this rank's device
            opts.device_ids = [self.device.index or 0]
        assert self.pg is not None  # close() checked
        try:
            self.pg.barrier(opts).wait()
            return True
        except Exception as e:
            log.warning(
                "weight sync: rank %d closing without its peers (%s)", self.rank, str(e).splitlines()[0]
            )
            return False

    def _drop_pg(self) -> None:
        # The last reference: the destructor (GIL released by torch's holder) joins the worker threads.
        self.pg = None
        _OPEN.discard(self)

    def _wait_for_check_outs(self, timeout_s: float) -> bool:
        assert self.store is not None  # close() checked
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self.store.add(_CLOSED_KEY, 0) >= self.world_size - 1:
                    return True
            except Exception:
                return False
            if time.monotonic() > deadline:
                log.warning(
                    "weight sync: not every receiver checked out within %.0fs; closing the store", timeout_s
                )
                return False
            time.sleep(0.01)


@atexit.register
def _abandon_open_groups() -> None:
    """Runs before the interpreter finalizes, while worker threads can still take the GIL."""
    for group in list(_OPEN):
        group.abandon()
