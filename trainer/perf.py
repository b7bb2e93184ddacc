"""How fast a step ran against what the hardware could do: model FLOPs, device peaks, peak memory.

Model FLOPs utilisation (MFU) of training is the FLOPs the model needs for the tokens trained on,
over the train time and the devices' peak. The model's FLOPs, per token trained:

- **6 x N** for the matmuls, N the parameters every token multiplies by (the decoder's linear layers
  and the LM head: with tied embeddings that is every parameter but the norms, untied it leaves out
  the input embedding, which is a lookup); 2N forward, 4N backward (gradients of the activations and
  of the weights). A frozen base (LoRA) computes no weight gradients: 4 x N, the adapters' own FLOPs
  being negligible. The LM head's share (hidden x vocab) counts only on the positions the policy
  projects to the vocabulary, those that predict a response token: the prompt's positions go through
  the decoder and stop there (:class:`trainer.policy.batch.PackedBatch`). Counting the head on every
  token overstated MFU by about 5 % for a 1.5B model on long prompts, more for a large vocabulary.
  In a mixture of experts N counts the parameters a token is routed through: in each MoE layer the
  router (hidden x experts) and its top-k experts (and a shared expert), not the experts it skips,
  which the model holds and trains but the token never multiplies by. Qwen3-30B-A3B: 3.0B matmul
  parameters of its 30.2B (3.35B of 30.5B parameters in all); counting every expert would overstate
  its linear layers' FLOPs nearly 10-fold.
- **attention**: per layer and head, QK^T and AV cost 2 x head_dim FLOPs each per (query, key) pair
  forward, three times that forward and backward: 12 x layers x heads x head_dim x pairs, where a
  causal sample of L tokens has L (L + 1) / 2 pairs. (PaLM's appendix and verl's counter take L^2,
  as if attention were not causal; that is a few percent more at these lengths.)

Neither recomputation (activation checkpointing) nor the padding a layout adds counts: MFU measures
the model's work, not the hardware's. A prompt computed once for its whole group
(``policy.shared_prefix`` on CPU) counts once per sample, as the work it stands for.

The peak is a table of the common GPUs' dense bf16 tensor-core peaks (NVIDIA's data sheets, without
sparsity) and, on a CPU, a matmul measured once on this process's threads: a CPU's datasheet peak
depends on clocks and instruction mix nobody reports, and a measured one is what a matmul here
reaches. MFU on a CPU is therefore against a practical peak, and reads higher than on a GPU.

Peak memory per rank is CUDA's max allocated since the last reading, or on a CPU the process's peak
resident set (``VmHWM``) since the last reading (reset through ``/proc/self/clear_refs``).
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass

# Dense bf16 tensor-core peaks per GPU, FLOP/s (NVIDIA data sheets, no sparsity). Matched in order
# against torch.cuda.get_device_name(): "H100 PCIe" before "H100", "L40S" before "L4".
GPU_PEAK_BF16: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989.4e12),  # SXM5 (e.g. "NVIDIA H100 80GB HBM3")
    ("H200", 989.4e12),  # the H100's compute with more, faster memory
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("A100", 312e12),
    ("L40S", 362.05e12),
    ("L4", 121e12),
)


@dataclass(frozen=True)
class ModelFlops:
    """What a decoder's training FLOPs depend on (from :func:`trainer.models.shape.model_shape` or by hand)."""

    matmul_params: int  # N: parameters every token multiplies by (linear layers + LM head)
    layers: int
    heads: int
    head_dim: int
    head_params: int = 0  # of matmul_params, the LM head's (hidden x vocab): only projected positions pay it
    # A mixture of experts' matmul weights a token is not routed to (experts - top_k of each MoE layer's
    # experts): held and trained, outside matmul_params. 0 for a dense model.
    unrouted_params: int = 0

    @property
    def total_matmul_params(self) -> int:
        """Every matmul weight the model holds (every expert), the LM head included."""
        return self.matmul_params + self.unrouted_params

    @classmethod
    def of(
        cls,
        hidden: int,
        intermediate: int,
        layers: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        vocab: int,
        moe=None,
    ) -> ModelFlops:
        """A Llama-style decoder (q, k, v, o projections; gated MLP of three matrices; LM head). ``moe``: a
        mixture of experts' routing (:class:`trainer.models.shape.MoE`, or anything with its fields): its
        ``layers`` MoE layers have, in place of the dense MLP, a router (hidden x experts), ``experts`` gated
        MLPs of width ``intermediate`` of which a token goes through ``top_k``, and a shared expert of
        width ``shared_intermediate`` with its one-output gate (Qwen2-MoE; 0: none)."""
        attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q and o: heads; k and v: kv_heads
        mlp = 3 * hidden * intermediate  # gate, up, down
        head = hidden * vocab
        if moe is None:
            return cls(layers * (attention + mlp) + head, layers, heads, head_dim, head)
        expert = 3 * hidden * moe.intermediate
        shared = 3 * hidden * moe.shared_intermediate + (hidden if moe.shared_intermediate else 0)
        routed = hidden * moe.experts + moe.top_k * expert + shared  # what one token multiplies by
        active = layers * attention + (layers - moe.layers) * mlp + moe.layers * routed + head
        unrouted = moe.layers * (moe.experts - moe.top_k) * expert
        return cls(active, layers, heads, head_dim, head, unrouted)

    @classmethod
    def from_shape(cls, shape) -> ModelFlops:
        """From :class:`trainer.models.shape.Shape` (the text decoder's dimensions, its experts' routing).
        Raises ValueError for a mixture of experts whose routing the shape could not read (``moe_error``):
        no MFU rather than one counted as if every expert ran."""
        if getattr(shape, "moe_error", ""):
            raise ValueError(shape.moe_error)
        return cls.of(
            shape.hidden,
            shape.intermediate,
            shape.layers,
            shape.heads,
            shape.kv_heads,
            shape.head_dim,
            shape.vocab,
            getattr(shape, "moe", None),
        )

    def training(
        self, lengths: Iterable[int], frozen_base: bool = False, projected: int | None = None
    ) -> float:
        """FLOPs of one forward and backward over samples of these lengths (prompt + response tokens), of
        which ``projected`` positions go through the LM head (the response tokens; None: every token)."""
        lengths = list(lengths)
        tokens = sum(lengths)
        pairs = sum(n * (n + 1) // 2 for n in lengths)  # causal (query, key) pairs
        head = tokens if projected is None else projected
        per_param = 4 if frozen_base else 6
        linear = per_param * ((self.matmul_params - self.head_params) * tokens + self.head_params * head)
        return float(linear + 12 * self.layers * self.heads * self.head_dim * pairs)


def gpu_peak_flops(device_name: str) -> float | None:
    """The table's bf16 peak for a GPU named like ``torch.cuda.get_device_name()``, or None."""
    for key, peak in GPU_PEAK_BF16:
        if re.search(rf"\b{re.escape(key)}\b", device_name):
            return peak
    return None


@functools.cache
def measured_matmul_peak(dtype_name: str = "float32", n: int = 1024, seconds: float = 0.3) -> float:
    """The best FLOP/s of an n x n matmul here, on this process's torch threads, measured once per dtype."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, dtype_name)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.mm(a, b)  # warm-up: thread pool, kernels chosen
    sync()
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end or best == 0.0:
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync()
        best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    return best


def device_peak_flops(device, compute_dtype: str | None) -> tuple[float, str]:
    """The peak FLOP/s of ``device`` (a torch.device) for the policy's compute dtype, and where it came
    from: the bf16 table for a GPU it names, else a matmul measured here."""
    import torch

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_flops(name)
        if peak is not None:
            return peak, f"{name}: {peak / 1e12:.0f} TFLOP/s bf16 (table)"
        dtype = compute_dtype if compute_dtype in ("bfloat16", "float16") else "float32"
        peak = measured_matmul_peak(dtype, n=4096)
        return peak, f"{name}: {peak / 1e12:.0f} TFLOP/s {dtype} (measured matmul; not in the table)"
    dtype = compute_dtype if compute_dtype in ("bfloat16", "float16") else "float32"
    threads = torch.get_num_threads()
    peak = measured_matmul_peak(dtype)
    return (
        peak,
        f"CPU, {threads} thread{'s' * (threads > 1)}: {peak / 1e9:.1f} GFLOP/s {dtype} (measured matmul)",
    )


def peak_memory_bytes(device) -> float:
    """This process's peak memory on ``device`` since the last call (CUDA's max allocated, or the CPU
    resident set's high-water mark), then a reset so the next call reports the next interval's."""
    import torch

    if device.type == "cuda":
        peak = float(torch.cuda.max_memory_allocated(device))
        torch.cuda.reset_peak_memory_stats(device)
        return peak
    try:
        with open("/proc/self/status") as f:
            hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):  # not Linux: the process's lifetime peak (KiB on Linux, bytes on macOS)
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return float(peak if sys.platform == "darwin" else peak * 1024)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        pass  # then the high-water mark is the process's since it started
    return float(hwm)


def mfu(flops: float, seconds: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: the FLOPs done in ``seconds`` over what ``peak_flops`` (all devices) allow."""
    return flops / max(seconds, 1e-9) / peak_flops if peak_flops > 0 else 0.0
