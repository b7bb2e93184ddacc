"""What vLLM's CPU build needs from us, beside the engine (:mod:`trainer.generation.vllm_engine`): the
process environment an in-process CPU engine starts under, its thread count noted at packing, and what a
weight update must redo on CPU. None of it runs for a GPU engine.

vLLM's CPU linear layers run packed kernels (a oneDNN handle, or vLLM's own layout for bf16 on AMX CPUs)
derived from each weight at load. Started under :func:`trainer.generation.vllm_patches.keep_plain_weights`
the engine keeps the plain parameters too, so an update loads into them (directly, or through vLLM's
layerwise reload, whose processing runs under the same patch: :func:`weight_processing`) and
:func:`repack_cpu_kernels` then rebuilds every kernel, the tied ``lm_head``'s included, at the thread
count the kernels were first packed at (:func:`at_pack_threads`): rebuilt at another count, the handles
computed wrong q/k/v projections, which nothing reports (bench/README.md, "vLLM on CPU").

Mixture-of-experts layers (``UnquantizedFusedMoEMethod``) pack their expert weights into the CPU grouped-GEMM
layout at load, and vLLM 0.32 skips that packing when the layer is processed again for a weight update (it
rebuilds nothing once the layer has a kernel, a rule written for GPUs, whose layout conversion runs before
it): the experts then hold checkpoint-layout bytes where the kernel reads packed ones, and the engine samples
from them without an error (gaps of 1 nat on a tiny Qwen3-MoE). :func:`repack_cpu_experts` packs them again.
"""

from __future__ import annotations

import contextlib
import os

import torch

from trainer.generation import vllm_patches
from trainer.models.loading import DTYPES
from trainer.models.shape import attention_geometry

# Where the engine notes, on its model, the torch thread count its CPU kernels were packed at (module
# docstring; the measurement that found it is in bench/README.md, "vLLM on CPU").
PACK_THREADS_ATTR = "kuberl_pack_threads"
# The thread count the first CPU engine of this process packed its kernels at: every later engine packs at
# it too (:func:`pack_threads`).
_process_pack_threads: int | None = None
# KV cache on CPU, GiB, unless VLLM_CPU_KVCACHE_SPACE is set or generation.vllm_kwargs.kv_cache_memory_bytes
# says otherwise (:func:`kv_cache_kwargs`): 1 GiB holds 1M tokens of the tiny model and 45k of SmolLM2-135M in
# float32, far more than a GRPO batch needs. An engine that knows how many sequences one call holds takes
# no more than they fill (:func:`step_kv_bytes`), and this at most.
CPU_KV_CACHE_GIB = 1
# vLLM's CPU backend keeps keys and values in blocks of this many tokens unless vllm_kwargs.block_size says
# otherwise (vllm/platforms/cpu.py, 0.32: 128 for plain attention): a sequence holds whole blocks.
CPU_KV_BLOCK = 128


def environment(cache_root: str) -> None:
    """Set the process environment a CPU engine starts under (before ``import vllm``: the engine core's
    mode is fixed at construction; setdefault keeps what an operator set), and link the shared model-info
    cache into ``cache_root``, the engine's own directory (:func:`trainer.generation.vllm_lifetime.private_dir`),
    which ``VLLM_CACHE_ROOT`` names (:func:`trainer.generation.vllm_lifetime.enter_environment`) and which
    it removes at shutdown."""
    # A core list only takes effect in vLLM's multiprocess executor (it sets OMP variables for the workers
    # it spawns); in-process the engine uses this process's threads, which Ray or the policy worker
    # already placed, so binding is left to them.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if modelinfos := shared_modelinfo_dir():  # vLLM writes each file atomically: engines may share it
        os.symlink(modelinfos, os.path.join(cache_root, "modelinfos"))


def kv_cache_kwargs(step_bytes: int | None = None) -> dict:
    """The KV cache's size for ``vllm.LLM`` on CPU as ``kv_cache_memory_bytes``: ``step_bytes``
    (:func:`step_kv_bytes`) up to ``CPU_KV_CACHE_GIB``, or that when the engine does not know its step.
    ``generation.vllm_kwargs`` may override it in bytes (vLLM's own ``VLLM_CPU_KVCACHE_SPACE`` takes whole
    GiB, and wins over both when an operator sets it)."""
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return {}
    most = CPU_KV_CACHE_GIB * 2**30
    return {"kv_cache_memory_bytes": most if step_bytes is None else min(step_bytes, most)}


def step_kv_bytes(
    per_token: int | None, sequences: int | None, max_model_len: int | None, block: int | None = None
) -> int | None:
    """The KV cache that holds one call of the engine at once: ``sequences`` sequences of ``max_model_len``
    tokens, each in whole blocks of ``block`` tokens (``CPU_KV_BLOCK``), at ``per_token`` bytes a token
    (:func:`kv_bytes_per_token`). None when any count is unknown; :func:`kv_cache_kwargs` then takes its
    default. A smaller cache would not be wrong, only slower: vLLM then runs a call's sequences in turns."""
    if not per_token or not sequences or not max_model_len:
        return None
    block = block or CPU_KV_BLOCK
    return sequences * -(-max_model_len // block) * block * per_token


def kv_bytes_per_token(config, dtype: str) -> int | None:
    """Keys and values of one token over every layer of ``config`` (a transformers config; a multimodal one's
    text config) in ``dtype``; None where the cache is not keys and values per KV head (MLA's latent cache)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "kv_lora_rank", None) or dtype not in DTYPES:
        return None
    try:
        layers, kv_heads, head_dim = attention_geometry(config)
    except AttributeError:  # no attention heads to count
        return None
    return 2 * layers * kv_heads * head_dim * DTYPES[dtype].itemsize


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
def weight_processing(model: torch.nn.Module, plain: bool):
    """What vLLM's weight processing runs under while an update loads and finishes, on CPU: torch at the
    thread count the kernels were packed at (:func:`at_pack_threads`), and, when the layers kept their plain
    weights at start-up (``plain``: not :func:`weights_packed`, seen before the update began), vLLM's CPU
    GEMM dispatch keeping them again (:func:`~trainer.generation.vllm_patches.keep_plain_weights`). Without
    it, layerwise reload's processing would leave an empty weight to copy into the full one it replaces
    (a size-mismatch error); a model that packed without the patch keeps empty ones, and so does its
    processing. Nothing on GPUs."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        yield
        return
    with at_pack_threads(model), vllm_patches.keep_plain_weights(plain):
        yield


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


@contextlib.contextmanager
def pack_threads():
    """Torch at the thread count this process's CPU kernels are packed at while an engine builds, and that
    count noted for the rest of the process (yields it).

    vLLM's oneDNN GEMM keeps one process-wide cache of matmul primitives, keyed by the shapes and not by the
    layout the weight was packed in, and under AVX2 that layout depends on the thread count at packing. A
    second engine packed at another count than the first then runs its same-shaped layers through the first
    one's primitives, on weights it packed differently: builtin:tiny's ``qkv_proj`` (192x64, as a tiny
    Qwen3-MoE's) gave 0.26 nats from transformers, every time, built at 1 thread after an engine built at 2
    had run (``ONEDNN_MAX_CPU_ISA=AVX2``; exact with AVX-512 kernels, and exact at one count). So the first
    engine's count holds for every engine of the process; the engine runs at its own count afterwards."""
    global _process_pack_threads
    before = torch.get_num_threads()
    if _process_pack_threads is not None:
        torch.set_num_threads(_process_pack_threads)
    try:
        yield torch.get_num_threads()
    finally:
        if _process_pack_threads is None:
            _process_pack_threads = torch.get_num_threads()
        torch.set_num_threads(before)


def repack_cpu_kernels(model: torch.nn.Module) -> None:
    """Rebuild each CPU GEMM kernel from its layer's (updated) weight; nothing on GPU engines, whose
    layers have none.

    Call it under :func:`at_pack_threads` (as :func:`finish_weight_update` does). A plain embedding's
    kernel is never used for a matmul and is skipped, unless the model uses it as lm_head. Only layers
    whose method is vLLM's unquantized linear or embedding one are vLLM's CPU GEMM's (a quantized layer's
    processing is its own), and not one vLLM keeps on the plain matmul (``_cpu_skip_gemm_dispatch``, MLA's
    ``kv_b_proj``).
    """
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    lm_head = getattr(model, "lm_head", None)
    for layer in model.modules():
        if (
            not hasattr(layer, "cpu_linear")
            or not isinstance(
                getattr(layer, "quant_method", None), (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)
            )
            or getattr(layer, "_cpu_skip_gemm_dispatch", False)
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


def repack_cpu_experts(model: torch.nn.Module) -> int:
    """Pack each CPU mixture-of-experts layer's expert weights again (module docstring), from the
    checkpoint-layout values an update left in them; returns how many layers. Nothing on GPU engines,
    whose experts are not CPU kernels.

    The experts' own ``process_weights_after_loading`` does it, as at load: vLLM's CPU packing keeps each
    tensor's shape, so it reads the values an update copied in place. A layer whose intermediate size the
    kernel pads is not reached: its update fails earlier, in vLLM's reload, with a size mismatch."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    packed = 0
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        if not isinstance(method, UnquantizedFusedMoEMethod) or method.moe_kernel is None:
            continue
        experts = method.moe_kernel.fused_experts
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(layer)
            packed += 1
    return packed
