"""FSDP2 policy workers: one Ray actor per rank, together one torch.distributed group.

Each rank holds a shard of the policy (``fully_shard`` on every decoder layer, then the root; built on
the meta device and sharded before any weight is loaded, :mod:`trainer.policy.sharded_init`), its
optimizer state, and optionally a frozen, sharded reference model for the KL penalty (none at all
when the penalty is 0). With ``policy.lora`` the policy carries adapters (:mod:`trainer.models.lora`):
the base weights stay frozen and sharded, the optimizer holds the adapters alone, the reference is the
policy with its adapters off (no second model), and refits and checkpoints carry only the adapters.
Parameters named by ``policy.freeze`` (e.g. a vision tower a text-only run never reaches) stay frozen:
no optimizer state, and no refit carries them (:mod:`trainer.policy.gather`).
Every method that touches the sharded model is a collective: the driver calls it on all ranks at once
with equally sized shards of the batch, and each rank runs the same number of micro-batches (with a
token budget the ranks agree on the largest count first). Micro-batches are packed rows by default
(:class:`~trainer.policy.batch.PackedBatch`): no attention mask, per-sample position ids; attention stays
within each sample at the cost of its own pairs (:mod:`trainer.policy.packed_attention`: sdpa once per
sample; with flash attention, its varlen call), and with ``policy.sequence_parallel_size`` each rank holds
a slice of every row (:mod:`trainer.policy.ulysses`).

With colocated generation each rank also owns a generation engine (built by
:mod:`trainer.generation.factory`; the hf engine copies the rank's already loaded weights). The rank
sets its memory order, the same calls on every device (on CPU the engines free nothing):

1. the engine generates (one call per rollout turn or dynamic-sampling round, and for validation);
2. the rank's first forward after that (a logprob pass, else training) puts the engine to sleep, so
   the policy's forwards get the device;
3. after the optimizer step the refit: ``torch.cuda.empty_cache()``, wake the engine's weights, load the
   full weights gathered through FSDP2 one unit at a time, ``empty_cache()`` again, wake its KV cache.

With disaggregated generation rank 0 broadcasts the gathered weights to the generation actors over a
separate process group (:mod:`trainer.generation.refit.group`).

The actor's methods are thin where the work has a module of its own: the logprob forward in each layout
(:mod:`trainer.policy.forward`), the refit's gather (:mod:`trainer.policy.gather`), the colocated engine's
build and refit order (:mod:`trainer.policy.colocated`), the DCP checkpoint (:mod:`trainer.policy.dcp`).
"""

from __future__ import annotations

from trainer import heap

# A rank's process imports this module (Ray, to create the actor) before PolicyWorker.__init__ runs, and the
# imports below (torch, transformers) make millions of long-lived objects that each collection would walk:
# so the collector pauses here, before them, when this process is a rank being created, and __init__
# settles (trainer.heap). There is no earlier place in a rank's process to say it.
# ruff: noqa: E402
heap.pause_for_actor("trainer.policy.worker.PolicyWorker")

import datetime
import functools
import logging
import math
import os
import time
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from trainer.algorithms.objective import LossInputs, Objective
from trainer.config import Config
from trainer.generation.base import Completion, SamplingParams
from trainer.models import DTYPES, build_empty_model, load_model, load_tokenizer, moe
from trainer.policy import colocated, dcp, forward, gather, streams
from trainer.policy.batch import (
    Batch,
    Sample,
    budget_micro_batches,
    layout,
    prefers_prefix,
    split_to_count,
)
from trainer.policy.packed_attention import PackedAttention
from trainer.policy.sharded_init import load_shards

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule
    from transformers import PreTrainedModel

    from trainer.generation.base import GenerationEngine
    from trainer.policy.ulysses import SequenceParallelGroup

log = logging.getLogger(__name__)

# What a rank's set-up imports anyway, imported before the rank freezes its heap (trainer.heap).
RANK_IMPORTS = ("transformers.modeling_utils", "torch.distributed.fsdp", "torch.distributed.checkpoint")


def shard_model(
    model: torch.nn.Module,
    reshard_after_forward: bool,
    mp_dtype: torch.dtype | None,
    *,
    compile_blocks: bool = False,
    reshard_root: bool | None = None,
) -> int:
    """FSDP2: each transformer block is its own unit, so only one block is gathered at a time; the number
    of blocks. ``reshard_after_forward`` is the blocks'. The root (embeddings, final norm, lm_head: 233M
    parameters at Gemma 3 sizes, tied) keeps FSDP2's own default unless ``reshard_root`` says otherwise:
    gathered from its forward to its backward, which reads the head's weight right after the forward ends,
    so a training micro-batch gathers it once instead of twice, and a logprob pass keeps it across its
    micro-batches. The backward reshards it; a pass without a backward leaves it gathered until the
    training step's backward, or until :meth:`PolicyWorker.train` reshards it before an optimizer step
    that had no backward to do so. ``compile_blocks``: each block's forward is compiled
    (:func:`compile_block`) before ``fully_shard`` wraps the block, as torchtitan orders them."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = (
        MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=torch.float32)
        if mp_dtype
        else MixedPrecisionPolicy()
    )
    block_types = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in block_types]
    for block in blocks:
        if compile_blocks:
            compile_block(block)
        fully_shard(block, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    fully_shard(model, reshard_after_forward=reshard_root, mp_policy=mp)
    return len(blocks)


def compile_block(block: torch.nn.Module) -> None:
    """Regional torch.compile: the block's ``forward`` becomes one compiled function, shared by every block
    of its class (dynamo lifts a module's parameters to graph inputs, so the blocks reuse one graph).

    The forward, not the whole ``__call__``: FSDP2's hooks (the all-gather before, the reshard after) and a
    checkpointed layer's ``__call__`` stay eager around it, as dynamo would run them anyway
    (``skip_fsdp_hooks``), and a pre-hook of ours marks the sequence dimension of the block's inputs
    dynamic before the compiled forward sees them: packed rows change length every micro-batch, and with
    the mark the graph before the attention is compiled once for any length (unmarked, dynamo compiles the
    first length, then again for any once it sees another; the pieces after the attention, whose output
    is a new tensor, still do that, once). The attention call is left out of the graph
    (:func:`trainer.policy.packed_attention.attention` is never compiled): a packed row's per-sample loop
    reads the row's boundaries as numbers, which a graph would specialise on, recompiling for every new
    set of lengths. Every layout runs compiled (packed, padded, the shared prompt's KV cache), under
    activation checkpointing, with LoRA adapters and with Ulysses sequence parallelism (its all-to-alls
    are in the eager attention)."""
    block.register_forward_pre_hook(_mark_sequence_dynamic, with_kwargs=True)
    block.forward = torch.compile(block.forward)  # the instance's attribute: see above


def _mark_sequence_dynamic(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Mark dimension 1 of the block's (B, T, ...) inputs dynamic: hidden states (B, T, H), position ids
    (B, T), the rotary cos/sin (B, T, D). ``maybe``: where the graph needs the size fixed (a one-token row,
    a padded layout's (B, 1, T, T) mask) dynamo specialises instead of raising, and recompiles once on
    another size as it would unmarked."""
    for t in (*args, *kwargs.values(), *(kwargs.get("position_embeddings") or ())):
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            torch._dynamo.maybe_mark_dynamic(t, 1)


def compiles(cfg: Config, model: torch.nn.Module) -> bool:
    """Whether the run compiles ``model``'s decoder blocks: ``policy.compile``, or where it is null, on a GPU
    (torchtitan's experience: fused norms, rotary and activations) and not on a CPU (the config's doc has
    the figures). Never an MoE policy's: its routers record and replay routes through Python state set per
    forward (:mod:`trainer.models.moe`), which a compiled graph would guard on or bake in; asked for
    explicitly, that is an error in one line."""
    wanted = cfg.policy.compile if cfg.policy.compile is not None else cfg.cluster.use_gpus
    if wanted and moe.routers(model):
        if cfg.policy.compile:
            raise moe.MoEError(
                "policy.compile=true: an MoE policy's blocks are not compiled (their routers' record and "
                "replay hooks run per forward); set policy.compile=false"
            )
        return False
    return wanted


class CompileClock:
    """Seconds torch.compile spends compiling in this process, and how many compilations: dynamo's
    compile-start and compile-end callbacks, which a lazily compiled backward runs too."""

    def __init__(self) -> None:
        from torch._dynamo.callback import callback_handler

        self.seconds, self.count = 0.0, 0
        self._start: float | None = None
        callback_handler.register_start_callback(self._started)
        callback_handler.register_end_callback(self._ended)

    def _started(self, args: Any) -> None:
        self._start = time.perf_counter()

    def _ended(self, args: Any) -> None:
        if self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self.count += 1
            self._start = None

    def close(self) -> None:
        from torch._dynamo.callback import callback_handler

        callback_handler.remove_start_callback(self._started)
        callback_handler.remove_end_callback(self._ended)


def freeze(model: torch.nn.Module, patterns: list[str]) -> int:
    """Freeze every parameter whose name matches one of ``patterns`` (``fnmatch``, e.g.
    ``model.vision_tower.*``); the number frozen. The driver has checked that each pattern matches
    (:func:`trainer.policy.group.check_freeze`)."""
    from fnmatch import fnmatchcase

    frozen = 0
    for name, p in model.named_parameters():
        if any(fnmatchcase(name, pattern) for pattern in patterns):
            p.requires_grad_(False)
            frozen += 1
    return frozen


def lr_factor(step: int, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """The learning rate of optimizer step ``step`` (0-based: the factor the step that follows uses) as a
    fraction of ``policy.learning_rate``: linear warm-up over ``warmup`` steps, then ``schedule``
    (``constant``, or ``linear``/``cosine`` from 1 towards ``min_ratio``, reached at step ``total``, one past the
    run's last, as transformers' schedules do: the last step still moves; a run extended past ``total`` stays
    at the floor)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    done = min(1.0, (step - warmup) / max(1, total - warmup))
    shape = 1.0 - done if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * done))
    return min_ratio + (1.0 - min_ratio) * shape


def adamw(params, **kwargs) -> torch.optim.AdamW:
    """AdamW with the fused kernel: one kernel over all (sharded) parameters instead of a loop of
    per-tensor ops (bench/README.md, "fused AdamW"); same state, same checkpoints.
    Where the fused kernel does not support the device or dtype, the per-tensor loop, said once."""
    params = list(params)
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except (RuntimeError, ValueError) as e:
        log.warning(
            "fused AdamW is not available here (%s); using the unfused optimizer", str(e).splitlines()[0]
        )
        return torch.optim.AdamW(params, **kwargs)


class PolicyWorker:
    """One FSDP2 rank. Wrapped with ``ray.remote`` by :mod:`trainer.policy.group`."""

    def __init__(self, cfg: Config, model_path: str, rank: int, world_size: int, colocated_engine: bool):
        self.cfg, self.model_path, self.rank, self.world_size = cfg, model_path, rank, world_size
        self.colocated_engine = colocated_engine
        self.engine: GenerationEngine | None = None  # with colocated_engine, set in setup
        self.sp: SequenceParallelGroup | None = None  # set in setup with policy.sequence_parallel_size > 1
        # The policy's attention when it is trainer.policy.packed_attention's (set in setup), else None.
        self.attention: PackedAttention | None = None
        self._fused_rows = False  # whether packed rows run one fused varlen call (set in setup)
        self.routing: moe.Routing | None = None  # an MoE policy's routers (trainer.models.moe), set in setup
        self._engine_awake = False  # whether the colocated engine may hold device memory (steps 1-3 above)
        self.compile_clock: CompileClock | None = None  # with policy.compile (set in setup)
        self._compile_report: str | None = None  # what the first step reports compiled, then None
        self.device = torch.device("cuda", 0) if cfg.cluster.use_gpus else torch.device("cpu")
        if not cfg.cluster.use_gpus:
            from trainer.cluster import setup_cpu_process  # imports ray: tests/gpu runs a rank without it

            # Ranks on one machine share its cores: without this each rank spawns a thread per core.
            per_node = max(1, cfg.cluster.cpu_workers_per_node)
            setup_cpu_process(cfg, (os.cpu_count() or 1) // per_node, slot=rank % per_node)
        heap.settle(*RANK_IMPORTS)

    def address(self) -> tuple[str, int]:
        from trainer.cluster import node_address

        return node_address()

    # ----- set-up ----------------------------------------------------------------------------------
    def setup(self, master_addr: str, master_port: int) -> dict[str, Any]:
        cfg = self.cfg
        backend = "nccl" if cfg.cluster.use_gpus else "gloo"
        if cfg.cluster.use_gpus:
            torch.cuda.set_device(self.device)
        dist.init_process_group(
            backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(minutes=30),
        )
        torch.manual_seed(cfg.seed)
        self.tokenizer = load_tokenizer(self.model_path, cfg.model.trust_remote_code)
        # The policy is built on the meta device and sharded before it holds weights; rank 0 reads the
        # checkpoint whole, on the host, and broadcasts it one tensor at a time (trainer.policy.sharded_init).
        # A colocated hf engine copies a loaded model, so then every rank reads it, as the engine would.
        hf_engine = self.colocated_engine and cfg.generation.backend == "hf"
        host = (
            load_model(self.model_path, cfg.model.dtype, cfg.model.trust_remote_code)
            if self.rank == 0 or hf_engine
            else None
        )
        # A causal LM of transformers (AutoModelForCausalLM), which build_empty_model annotates as a plain module.
        model = cast(
            "PreTrainedModel",
            build_empty_model(self.model_path, cfg.model.dtype, cfg.model.trust_remote_code),
        )
        self.lora = cfg.policy.lora if cfg.policy.lora.enabled else None
        if self.lora is not None:
            from trainer.models import lora

            if host is not None:
                lora.apply(
                    host, self.lora
                )  # before the engine copies it: the hf engine applies the adapters too
                with torch.random.fork_rng(devices=[]):  # the meta twin's draws are discarded: host's count
                    lora.apply(model, self.lora)
            else:
                lora.apply(model, self.lora)
        frozen = freeze(model, cfg.policy.freeze)
        if (
            self.colocated_engine
        ):  # an hf engine copies host, loaded with its adapters, before the attention is set
            self.engine = colocated.build(cfg, self.model_path, self.rank, self.device, host, self.lora)
            self._engine_awake = True  # a new engine holds its memory
        if cfg.model.attn_implementation:  # the policy's; the engine keeps the default, better for decoding
            model.set_attn_implementation(cfg.model.attn_implementation)
        # Packed rows attend within each sample at the cost of its own pairs (a varlen kernel, or sdpa per
        # sample), where transformers' sdpa or eager would mask a dense row; padded batches keep the model's
        # own sdpa or eager, other implementations are as before. Ulysses: the rank's sequence-parallel group.
        inner = cfg.model.attn_implementation or "sdpa"
        self.sp = None
        if cfg.policy.sequence_parallel_size > 1:
            from trainer.policy.ulysses import SequenceParallelGroup

            self.sp = SequenceParallelGroup(cfg.policy.sequence_parallel_size, self.rank, self.world_size)
        from trainer.policy import packed_attention

        if self.sp is not None or packed_attention.takes(inner, model.config):
            self.attention = packed_attention.install(model, inner, self.sp)
        # Packed rows in one fused varlen call (GPUs in bf16/fp16) beat the shared-prompt layout everywhere
        # measured (_prefix_layouts); on CPU they run sdpa per sample and the position count decides.
        compute = DTYPES.get(cfg.policy.param_dtype or "") or DTYPES.get(cfg.model.dtype, torch.float32)
        rows = self.attention.inner if self.attention is not None else inner
        self._fused_rows = cfg.policy.sequence_packing and packed_attention.fused_rows(
            self.device, compute, rows
        )
        if cfg.policy.activation_checkpointing:
            model.gradient_checkpointing_enable()
            if (
                self.lora is not None or frozen
            ):  # frozen embeddings: a checkpointed block's input must still need grad
                model.enable_input_require_grads()
        model.config.use_cache = False
        compiled = compiles(cfg, model)
        if self.rank == 0 and not compiled and cfg.policy.compile is None and cfg.cluster.use_gpus:
            print("kuberl: policy.compile: off for an MoE policy (its routers' hooks run eager)", flush=True)
        self.compile_clock = CompileClock() if compiled else None
        blocks = shard_model(model, cfg.policy.reshard_after_forward, DTYPES.get(cfg.policy.param_dtype or ""),
                             compile_blocks=compiled)  # fmt: skip
        self._compile_report = f"{blocks} blocks" if compiled else None  # said once, after the first step
        if self.rank != 0:
            host = None  # a colocated hf engine's copy is made; only rank 0's feeds the shards
        load_shards(model, host, self.device)
        self.model = model
        self.routing = moe.install(model)  # None for a dense model
        self.ref_model = None  # with LoRA the reference is self.model with its adapters off
        if cfg.grpo.loss.reference_policy_kl_penalty > 0 and self.lora is None:
            # The same weights as the policy's start (host has no adapters without LoRA): no second read.
            ref = build_empty_model(
                self.model_path, cfg.model.dtype, cfg.model.trust_remote_code, cfg.model.attn_implementation
            )
            ref.requires_grad_(False)
            if self.attention is not None:  # the same attention as the policy's: its rows serve both
                packed_attention.install(ref, cfg.model.attn_implementation or "sdpa", self.sp)
            # Its root reshards after each forward: the reference never runs a backward that would free it.
            shard_model(
                ref,
                True,
                DTYPES.get(cfg.policy.param_dtype or ""),
                compile_blocks=compiled,
                reshard_root=True,
            )
            load_shards(ref, host, self.device)
            self.ref_model = ref.eval()
        del host
        head_check = self._check_head(compute)
        replay_check = self._check_replay()
        p = cfg.policy
        self.optimizer = adamw(
            self._trainable(),
            lr=p.learning_rate,
            betas=p.adam_betas,
            eps=p.adam_eps,
            weight_decay=p.weight_decay,
        )
        total = cfg.grpo.max_num_steps * cfg.grpo.num_minibatches  # the run's optimizer steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            functools.partial(
                lr_factor,
                warmup=max(0, p.warmup_steps),
                total=total,
                schedule=p.lr_schedule,
                min_ratio=p.min_lr_ratio,
            ),
        )
        n_params = sum(t.numel() for t in self.model.parameters())
        n_trainable = sum(t.numel() for t in self._trainable())
        return {
            "num_params": n_params,
            "trainable_params": n_trainable,
            "pad_id": self.tokenizer.pad_token_id,
            # What each refit moves into each engine: the trainable parameters, at the engine's dtype.
            "refit_bytes": n_trainable * self.engine_dtype.itemsize,
            "head_check": head_check,
            "replay_check": replay_check,
        }

    def _check_head(self, compute: torch.dtype) -> str:
        """Fix the run's LM head for the policy and the reference (one head for every forward of the run,
        :func:`trainer.policy.forward.fix_rows`), then check it against the policy's own logits on a sentence's
        tokens (:func:`trainer.policy.forward.check_head`: two forwards, on every rank, as FSDP2 needs); rank 0
        prints the ``self-check:`` line. A gap raises its one line, unless ``policy.unchecked_head``."""
        cfg = self.cfg
        rows = forward.run_rows(cfg.policy)
        for model in (self.model, self.ref_model):
            if model is not None:
                forward.fix_rows(model, rows, fused=cfg.policy.fused_head)
        started = time.perf_counter()
        ids = self.tokenizer("The quick brown fox jumps over the lazy dog. 2 + 3 = 5")["input_ids"]
        batch = self._batch([Sample(prompt_ids=ids[:1], response_ids=ids[1:])], prefix=False)
        line = forward.check_head(self.model, batch, self.device, self.attention, cfg.generation.temperature,
                                  compute, unchecked=cfg.policy.unchecked_head)  # fmt: skip
        # Its forwards ran without a backward: with reshard_after_forward=false the root (and every unit) would
        # stay gathered, and the first training forward would reuse those weights past the optimizer's step.
        self._reshard()
        if self.rank == 0:  # its cost beside step 1's, said with it
            print(f"kuberl: {line} in {time.perf_counter() - started:.2f}s", flush=True)
        return line

    def _check_replay(self) -> str | None:
        """With ``policy.moe.router_replay`` on an MoE policy: replaying the policy's own routes gives its own
        logprobs exactly (:func:`trainer.models.moe.check_replay`, two forwards on every rank), else one line."""
        if self.routing is None or not self.cfg.policy.moe.router_replay:
            return None
        ids = self.tokenizer("The quick brown fox jumps over the lazy dog. 2 + 3 = 5")["input_ids"]

        def run(mode: moe.Mode, routes) -> torch.Tensor:
            batch = self._batch(
                [Sample(prompt_ids=ids[:1], response_ids=ids[1:], routes=routes)], prefix=False, mode=mode
            )
            return self._forward_logprobs(self.model, batch)[0]

        line = moe.check_replay(self.model, run)
        self._reshard()  # forwards without a backward (_check_head says why)
        if self.rank == 0:
            print(f"kuberl: {line}", flush=True)
        return line

    def _trainable(self) -> list[torch.nn.Parameter]:
        """What the optimizer steps: every parameter, or with LoRA the adapters alone."""
        return [p for p in self.model.parameters() if p.requires_grad]

    # ----- generation (colocated) ------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
        """Sample with the colocated engine; it stays awake through several calls (rollout turns, rounds),
        until the policy's next forward (:meth:`_engine_to_sleep`). One asleep wakes itself first."""
        assert self.engine is not None, "generate: this rank was built without a colocated engine"
        self._engine_awake = True
        return self.engine.generate(prompts, n, params)

    def _engine_to_sleep(self) -> None:
        """Before the policy's own forwards: generation is over until the next refit, so the colocated
        engine gives its memory back (once; logprob passes and training follow each other)."""
        if self.engine is not None and self._engine_awake:
            self.engine.sleep()
            self._engine_awake = False

    def refresh_engine(self) -> None:
        """Gather the updated trainable weights into the colocated engine (collective), in the order that keeps
        the device's peak low: what training cached goes back to the device first, the engine's weights
        wake, the new ones load one FSDP unit at a time, and only then does the KV cache wake."""
        engine = self.engine
        assert engine is not None, "refresh_engine: this rank was built without a colocated engine"
        if self.lora is not None:
            gather = lambda: self.iter_adapter_weights(self.engine_dtype)  # noqa: E731
        else:  # an engine that slept its weights away (vLLM level 2) takes the frozen ones back too
            frozen = engine.reloads_every_weight
            gather = lambda: self.iter_full_weights(self.engine_dtype, frozen=frozen)  # noqa: E731
        colocated.refresh(engine, gather, adapters=self.lora is not None)
        self._engine_awake = True

    @property
    def engine_dtype(self) -> torch.dtype:
        return DTYPES[self.cfg.engine_dtype]

    def iter_full_weights(self, dtype: torch.dtype | None = None, frozen: bool = False):
        """Yield (name, full tensor) for every trainable parameter (``frozen``: every parameter); every rank
        must iterate (collective). A frozen parameter keeps the value the engine was built with, from the
        same checkpoint, so a refit leaves it out; an FSDP unit with nothing trainable is not gathered.

        FSDP2 gathers the parameters itself, one unit at a time (``unshard`` of a transformer block, or
        of the root for the embeddings, final norm and lm_head), in the mixed-precision ``param_dtype``
        when one is set, so a bf16 engine over fp32 master weights moves half the bytes. The next unit's
        gather is in flight while the caller loads the current one, so at most two units are gathered
        at once: the refit's peak is two layers, not the model (colocated, beside the engine's weights).
        Every yielded tensor owns its memory: a caller may keep it after the iteration moved on.

        The stream rule (:mod:`trainer.policy.streams`): every gather, wait, copy and reshard runs on the
        stream current *now*, when the iterator is made (after the optimizer step), whatever stream the
        caller reads on; each tensor is handed to the reader's stream behind an event, and its memory is
        kept for that stream. vLLM's packed NCCL sender reads each chunk on a stream of its own.

        With ``policy.reshard_after_forward`` false the gathered weights stay until the next training
        forward, which then gathers nothing (the weights cannot change in between: the sync follows the
        optimizer step); that keeps the whole model gathered, as training with that setting does anyway.
        Otherwise each unit is resharded as soon as its tensors are yielded.
        """
        fence = streams.for_device(self._param_device())
        return gather.gather_units(
            self.model, fence, dtype, self.cfg.policy.reshard_after_forward, not frozen
        )

    def _param_device(self) -> torch.device:
        return next(self.model.parameters()).device

    def iter_adapter_weights(self, dtype: torch.dtype | None = None):
        """Yield (name, full tensor) for every adapter parameter (LoRA), in module order; every rank must
        iterate (collective). Each is gathered on its own (``full_tensor``), not through its FSDP unit,
        whose gather would bring the frozen base weights along: a refit moves the adapters alone. The
        stream rule is :meth:`iter_full_weights`'."""
        return gather.gather_adapters(self.model, streams.for_device(self._param_device()), dtype)

    def _params_by_unit(self, trainable: bool = False) -> list[tuple[Any, list[str]]]:
        """(FSDP unit, its parameters' names), in module order (:func:`trainer.policy.gather.params_by_unit`)."""
        return gather.params_by_unit(self.model, trainable)

    def _fsdp_units(self) -> list:
        return gather.fsdp_units(self.model)

    def _reshard(self) -> None:
        """Free gathered weights (a no-op on units already sharded): before state dicts and loads."""
        gather.reshard(self.model)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameters on CPU (collective). For tests and small models; checkpoints use DCP."""
        self._reshard()
        return {
            name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
            for name, p in self.model.named_parameters()
        }

    def engine_state_dict(self) -> dict[str, torch.Tensor]:
        """The colocated hf engine's weights, for tests (other engines keep theirs in their own layout)."""
        from trainer.generation.hf import HFGenerationEngine

        assert isinstance(self.engine, HFGenerationEngine), "engine_state_dict: reads an hf engine's weights"
        return {name: p.detach().cpu().clone() for name, p in self.engine.model.named_parameters()}

    # ----- weight broadcast (disaggregated) --------------------------------------------------------
    def weight_metadata(self) -> dict:
        """The update info of every weight transfer (vLLM's names, dtype_names, shapes), without gathering:
        what :meth:`iter_full_weights` yields, in its order, at the engine's dtype."""
        from trainer.generation.refit.transport import WeightMeta

        dtype, params = self.engine_dtype, dict(self.model.named_parameters())
        if self.lora is not None:  # the adapters alone, in iter_adapter_weights' order
            names = [name for name, p in params.items() if p.requires_grad]
        else:
            # the gather's order, the trainable parameters alone
            names = [name for _, unit_names in self._params_by_unit(trainable=True) for name in unit_names]
        return WeightMeta.of((name, params[name].shape, dtype) for name in names).update_info()

    def init_weight_sync(self, init_info: dict) -> None:
        """Rank 0 opens the sending end (the rendezvous's host; the engines join at the same time)."""
        from trainer.generation.refit.senders import open_sender

        if self.rank == 0:
            self.sender = open_sender(self.cfg.generation.backend, init_info, self.device)

    def close_weight_sync(self) -> None:
        """Rank 0 leaves the weight group last, as the store's host (the driver calls every side at once)."""
        if getattr(self, "sender", None) is not None:
            self.sender.close()

    def broadcast_weights(self, update_info: dict) -> dict[str, float]:
        """All ranks gather; rank 0 sends the full tensors that ``update_info`` announced to the engines
        (:mod:`trainer.generation.refit.transport`): the trainable parameters; with LoRA, the adapters."""
        if self.lora is not None:
            weights = self.iter_adapter_weights(self.engine_dtype)
        else:
            weights = self.iter_full_weights(self.engine_dtype)
        if self.rank != 0:
            for _ in weights:  # the gathers are collectives: every rank takes part
                pass
            return {}
        from trainer.generation.refit.transport import WeightMeta

        stats = self.sender.send(weights, WeightMeta.from_update_info(update_info))
        return {"buckets": stats.buckets, "bytes": stats.bytes, "seconds": stats.seconds}

    # ----- logprobs --------------------------------------------------------------------------------
    def _forward_logprobs(self, model, batch: Batch, with_entropy: bool = False):
        """(B, K) logprobs of the window's labels, and optionally (B, K) entropy (:mod:`trainer.policy.forward`)."""
        return forward.forward_logprobs(
            model, batch, self.device, self.attention, self.cfg.generation.temperature, with_entropy
        )

    def _prefix_layouts(self, mbs: list[list[Sample]]) -> list[bool]:
        """Per micro-batch, whether it runs the shared-prompt layout. The shared-prompt layout runs each
        prompt once through a KV cache: not under activation checkpointing (a checkpointed layer
        recomputes without the cache) nor split over SP ranks. With packing on too, a micro-batch takes it
        where it runs fewer positions (:func:`prefers_prefix`) on every rank: the layouts differ in how
        many forwards they make (two against one), and each forward's FSDP gathers are collectives, so
        the ranks agree (one all-reduce per pass). Where packed rows run a fused varlen kernel (a GPU in
        bf16/fp16) they are always taken: on a GPU the shared-prompt layout took longer than packed rows on
        every batch measured, a prompt-heavy one among them (bench/README.md, ``make bench-train`` on a GPU):
        its second forward and masked attention cost more than the positions it saves."""
        p = self.cfg.policy
        if not (p.shared_prefix and not p.activation_checkpointing and self.sp is None) or self._fused_rows:
            return [False] * len(mbs)
        if not p.sequence_packing:
            return [True] * len(mbs)
        wants = torch.tensor([prefers_prefix(mb) for mb in mbs], dtype=torch.int32, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1 and len(mbs):
            dist.all_reduce(wants, op=dist.ReduceOp.MIN)
        return [bool(w) for w in wants.tolist()]

    def _batch(self, samples: list[Sample], prefix: bool, mode: moe.Mode | None = None) -> Batch:
        batch = layout(samples, self.tokenizer.pad_token_id, prefix, self.cfg.policy.sequence_packing)
        if mode is not None:
            batch.routing = mode
        return batch

    def _micro_batches(self, samples: list[Sample], size: int, max_tokens: int | None) -> list[list[int]]:
        """Indices of ``samples`` per micro-batch: ``size`` at a time, or by the token budget (collective:
        the ranks agree on the largest count, and the others split micro-batches up to it)."""
        if max_tokens is None:
            return [list(range(i, min(i + size, len(samples)))) for i in range(0, len(samples), size)]
        lengths = [s.length for s in samples]
        max_tokens *= self.cfg.policy.sequence_parallel_size  # the budget is per rank; a row spans the group
        bins = budget_micro_batches(lengths, max_tokens, packed=self.cfg.policy.sequence_packing)
        count = torch.tensor([len(bins)], dtype=torch.int64, device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return split_to_count(bins, int(count.item()), lengths)

    @torch.no_grad()
    def compute_logprobs(self, samples: list[Sample], reference: bool = False) -> list[list[float]]:
        self._engine_to_sleep()
        model = self.ref_model if reference and self.ref_model is not None else self.model
        p = self.cfg.policy
        result: list[list[float] | None] = [None] * len(samples)
        with self._reference_view(reference):
            indices = self._micro_batches(
                samples, p.logprob_micro_batch_size, p.logprob_max_tokens_per_microbatch
            )
            mbs = [[samples[i] for i in idx] for idx in indices]
            # The policy's old logprobs replay the engine's routes as training will; the reference routes freely.
            mode = moe.Mode(replay=self.cfg.policy.moe.router_replay and not reference)
            for idx, mb, prefix in zip(indices, mbs, self._prefix_layouts(mbs)):
                batch = self._batch(mb, prefix, mode)
                logprobs, _ = self._forward_logprobs(model, batch)
                for i, lp in zip(idx, batch.unpad(mb, logprobs.cpu())):
                    result[i] = lp
        done = [lp for lp in result if lp is not None]
        assert len(done) == len(samples), "compute_logprobs: a sample in no micro-batch"
        return done

    def _reference_view(self, reference: bool):
        """With LoRA the reference is the policy with its adapters off; otherwise nothing to switch."""
        if reference and self.lora is not None:
            from trainer.models.lora import adapters_disabled

            return adapters_disabled(self.model)
        import contextlib

        return contextlib.nullcontext()

    # ----- training --------------------------------------------------------------------------------
    def train(
        self, minibatches: list[list[Sample]], global_counts: list[dict[str, float]]
    ) -> dict[str, float]:
        """One optimizer step per mini-batch. ``global_counts[i]`` holds the mini-batch's token and
        sequence counts summed over all ranks, so each rank's loss is its share of the global mean.
        A mini-batch may be empty on every rank (all its samples skipped for a zero advantage): the
        step then applies a zero gradient. Entropy, ppo_kl and clip fraction are means over the
        tokens trained on, absent on a step that trained on none (:meth:`Objective.metrics`)."""
        cfg, loss_cfg = self.cfg, self.cfg.grpo.loss
        has_reference = self.ref_model is not None or (
            self.lora is not None and loss_cfg.reference_policy_kl_penalty > 0
        )
        objective = Objective(
            loss_cfg, max_len=cfg.generation.max_new_tokens, kl_penalty=has_reference, ranks=self.world_size
        )
        self._engine_to_sleep()  # when no logprob pass came first
        self.model.train()
        # The same keys on every rank, and present when a step trained on nothing (all skipped); sums
        # (trainer.algorithms.objective), normalised by the objective after the all-reduce below. They stay
        # on the device, in float64, and are read once, after it: no micro-batch waits for the host.
        keys = [*objective.metric_keys(), "grad_norm"] + (["entropy"] if cfg.policy.compute_entropy else [])
        moe_cfg = cfg.policy.moe
        aux = self.routing is not None and bool(moe_cfg.load_balance_coef or moe_cfg.z_loss_coef)
        mode = moe.Mode(replay=moe_cfg.router_replay, record=self.routing is not None, keep_grad=aux)
        if self.routing is not None:  # every rank the same keys (the all-reduce below)
            keys += [*moe.STAT_KEYS, *(f"{k}/den" for k in moe.STAT_KEYS)] + (["moe/aux_loss"] if aux else [])
        sums: dict[str, torch.Tensor] = {
            k: torch.zeros((), dtype=torch.float64, device=self.device) for k in keys
        }

        def add(key: str, value: torch.Tensor) -> None:
            sums[key] += torch.as_tensor(value).detach().to(self.device, torch.float64)

        def on_device(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(self.device)

        for samples, counts in zip(minibatches, global_counts):
            self.optimizer.zero_grad(set_to_none=True)
            mbs = [
                [samples[j] for j in idx]
                for idx in self._micro_batches(
                    samples, cfg.policy.micro_batch_size, cfg.policy.max_tokens_per_microbatch
                )
            ]
            for i, (mb, prefix) in enumerate(zip(mbs, self._prefix_layouts(mbs))):
                # Reduce-scatter gradients once per optimizer step, not once per micro-batch. (The cast: fully_shard
                # made the root's class an FSDPModule subclass of its own in setup, which self.model's type can't say.)
                cast("FSDPModule", self.model).set_requires_gradient_sync(i == len(mbs) - 1)
                batch = self._batch(mb, prefix, mode)
                moe.begin(self.model)
                logprobs, entropy = self._forward_logprobs(self.model, batch, cfg.policy.compute_entropy)
                mask = batch.loss_mask.to(self.device)
                loss, metric_sums = objective(
                    LossInputs(
                        logprobs=logprobs,
                        advantages=batch.advantages.to(self.device),
                        mask=mask,
                        num_tokens=counts["tokens"],
                        num_seqs=counts["seqs"],
                        old_logprobs=on_device(batch.old_logprobs),
                        behaviour_logprobs=on_device(batch.gen_logprobs),
                        ref_logprobs=on_device(batch.ref_logprobs) if objective.kl is not None else None,
                    )
                )
                if self.routing is not None:
                    for key, value in moe.stat_sums(self.routing).items():
                        add(key, value)
                    router_loss = moe.aux_loss(self.routing, moe_cfg.load_balance_coef, moe_cfg.z_loss_coef)
                    if router_loss is not None:
                        # The micro-batch's share of the mini-batch's tokens, so the shares sum to the mean over
                        # it; times the ranks, whose gradients FSDP averages (as the objective's scalar).
                        share = mask.sum() / max(counts["tokens"], 1.0)
                        loss = loss + router_loss * share * self.world_size
                        add("moe/aux_loss", router_loss.detach() * share)
                loss.backward()
                for key, value in metric_sums.items():
                    add(key, value)
                if entropy is not None:
                    add("entropy", (entropy * mask).sum())
            # The root stays gathered after a forward without a backward (a logprob pass, shard_model says why),
            # until a backward frees it: with no micro-batch none did. Sharded, its parameters are the ones the
            # optimizer holds, and the next forward gathers what the step wrote, not a copy from before it.
            self._reshard()
            if not mbs:  # nothing with a policy gradient: a zero gradient, so Adam still steps as it would
                for param in self._trainable():
                    param.grad = torch.zeros_like(param)
            grad_norm = torch.nn.utils.clip_grad_norm_(
                self._trainable(), cfg.policy.max_grad_norm or float("inf")
            )
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
            add("grad_norm", grad_norm)
            self.optimizer.step()
            self.scheduler.step()
        cast("FSDPModule", self.model).set_requires_gradient_sync(True)
        # Sum over ranks, then normalise (Objective.metrics).
        if self.sp is not None and not self.sp.leader:  # a group's sums once: its ranks computed the same
            sums = {k: (v if k == "grad_norm" else torch.zeros_like(v)) for k, v in sums.items()}
        keys = sorted(sums)
        totals = torch.stack([sums[k] for k in keys])
        dist.all_reduce(totals)
        reduced = dict(zip(keys, totals.tolist()))
        routing = moe.finish_stats(reduced) if self.routing is not None else {}
        if "moe/aux_loss" in reduced:  # absent where no token was trained on: no router loss was computed
            aux_loss = reduced.pop("moe/aux_loss") / max(len(minibatches), 1)
            if reduced["tokens"] > 0:
                routing["moe/aux_loss"] = aux_loss
        out = objective.metrics(reduced, steps=len(minibatches))
        out.update(routing)
        out["lr"] = float(self.scheduler.get_last_lr()[0])  # a float already (torch's stub allows a tensor)
        self._report_compile()
        return out

    def _report_compile(self) -> None:
        """With ``policy.compile``, once, after the first training step (compiling is lazy: the step's logprob
        and training passes compiled what they ran, the backward included): what it cost."""
        if self._compile_report is None or self.compile_clock is None:
            return
        clock = self.compile_clock
        if self.rank == 0:
            print(f"kuberl: policy.compile: {self._compile_report} compiled in {clock.seconds:.1f} s "
                  f"({clock.count} compilations by the end of the first step)", flush=True)  # fmt: skip
        self._compile_report = None

    def perf_stats(self) -> dict[str, Any]:
        """This rank's peak memory since the last call and its device's peak FLOP/s for the policy's compute
        dtype (a GPU's from trainer.perf's table; on a CPU a matmul measured once on this rank's threads)."""
        from trainer import perf

        peak, source = perf.device_peak_flops(
            self.device, self.cfg.policy.param_dtype or self.cfg.model.dtype
        )
        return {
            "peak_memory_bytes": perf.peak_memory_bytes(self.device),
            "peak_flops": peak,
            "peak_source": source,
        }

    # ----- checkpoints (torch DCP: every rank writes its own shards in parallel) --------------------
    def save_checkpoint(self, path: str) -> None:
        dcp.save(path, self.model, self.optimizer, self.scheduler, lora=self.lora is not None)
        if self.rank == 0:
            self._save_hf_files(os.path.join(path, "policy"))
        dist.barrier()

    def _save_hf_files(self, policy_dir: str) -> None:
        """Tokenizer and base config beside the weights, so conversion needs nothing else."""
        lora_info = None
        if self.lora is not None:  # the weights are adapters: what they adapt, for conversion and evaluation
            from trainer.config import to_dict

            lora_info = {
                "lora": to_dict(self.lora),
                "model_name": self.cfg.model.name,
                "model_path": self.model_path,
            }
        dcp.save_hf_files(policy_dir, self.tokenizer, self.model_path, self.model.config, lora_info)

    def load_checkpoint(self, path: str) -> None:
        """Load weights and optimizer state; DCP reshards, so the rank count may differ from the save."""
        dcp.load(path, self.model, self.optimizer, self.scheduler, lora=self.lora is not None)

    def shutdown(self) -> None:
        if (clock := getattr(self, "compile_clock", None)) is not None:
            clock.close()
            from torch._inductor.async_compile import shutdown_compile_workers

            shutdown_compile_workers()  # inductor's pool of compiler processes, where it started one
        if (engine := getattr(self, "engine", None)) is not None:
            engine.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
