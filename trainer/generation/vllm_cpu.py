"""What vLLM's CPU build needs from us, beside the engine (:mod:`trainer.generation.vllm_engine`): the
process environment an in-process CPU engine starts under, its thread count noted at packing, and the
rebuild of its packed GEMM kernels after a weight update. None of it runs for a GPU engine.

vLLM's CPU linear layers run packed kernels (a oneDNN handle, or vLLM's own layout for bf16 on AMX CPUs)
derived from each weight at load. Started under :func:`trainer.generation.vllm_patches.keep_plain_weights`
the engine keeps the plain parameters too, so an update loads into them as on a GPU and
:func:`repack_cpu_kernels` then rebuilds every kernel, the tied ``lm_head``'s included, at the thread
count the kernels were first packed at (:func:`at_pack_threads`): rebuilt at another count, the handles
computed wrong q/k/v projections, which nothing reports (bench/README.md, "vLLM on CPU").
"""

from __future__ import annotations

import contextlib
import os

import torch

# Where the engine notes, on its model, the torch thread count its CPU kernels were packed at (module
# docstring; the measurement that found it is in bench/README.md, "vLLM on CPU").
PACK_THREADS_ATTR = "kuberl_pack_threads"
# KV cache on CPU, GiB, unless VLLM_CPU_KVCACHE_SPACE is set: 1 GiB holds 1M tokens of the tiny model and
# 45k of SmolLM2-135M in float32, far more than a GRPO batch needs.
CPU_KV_CACHE_GIB = 1


def environment(cache_root: str) -> None:
    """Set the process environment a CPU engine starts under (before ``import vllm``: the engine core's
    mode is fixed at construction; setdefault keeps what an operator set), its ``VLLM_CACHE_ROOT`` the
    engine's own directory (:func:`trainer.generation.vllm_lifetime.private_dir`), which it removes at
    shutdown."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(CPU_KV_CACHE_GIB))
    # A core list only takes effect in vLLM's multiprocess executor (it sets OMP variables for the workers
    # it spawns); in-process the engine uses this process's threads, which Ray or the policy worker
    # already placed, so binding is left to them.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ["VLLM_CACHE_ROOT"] = cache_root  # compile caches: per engine
    if modelinfos := shared_modelinfo_dir():  # vLLM writes each file atomically: engines may share it
        os.symlink(modelinfos, os.path.join(cache_root, "modelinfos"))


def shared_modelinfo_dir() -> str | None:
    """Where a CPU engine's private ``VLLM_CACHE_ROOT`` finds vLLM's model-info cache, shared by every
    engine on this machine: ``$KUBERL_CACHE/vllm/modelinfos`` (default ``~/.cache/kuberl``); None if it
    cannot be created (the engine then inspects the model itself).

    At start vLLM inspects the model's class in a fresh Python process that imports vLLM again (its
    registry's ``_run_in_subprocess``, there so that inspecting never initialises CUDA), unless
    ``VLLM_CACHE_ROOT/modelinfos`` holds the answer, a JSON file keyed by a hash of the model module's
    source. A private, empty root paid that subprocess at every start, most of a tiny model's engine
    start (bench/README.md, "Why the code is as it is"). The compile caches stay private to the engine."""
    from trainer.models.resolve import cache_root

    path = cache_root().parent / "vllm" / "modelinfos"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return str(path)


def weights_packed(model: torch.nn.Module) -> bool:
    """Whether some layer keeps its weight only in a kernel's packed form (an empty parameter left behind).

    Such a layer cannot take ``load_weights`` directly; layerwise reload rebuilds it from the new tensors.
    An engine started under :func:`keep_plain_weights` has none.
    """
    return any(p.numel() == 0 for p in model.parameters())


@contextlib.contextmanager
def at_pack_threads(model: torch.nn.Module):
    """Torch at the thread count the model's CPU kernels were packed at (``PACK_THREADS_ATTR``), if noted."""
    threads = getattr(model, PACK_THREADS_ATTR, None)
    if threads is None:  # not noted (a spawned tensor-parallel worker, whose count vLLM fixed): as it is
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def repack_cpu_kernels(model: torch.nn.Module) -> None:
    """Rebuild each CPU GEMM kernel from its layer's (updated) weight; nothing on GPU engines, whose
    layers have none.

    Call it under :func:`at_pack_threads` (as :func:`finish_weight_update` does). A plain embedding's
    kernel is never used for a matmul and is skipped, unless the model uses it as lm_head.
    """
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    lm_head = getattr(model, "lm_head", None)
    for layer in model.modules():
        if (
            not hasattr(layer, "cpu_linear")
            or getattr(layer, "weight", None) is None
            or layer.weight.ndim != 2
        ):
            continue
        if (
            isinstance(layer, VocabParallelEmbedding)
            and not isinstance(layer, ParallelLMHead)
            and layer is not lm_head
        ):
            continue
        dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
