"""Full weights out of FSDP2's shards, for a refit: the policy's trainable parameters one FSDP unit at a
time, or its LoRA adapters alone, each handed to the reader behind the stream rule of
:mod:`trainer.policy.streams`. :meth:`trainer.policy.worker.PolicyWorker.iter_full_weights` says what a
caller may rely on; this module is how it is done.

A refit carries what the optimizer can change: a frozen parameter (``policy.freeze``, a LoRA base) holds
the value the engine was built with, from the same checkpoint, for the whole run, so sending it would
move the same bytes every step (Gemma 3's vision tower: 0.42B parameters). A unit with nothing trainable
is not even gathered.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.policy import streams


def fsdp_units(model: torch.nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def reshard(model: torch.nn.Module) -> None:
    """Free gathered weights (a no-op on units already sharded): before state dicts and loads."""
    for unit in fsdp_units(model):
        unit.reshard()


def params_by_unit(model: torch.nn.Module, trainable: bool = False) -> list[tuple[Any, list[str]]]:
    """(FSDP unit, the names of the parameters it manages), units in module order; ``None`` first for
    parameters no unit manages. A parameter belongs to its innermost unit: a unit gathers only its
    own parameters, not its child units'. ``trainable``: only parameters that require a gradient, and
    only the units that hold one."""
    from torch.distributed.fsdp import FSDPModule

    units = [(prefix, m) for prefix, m in model.named_modules() if isinstance(m, FSDPModule)]
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters():
        if trainable and not p.requires_grad:
            continue
        owner = max(
            (i for i, (prefix, _) in enumerate(units) if not prefix or name.startswith(prefix + ".")),
            key=lambda i: len(units[i][0]),
            default=None,
        )
        groups.setdefault(-1 if owner is None else owner, []).append(name)
    loose = [(None, groups.pop(-1))] if -1 in groups else []
    return loose + [(units[i][1], groups[i]) for i in sorted(groups)]


@torch.no_grad()
def gather_units(
    model: torch.nn.Module,
    fence: streams.NoStreams | streams.CudaStreams,
    dtype: torch.dtype | None,
    resharding: bool,
    trainable: bool = True,
):
    """Yield (name, full tensor) unit by unit, the next unit's gather in flight while the caller reads the
    current one; ``resharding``: free each unit once its tensors are yielded (``policy.reshard_after_forward``);
    ``trainable``: the trainable parameters alone (:func:`params_by_unit`), else every one."""
    groups = params_by_unit(model, trainable)
    pending = None
    try:
        with fence.producing():
            if groups and groups[0][0] is not None:
                pending = groups[0][0].unshard(async_op=True)
        for i, (unit, names) in enumerate(groups):
            with fence.producing():
                if pending is not None:
                    pending.wait()  # copies the unit out on the home stream
                nxt = groups[i + 1][0] if i + 1 < len(groups) else None
                pending = nxt.unshard(async_op=True) if nxt is not None else None  # prefetch: one unit ahead
            for name in names:
                with fence.producing():
                    p = model.get_parameter(name).detach()  # after unshard: the unit's full tensor
                    if hasattr(p, "full_tensor"):  # not gathered by a unit (e.g. no FSDP at all): its own
                        p = p.full_tensor()
                    if dtype is not None and p.dtype != dtype:
                        p = p.to(dtype)  # a tensor of its own
                    elif resharding and unit is not None:
                        # The unit's gathered buffer is freed below, and a caller may hold tensors across
                        # units (vLLM's packed NCCL sender keeps a bucket's views until it sends them).
                        p = p.clone()
                yield name, fence.hand_over(p)
            if resharding and unit is not None:
                with fence.producing():
                    unit.reshard()
    finally:
        with fence.producing():
            if pending is not None:
                pending.wait()  # a gather in flight must land before its buffers are freed
            if resharding:
                reshard(model)


@torch.no_grad()
def gather_adapters(
    model: torch.nn.Module, fence: streams.NoStreams | streams.CudaStreams, dtype: torch.dtype | None
):
    """Yield (name, full tensor) for every trainable (adapter) parameter, each gathered on its own."""
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        with fence.producing():
            t = p.detach()
            t = t.full_tensor() if hasattr(t, "full_tensor") else t.clone()
            if dtype is not None and t.dtype != dtype:
                t = t.to(dtype)
        yield name, fence.hand_over(t)
