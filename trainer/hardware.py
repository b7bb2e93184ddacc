"""What this machine's CPU can do, asked once: the probes behind ``auto`` precision and every fast
path whose support depends on the instruction set.

CPUs differ in what bfloat16 costs. With AVX512-BF16 or AMX (Intel Sapphire Rapids, AMD Zen 4 and
later) a bf16 matmul runs natively and about twice as fast as float32; with AVX2 only (most laptops
and AMD servers before Zen 4) torch converts every bf16 operand to float32 and back, so bf16 is
several times *slower* than float32. oneDNN's prepacked bf16 linear ops (``trainer.generation.onednn_linear``)
are a third capability: they need AVX512BW/VL/DQ or AVX-NE-CONVERT and raise without them.

The probes are plain functions so tests can replace them (``monkeypatch.setattr``) to take the path
of a CPU they do not run on.
"""

from __future__ import annotations

import functools
import platform


@functools.cache
def cpu_model() -> str:
    """The CPU's marketing name (``/proc/cpuinfo``'s ``model name``), or what the platform reports."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_isa() -> str:
    """torch's best vector instruction set here: ``AVX512``, ``AVX2``, ``DEFAULT`` (or ``NEON`` on ARM)."""
    import torch

    try:
        return torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return "unknown"


def native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX), not by emulation."""
    import torch

    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except (AttributeError, RuntimeError):  # a torch without the probes: assume the common case
        return False


def onednn_bf16() -> bool:
    """Whether oneDNN can reorder and run bfloat16 linear weights (AVX512BW/VL/DQ or AVX-NE-CONVERT)."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def describe() -> str:
    """One phrase for logs and benchmark tables, e.g. ``AMD EPYC (AVX2, no native bfloat16)``."""
    bf16 = "native bfloat16" if native_bf16() else "no native bfloat16"
    return f"{cpu_model()} ({cpu_isa()}, {bf16})"
