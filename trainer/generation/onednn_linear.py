"""oneDNN-prepacked linear layers for decoding bfloat16 models on CPU.

A decode step multiplies a handful of rows (one token per sequence) by every weight matrix of the
model, so it is bound by how fast the weights stream through the core, not by arithmetic. Reordered
once into oneDNN's blocked layout, the bfloat16 weights stream faster than through ``F.linear``, with
identical logits (the figures: bench/README.md, "Why the code is as it is").

The packed copy is derived from the weights, so it is rebuilt after every weight update (:func:`repack`). Anything else keeps the plain forward: float32,
GPUs, a torch without the oneDNN ops, and CPUs whose instruction set oneDNN's bf16 reorder does not
support (AVX2 only: it needs AVX512BW/VL/DQ or AVX-NE-CONVERT, :func:`trainer.hardware.onednn_bf16`).
Should the reorder still raise, :func:`pack` undoes itself and says so once.
"""

from __future__ import annotations

import logging
import types

import torch

from trainer import hardware

log = logging.getLogger(__name__)

_PACKED = "_kuberl_packed_weight"
_HINT = "_kuberl_rows_hint"


def available(model: torch.nn.Module) -> bool:
    """bfloat16 weights on CPU, a torch build with oneDNN's linear ops, and a CPU they run on."""
    try:
        param = next(model.parameters())
    except StopIteration:
        return False
    return (
        param.device.type == "cpu"
        and param.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hardware.onednn_bf16()
    )


def _packed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    packed = getattr(self, _PACKED, None)
    if packed is None or torch.is_grad_enabled():  # not packed yet, or autograd wants the real weight
        return torch.nn.functional.linear(x, self.weight, self.bias)
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, self.bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])


def pack(model: torch.nn.Module, rows_hint: int) -> int:
    """Pack every ``nn.Linear`` of ``model`` for about ``rows_hint`` rows per call; returns how many.

    Returns 0, with the plain forward restored, when oneDNN refuses the bf16 reorder on this CPU.
    """
    count = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.weight.dtype == torch.bfloat16:
            setattr(module, _HINT, rows_hint)
            # The instance's own forward, shadowing the class's until unpack deletes it.
            module.forward = types.MethodType(_packed_forward, module)  # type: ignore[method-assign]  # meant
            count += 1
    try:
        repack(model)
    except RuntimeError as e:  # the capability probe said yes, the op says no: keep what works
        unpack(model)
        log.warning(
            "oneDNN cannot prepack bfloat16 linear weights on %s (%s); decoding with the plain forward",
            hardware.describe(),
            str(e).splitlines()[0],
        )
        return 0
    return count


def unpack(model: torch.nn.Module) -> None:
    """Back to the plain ``nn.Linear`` forward everywhere."""
    for module in model.modules():
        if getattr(module, _HINT, None) is not None:
            del module.forward  # the instance attribute; the class's forward shows again
            for attr in (_HINT, _PACKED):
                if hasattr(module, attr):
                    delattr(module, attr)


def reorder(weight: torch.Tensor, rows_hint: int) -> torch.Tensor:
    """oneDNN's blocked layout of a bf16 ``weight`` (out, in) for about ``rows_hint`` rows per call."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)


@torch.no_grad()
def repack(model: torch.nn.Module) -> None:
    """Rebuild the packed weights from the current ones (after the weights changed)."""
    for module in model.modules():
        hint = getattr(module, _HINT, None)
        if hint is not None:
            assert isinstance(module, torch.nn.Linear)  # pack hints linear layers alone
            setattr(module, _PACKED, reorder(module.weight.detach(), hint))
