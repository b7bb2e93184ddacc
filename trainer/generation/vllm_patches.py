"""kuberl's three monkey-patches, of vLLM and of torch, in one place, each checked against the versions it
was written for.

- :func:`keep_plain_weights` (vLLM, CPU engines at start-up and while a weight update's processing runs): vLLM's CPU dispatch
  (``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``) would replace each packed layer's
  weight with an empty parameter; called with ``remove_weight=False`` instead, the layer keeps it, so a
  refit can load into it (:mod:`trainer.generation.vllm_cpu`).
- :func:`one_tokenizer` (vLLM, while an engine is built): vLLM's renderer gives its tokenizer a pool of
  deep copies (``vllm.renderers.hf.maybe_make_thread_pool``, ``renderer_num_workers + 1`` of them, two at
  least) so that the threads of the server's asynchronous renderer never share one; kuberl calls its
  engines synchronously, one call at a time, and at a 262k vocabulary (Gemma 3) the copies held 0.43 GiB
  of host memory per engine.
- :func:`keep_default_group` (torch, at engine shutdown): vLLM's engine core destroys torch.distributed's
  default group whoever created it; colocated with FSDP that is the policy ranks' world, which training
  still needs.

All were read against vLLM 0.32.0 and torch 2.13.0 (:data:`PINNED`). :func:`check_versions` says in one
line, once per process, when the installed versions differ, and each patch refuses in one line when what
it replaces is no longer there as it expects.
"""

from __future__ import annotations

import contextlib
import inspect
import logging

import torch

log = logging.getLogger(__name__)

PINNED = {"vllm": "0.32.0", "torch": "2.13.0"}  # the versions both patches were read against
_checked = False


def check_versions() -> None:
    """One warning line, once per process, when vLLM or torch is not the version the patches were read against."""
    global _checked
    if _checked:
        return
    _checked = True
    import vllm

    installed = {"vllm": vllm.__version__, "torch": torch.__version__.split("+")[0]}
    differ = [
        f"{name} {installed[name]} (pinned {PINNED[name]})"
        for name in PINNED
        if installed[name] != PINNED[name]
    ]
    if differ:
        log.warning(
            "kuberl's patches of vLLM and torch (trainer/generation/vllm_patches.py) were checked against "
            "the pinned versions; installed: %s: if engines misbehave at start or shutdown, check them",
            ", ".join(differ),
        )


@contextlib.contextmanager
def keep_plain_weights(on_cpu: bool):
    """While a CPU engine loads: pack linear weights for vLLM's CPU kernels but keep the parameters too.

    vLLM's CPU dispatch would replace each packed layer's weight with an empty parameter; kept, it takes
    ``load_weights`` like any other and :func:`~trainer.generation.vllm_cpu.repack_cpu_kernels` rebuilds the kernel from it. The price
    is a second copy of the linear weights in host memory.
    """
    if not on_cpu:
        yield
        return
    from vllm.model_executor.layers import utils

    dispatch = getattr(
        utils, "dispatch_cpu_unquantized_gemm", None
    )  # looked up by each layer when it is loaded
    if dispatch is None or "remove_weight" not in inspect.signature(dispatch).parameters:
        raise RuntimeError(
            "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm(layer, remove_weight) is not there "
            f"as vLLM {PINNED['vllm']} has it: trainer/generation/vllm_patches.py needs updating for this vLLM"
        )

    def dispatch_keeping_weight(layer, remove_weight):
        return dispatch(layer, remove_weight=False)

    utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_weight
    try:
        yield
    finally:
        utils.dispatch_cpu_unquantized_gemm = dispatch


@contextlib.contextmanager
def one_tokenizer():
    """While an engine is built: its renderer keeps the one tokenizer it loaded, without a pool of copies.

    The pool exists for the threads of vLLM's asynchronous renderer (``vllm serve``); the offline ``LLM``
    renders on the calling thread (vLLM says so itself when ``renderer_num_workers`` > 1), and kuberl's
    engine is held by one caller at a time (the endpoint's gate included), so the copies are never used.
    """
    from vllm.renderers import hf

    pool = getattr(hf, "maybe_make_thread_pool", None)  # looked up by the renderer when it is built
    if pool is None or list(inspect.signature(pool).parameters)[:2] != ["tokenizer", "copies"]:
        raise RuntimeError(
            "vllm.renderers.hf.maybe_make_thread_pool(tokenizer, copies) is not there as vLLM "
            f"{PINNED['vllm']} has it: trainer/generation/vllm_patches.py needs updating for this vLLM"
        )

    def no_pool(tokenizer, copies=1):
        return tokenizer

    hf.maybe_make_thread_pool = no_pool
    try:
        yield
    finally:
        hf.maybe_make_thread_pool = pool


@contextlib.contextmanager
def keep_default_group(keep: bool):
    """While vLLM shuts down, leave torch.distributed's default group alone if ``keep``.

    The engine core's shutdown destroys the default process group whoever created it; colocated with
    FSDP that is the policy ranks' world, which training still needs. vLLM's own groups still go.
    """
    if not keep or not torch.distributed.is_available():
        yield
        return
    destroy = torch.distributed.destroy_process_group

    def destroy_all_but_default(group=None):
        if group is not None:
            destroy(group)

    torch.distributed.destroy_process_group = destroy_all_but_default
    try:
        yield
    finally:
        torch.distributed.destroy_process_group = destroy
