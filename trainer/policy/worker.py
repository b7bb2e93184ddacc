"""FSDP2 policy workers: one Ray actor per rank, together one torch.distributed group.

Each rank holds a shard of the policy (``fully_shard`` on every decoder layer, then the root; built on
the meta device and sharded before any weight is loaded, :mod:`trainer.policy.sharded_init`), its
optimizer state, and optionally a frozen, sharded reference model for the KL penalty (none at all
when the penalty is 0). With ``policy.lora`` the policy carries adapters (:mod:`trainer.models.lora`):
the base weights stay frozen and sharded, the optimizer holds the adapters alone, the reference is the
policy with its adapters off (no second model), and refits and checkpoints carry only the adapters.
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
separate process group (:mod:`trainer.weight_sync`).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from trainer import heap
from trainer.algorithms import core_algos
from trainer.algorithms.objective import LossInputs, Objective
from trainer.config import Config
from trainer.generation.base import Completion, SamplingParams
from trainer.models import DTYPES, build_empty_model, load_model, load_tokenizer
from trainer.policy import streams
from trainer.policy.batch import (
    PackedBatch,
    PaddedBatch,
    PrefixBatch,
    Sample,
    budget_micro_batches,
    pack_batch,
    pad_batch,
    prefers_prefix,
    prefix_batch,
    split_to_count,
    unpad_logprobs,
)
from trainer.policy.packed_attention import Row
from trainer.policy.sharded_init import load_shards

log = logging.getLogger(__name__)

# What a rank's set-up imports anyway, imported before the rank freezes its heap (trainer.heap).
RANK_IMPORTS = ("transformers.modeling_utils", "torch.distributed.fsdp", "torch.distributed.checkpoint")


def rank_seed_offset(rank: int) -> int:
    """Each colocated engine samples from its own stream: the same seed on every rank would give
    the same samples to prompts that happen to share a position in their shards."""
    return 1 + rank


def shard_model(model: torch.nn.Module, reshard_after_forward: bool, mp_dtype: torch.dtype | None) -> None:
    """FSDP2: each transformer block is its own unit, so only one block is gathered at a time."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=torch.float32) if mp_dtype else MixedPrecisionPolicy()
    block_types = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in block_types]
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    fully_shard(model, reshard_after_forward=reshard_after_forward, mp_policy=mp)


def adamw(params, **kwargs) -> torch.optim.AdamW:
    """AdamW with the fused kernel: one kernel over all (sharded) parameters instead of a loop of
    per-tensor ops (0.39 -> 0.12 s per step for SmolLM2 on one CPU rank); same state, same checkpoints.
    Where the fused kernel does not support the device or dtype, the per-tensor loop, said once."""
    params = list(params)
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except (RuntimeError, ValueError) as e:
        log.warning("fused AdamW is not available here (%s); using the unfused optimizer", str(e).splitlines()[0])
        return torch.optim.AdamW(params, **kwargs)


class PolicyWorker:
    """One FSDP2 rank. Wrapped with ``ray.remote`` by :mod:`trainer.policy.group`."""

    def __init__(self, cfg: Config, model_path: str, rank: int, world_size: int, colocated_engine: bool):
        self.cfg, self.model_path, self.rank, self.world_size = cfg, model_path, rank, world_size
        self.colocated_engine = colocated_engine
        self.engine = None
        self.sp = None  # set in setup with policy.sequence_parallel_size > 1
        self.packed_attention = False  # whether the policy's attention is trainer.policy.packed_attention's
        self._fused_rows = False  # whether packed rows run one fused varlen call (set in setup)
        self._engine_awake = False  # whether the colocated engine may hold device memory (steps 1-3 above)
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
        host = load_model(self.model_path, cfg.model.dtype, cfg.model.trust_remote_code) if self.rank == 0 or hf_engine else None
        model = build_empty_model(self.model_path, cfg.model.dtype, cfg.model.trust_remote_code)
        self.lora = cfg.policy.lora if cfg.policy.lora.enabled else None
        if self.lora is not None:
            from trainer.models import lora

            if host is not None:
                lora.apply(host, self.lora)  # before the engine copies it: the hf engine applies the adapters too
                with torch.random.fork_rng(devices=[]):  # the meta twin's draws are discarded: host's count
                    lora.apply(model, self.lora)
            else:
                lora.apply(model, self.lora)
        if self.colocated_engine:
            from trainer.generation.factory import EngineSpec, build_engine

            spec = EngineSpec(
                model_path=self.model_path,
                dtype=cfg.engine_dtype,
                seed=cfg.seed + rank_seed_offset(self.rank),
                max_model_len=cfg.policy.max_total_sequence_length,
                trust_remote_code=cfg.model.trust_remote_code,
                tokenizer_path=cfg.model.tokenizer,
                device=self.device,
                colocated=True,
                threads=torch.get_num_threads(),
                base_model=host,  # loaded, with its adapters, before the policy's attention is set
                lora=self.lora,
            )
            self.engine = build_engine(cfg.generation, spec)
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

        self.packed_attention = self.sp is not None or packed_attention.takes(inner, model.config)
        if self.packed_attention:
            packed_attention.install(model, inner, self.sp)
        # Packed rows in one fused varlen call (GPUs in bf16/fp16) beat the shared-prompt layout everywhere
        # measured (_prefix_layouts); on CPU they run sdpa per sample and the position count decides.
        compute = DTYPES.get(cfg.policy.param_dtype or "") or DTYPES.get(cfg.model.dtype, torch.float32)
        rows = packed_attention.on_rows(inner) if self.packed_attention else inner
        self._fused_rows = cfg.policy.sequence_packing and packed_attention.fused_rows(self.device, compute, rows)
        if cfg.policy.activation_checkpointing:
            model.gradient_checkpointing_enable()
            if self.lora is not None:  # frozen embeddings: a checkpointed block's input must still need grad
                model.enable_input_require_grads()
        model.config.use_cache = False
        shard_model(model, cfg.policy.reshard_after_forward, DTYPES.get(cfg.policy.param_dtype))
        if self.rank != 0:
            host = None  # a colocated hf engine's copy is made; only rank 0's feeds the shards
        load_shards(model, host, self.device)
        self.model = model
        self.ref_model = None  # with LoRA the reference is self.model with its adapters off
        if cfg.grpo.loss.reference_policy_kl_penalty > 0 and self.lora is None:
            # The same weights as the policy's start (host has no adapters without LoRA): no second read.
            ref = build_empty_model(
                self.model_path, cfg.model.dtype, cfg.model.trust_remote_code, cfg.model.attn_implementation
            )
            ref.requires_grad_(False)
            if self.packed_attention:
                packed_attention.install(ref, cfg.model.attn_implementation or "sdpa", self.sp)
            shard_model(ref, True, DTYPES.get(cfg.policy.param_dtype))
            load_shards(ref, host, self.device)
            self.ref_model = ref.eval()
        del host
        p = cfg.policy
        self.optimizer = adamw(
            self._trainable(), lr=p.learning_rate, betas=p.adam_betas, eps=p.adam_eps, weight_decay=p.weight_decay
        )
        warmup = max(0, p.warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
        )
        n_params = sum(t.numel() for t in self.model.parameters())
        n_trainable = sum(t.numel() for t in self._trainable())
        return {"num_params": n_params, "trainable_params": n_trainable, "pad_id": self.tokenizer.pad_token_id}

    def _trainable(self) -> list[torch.nn.Parameter]:
        """What the optimizer steps: every parameter, or with LoRA the adapters alone."""
        return [p for p in self.model.parameters() if p.requires_grad]

    # ----- generation (colocated) ------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
        """Sample with the colocated engine; it stays awake through several calls (rollout turns, rounds),
        until the policy's next forward (:meth:`_engine_to_sleep`). One asleep wakes itself first."""
        self._engine_awake = True
        return self.engine.generate(prompts, n, params)

    def _engine_to_sleep(self) -> None:
        """Before the policy's own forwards: generation is over until the next refit, so the colocated
        engine gives its memory back (once; logprob passes and training follow each other)."""
        if self.engine is not None and self._engine_awake:
            self.engine.sleep()
            self._engine_awake = False

    def refresh_engine(self) -> None:
        """Gather the updated full weights into the colocated engine (collective), in the order that keeps
        the device's peak low: what training cached goes back to the device first, the engine's weights
        wake, the new ones load one FSDP unit at a time, and only then does the KV cache wake."""
        torch.cuda.empty_cache()  # a no-op without CUDA: the same call on every device
        self.engine.wake_up(tags=["weights"])
        if self.lora is not None:
            self.engine.update_adapter(self.iter_adapter_weights(self.engine_dtype))
        else:
            self.engine.update_weights(self.iter_full_weights(self.engine_dtype))
        torch.cuda.empty_cache()  # the gathered units, freed: the KV cache's allocator cannot use the cache
        self.engine.wake_up(tags=["kv_cache"])
        self._engine_awake = True

    @property
    def engine_dtype(self) -> torch.dtype:
        return DTYPES[self.cfg.engine_dtype]

    def iter_full_weights(self, dtype: torch.dtype | None = None):
        """Yield (name, full tensor) for every parameter; every rank must iterate (collective).

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
        return self._gather_units(streams.for_device(self._param_device()), dtype)

    def _param_device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def _gather_units(self, fence: streams.NoStreams | streams.CudaStreams, dtype: torch.dtype | None):
        reshard = self.cfg.policy.reshard_after_forward
        groups = self._params_by_unit()
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
                        p = self.model.get_parameter(name).detach()  # after unshard: the unit's full tensor
                        if hasattr(p, "full_tensor"):  # not gathered by a unit (e.g. no FSDP at all): its own
                            p = p.full_tensor()
                        if dtype is not None and p.dtype != dtype:
                            p = p.to(dtype)  # a tensor of its own
                        elif reshard and unit is not None:
                            # The unit's gathered buffer is freed below, and a caller may hold tensors across
                            # units (vLLM's packed NCCL sender keeps a bucket's views until it sends them).
                            p = p.clone()
                    yield name, fence.hand_over(p)
                if reshard and unit is not None:
                    with fence.producing():
                        unit.reshard()
        finally:
            with fence.producing():
                if pending is not None:
                    pending.wait()  # a gather in flight must land before its buffers are freed
                if reshard:
                    self._reshard()

    def iter_adapter_weights(self, dtype: torch.dtype | None = None):
        """Yield (name, full tensor) for every adapter parameter (LoRA), in module order; every rank must
        iterate (collective). Each is gathered on its own (``full_tensor``), not through its FSDP unit,
        whose gather would bring the frozen base weights along: a refit moves the adapters alone. The
        stream rule is :meth:`iter_full_weights`'."""
        return self._gather_adapters(streams.for_device(self._param_device()), dtype)

    @torch.no_grad()
    def _gather_adapters(self, fence: streams.NoStreams | streams.CudaStreams, dtype: torch.dtype | None):
        for name, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            with fence.producing():
                p = p.detach()
                p = p.full_tensor() if hasattr(p, "full_tensor") else p.clone()
                if dtype is not None and p.dtype != dtype:
                    p = p.to(dtype)
            yield name, fence.hand_over(p)

    def _params_by_unit(self) -> list[tuple[Any, list[str]]]:
        """(FSDP unit, the names of the parameters it manages), units in module order; ``None`` first for
        parameters no unit manages. A parameter belongs to its innermost unit: a unit gathers only its
        own parameters, not its child units'."""
        from torch.distributed.fsdp import FSDPModule

        units = [(prefix, m) for prefix, m in self.model.named_modules() if isinstance(m, FSDPModule)]
        groups: dict[int, list[str]] = {}
        for name, _ in self.model.named_parameters():
            owner = max(
                (i for i, (prefix, _) in enumerate(units) if not prefix or name.startswith(prefix + ".")),
                key=lambda i: len(units[i][0]),
                default=None,
            )
            groups.setdefault(-1 if owner is None else owner, []).append(name)
        loose = [(None, groups.pop(-1))] if -1 in groups else []
        return loose + [(units[i][1], groups[i]) for i in sorted(groups)]

    def _fsdp_units(self) -> list:
        from torch.distributed.fsdp import FSDPModule

        return [m for m in self.model.modules() if isinstance(m, FSDPModule)]

    def _reshard(self) -> None:
        """Free gathered weights (a no-op on units already sharded): before state dicts and loads."""
        for unit in self._fsdp_units():
            unit.reshard()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameters on CPU (collective). For tests and small models; checkpoints use DCP."""
        self._reshard()
        return {
            name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
            for name, p in self.model.named_parameters()
        }

    def engine_state_dict(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().cpu().clone() for name, p in self.engine.model.named_parameters()}

    # ----- weight broadcast (disaggregated) --------------------------------------------------------
    def weight_metadata(self) -> dict:
        """The update info of every weight transfer (vLLM's names, dtype_names, shapes), without gathering:
        what :meth:`iter_full_weights` yields, in its order, at the engine's dtype."""
        from trainer.generation.weight_transport import WeightMeta

        dtype, params = self.engine_dtype, dict(self.model.named_parameters())
        if self.lora is not None:  # the adapters alone, in iter_adapter_weights' order
            names = [name for name, p in params.items() if p.requires_grad]
        else:
            names = [name for _, unit_names in self._params_by_unit() for name in unit_names]  # the gather's order
        return WeightMeta.of((name, params[name].shape, dtype) for name in names).update_info()

    def init_weight_sync(self, init_info: dict) -> None:
        """Rank 0 opens the sending end (the rendezvous's host; the engines join at the same time)."""
        from trainer.generation.senders import open_sender

        if self.rank == 0:
            self.sender = open_sender(self.cfg.generation.backend, init_info, self.device)

    def close_weight_sync(self) -> None:
        """Rank 0 leaves the weight group last, as the store's host (the driver calls every side at once)."""
        if getattr(self, "sender", None) is not None:
            self.sender.close()

    def broadcast_weights(self, update_info: dict) -> dict[str, float]:
        """All ranks gather; rank 0 sends the full tensors that ``update_info`` announced to the engines
        (:mod:`trainer.generation.weight_transport`); with LoRA, the adapters alone."""
        if self.lora is not None:
            weights = self.iter_adapter_weights(self.engine_dtype)
        else:
            weights = self.iter_full_weights(self.engine_dtype)
        if self.rank != 0:
            for _ in weights:  # the gathers are collectives: every rank takes part
                pass
            return {}
        from trainer.generation.weight_transport import WeightMeta

        stats = self.sender.send(weights, WeightMeta.from_update_info(update_info))
        return {"buckets": stats.buckets, "bytes": stats.bytes, "seconds": stats.seconds}

    # ----- logprobs --------------------------------------------------------------------------------
    def _set_row(self, row) -> None:
        """The packed row the policy's attention runs on until the next forward (None: a padded batch)."""
        if self.packed_attention:
            from trainer.policy.packed_attention import set_row

            set_row(row)

    def _window_logits(self, model, batch: PaddedBatch | PrefixBatch | PackedBatch) -> torch.Tensor:
        """(B, K, V) logits at the positions that predict ``batch.labels``; (1, M, V) for a packed
        batch, at its ``predict`` positions."""
        dev = self.device
        self._set_row(None)
        if isinstance(batch, PackedBatch):
            # No attention mask and no cache. sdpa: the policy's attention runs each sample of the row on
            # its own (packed_attention, told the row below). Flash attention gets the boundaries
            # themselves, so it runs its varlen kernel without inferring them in every layer. Others
            # (eager): transformers reads the boundaries from the position ids (a block-diagonal mask).
            varlen = {}
            if "flash" in (getattr(model.config, "_attn_implementation", None) or ""):
                cu = batch.cu_seqlens.to(dev)
                varlen = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=batch.max_seqlen,
                              max_length_k=batch.max_seqlen)
            input_ids, position_ids, predict = batch.input_ids, batch.position_ids, batch.predict
            if self.sp is not None:  # this rank's slice of the row; attention sees the whole row
                row, input_ids, position_ids, predict = self.sp.split(batch)
                self._set_row(row)
                varlen = {}
            elif self.packed_attention:
                self._set_row(Row(batch.cu_seqlens, batch.max_seqlen))
            out = model(
                input_ids=input_ids.to(dev),
                position_ids=position_ids.to(dev),
                logits_to_keep=predict.to(dev),  # project only the positions that predict responses
                use_cache=False,
                **varlen,
            )
            return out.logits
        if isinstance(batch, PaddedBatch):
            width = batch.input_ids.shape[1]
            out = model(
                input_ids=batch.input_ids.to(dev),
                attention_mask=batch.attention_mask.to(dev),
                logits_to_keep=width - batch.start,  # project only the positions that predict responses
                use_cache=False,
            )
            return out.logits[:, :-1]  # the last position predicts past the end
        from transformers import DynamicCache

        # Each distinct prompt once; its keys and values (still in the autograd graph) are then
        # gathered to every sample of it, so its gradient sums over the group as a padded batch would.
        prompt_mask = batch.prompt_mask.to(dev)
        cache = DynamicCache(config=getattr(model, "config", None))
        prompt = model(
            input_ids=batch.prompt_ids.to(dev),
            attention_mask=prompt_mask,
            position_ids=(prompt_mask.cumsum(1) - 1).clamp(min=0),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        rows = batch.rows.to(dev)
        cache = prompt.past_key_values
        cache.batch_select_indices(rows)
        lengths = prompt_mask.sum(1)[rows]  # (B,)
        width = batch.response_ids.shape[1]
        response = model(
            input_ids=batch.response_ids.to(dev),
            attention_mask=torch.cat([prompt_mask[rows], batch.response_mask.to(dev)], dim=1),
            position_ids=lengths[:, None] + torch.arange(width, device=dev),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=width,
        )
        first = prompt.logits[:, -1:][rows]  # (B, 1, V): the prompt's last position predicts token 0
        return torch.cat([first, response.logits[:, :-1]], dim=1)

    def _forward_logprobs(self, model, batch: PaddedBatch | PrefixBatch | PackedBatch, with_entropy: bool = False):
        """(B, K) logprobs of the window's labels, and optionally (B, K) entropy, from one forward
        and one chunked float32 pass over the logits (kept in the model's dtype)."""
        logits = self._window_logits(model, batch)  # (B, K, V), or (1, M, V) packed (M of this slice with SP)
        packed = isinstance(batch, PackedBatch)
        labels = batch.flat_labels[None] if packed else batch.labels
        if packed and self.sp is not None:
            labels = labels[:, self.sp.first : self.sp.first + logits.shape[1]]
        temperature = self.cfg.generation.temperature
        logprobs, entropy = core_algos.logprobs_and_entropy(
            logits,
            labels.to(self.device),
            chunk_size=core_algos.logit_chunk_rows(logits.shape[-1], logits.device),
            temperature=temperature if temperature > 0 else 1.0,  # score the distribution we sampled from
            with_entropy=with_entropy,
        )
        if packed and self.sp is not None:  # every slice's tokens, so each rank of the group has them all
            from trainer.policy.ulysses import gather_slices

            logprobs = gather_slices(logprobs[0], self.sp.counts, self.sp)[None]
            entropy = gather_slices(entropy[0], self.sp.counts, self.sp)[None] if entropy is not None else None
        if packed:  # (1, M) -> the (B, C) window the loss reads, as for the padded layouts
            logprobs = batch.to_window(logprobs[0])
            entropy = batch.to_window(entropy[0]) if entropy is not None else None
        return logprobs, entropy

    def _prefix_layouts(self, mbs: list[list[Sample]]) -> list[bool]:
        """Per micro-batch, whether it runs the shared-prompt layout. The shared-prompt layout runs each
        prompt once through a KV cache: not under activation checkpointing (a checkpointed layer
        recomputes without the cache) nor split over SP ranks. With packing on too, a micro-batch takes it
        where it runs fewer positions (:func:`prefers_prefix`) on every rank: the layouts differ in how
        many forwards they make (two against one), and each forward's FSDP gathers are collectives, so
        the ranks agree (one all-reduce per pass). Where packed rows run a fused varlen kernel (a GPU in
        bf16/fp16) they are always taken: on an H100 the shared-prompt layout took 1.8-3.9x as long as packed
        rows on every batch measured, among them a prompt-heavy one where it ran under half the positions
        (bench/README.md): its second forward and masked attention cost more than the positions it saves."""
        p = self.cfg.policy
        if not (p.shared_prefix and not p.activation_checkpointing and self.sp is None) or self._fused_rows:
            return [False] * len(mbs)
        if not p.sequence_packing:
            return [True] * len(mbs)
        wants = torch.tensor([prefers_prefix(mb) for mb in mbs], dtype=torch.int32, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1 and len(mbs):
            dist.all_reduce(wants, op=dist.ReduceOp.MIN)
        return [bool(w) for w in wants.tolist()]

    def _batch(self, samples: list[Sample], prefix: bool) -> PaddedBatch | PrefixBatch | PackedBatch:
        pad = self.tokenizer.pad_token_id
        if prefix:
            return prefix_batch(samples, pad)
        return pack_batch(samples, pad) if self.cfg.policy.sequence_packing else pad_batch(samples, pad)

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
            indices = self._micro_batches(samples, p.logprob_micro_batch_size, p.logprob_max_tokens_per_microbatch)
            mbs = [[samples[i] for i in idx] for idx in indices]
            for idx, mb, prefix in zip(indices, mbs, self._prefix_layouts(mbs)):
                batch = self._batch(mb, prefix)
                logprobs, _ = self._forward_logprobs(model, batch)
                self._set_row(None)
                for i, lp in zip(idx, unpad_logprobs(mb, batch, logprobs.cpu())):
                    result[i] = lp
        return result

    def _reference_view(self, reference: bool):
        """With LoRA the reference is the policy with its adapters off; otherwise nothing to switch."""
        if reference and self.lora is not None:
            from trainer.models.lora import adapters_disabled

            return adapters_disabled(self.model)
        import contextlib

        return contextlib.nullcontext()

    # ----- training --------------------------------------------------------------------------------
    def train(self, minibatches: list[list[Sample]], global_counts: list[dict[str, float]]) -> dict[str, float]:
        """One optimizer step per mini-batch. ``global_counts[i]`` holds the mini-batch's token and
        sequence counts summed over all ranks, so each rank's loss is its share of the global mean.
        A mini-batch may be empty on every rank (all its samples skipped for a zero advantage): the
        step then applies a zero gradient. Entropy, ppo_kl and clip fraction are means over the
        tokens trained on."""
        cfg, loss_cfg = self.cfg, self.cfg.grpo.loss
        has_reference = self.ref_model is not None or (self.lora is not None and loss_cfg.reference_policy_kl_penalty > 0)
        objective = Objective(loss_cfg, max_len=cfg.generation.max_new_tokens, kl_penalty=has_reference)
        self._engine_to_sleep()  # when no logprob pass came first
        self.model.train()
        # The same keys on every rank, and present when a step trained on nothing (all skipped); sums over
        # tokens (trainer.algorithms.objective), normalised after the all-reduce below.
        sums: dict[str, float] = dict.fromkeys(("loss", *objective.metric_keys()), 0.0)
        if cfg.policy.compute_entropy:
            sums["entropy"] = 0.0

        def add(key: str, value: float) -> None:
            sums[key] = sums.get(key, 0.0) + float(value)

        def on_device(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(self.device)

        for samples, counts in zip(minibatches, global_counts):
            self.optimizer.zero_grad(set_to_none=True)
            mbs = [
                [samples[j] for j in idx]
                for idx in self._micro_batches(samples, cfg.policy.micro_batch_size, cfg.policy.max_tokens_per_microbatch)
            ]
            for i, (mb, prefix) in enumerate(zip(mbs, self._prefix_layouts(mbs))):
                # Reduce-scatter gradients once per optimizer step, not once per micro-batch.
                self.model.set_requires_gradient_sync(i == len(mbs) - 1)
                batch = self._batch(mb, prefix)
                logprobs, entropy = self._forward_logprobs(self.model, batch, cfg.policy.compute_entropy)
                mask = batch.loss_mask.to(self.device)
                loss, metric_sums = objective(LossInputs(
                    logprobs=logprobs,
                    advantages=batch.advantages.to(self.device),
                    mask=mask,
                    num_tokens=counts["tokens"],
                    num_seqs=counts["seqs"],
                    old_logprobs=on_device(batch.old_logprobs),
                    behaviour_logprobs=on_device(batch.gen_logprobs),
                    ref_logprobs=on_device(batch.ref_logprobs) if objective.kl is not None else None,
                ))
                # FSDP averages gradients over ranks; the loss already divides by global counts.
                (loss * self.world_size).backward()
                self._set_row(None)  # after backward: a checkpointed one recomputes on the row
                add("loss", loss.detach())
                for key, value in metric_sums.items():
                    add(key, value)
                if entropy is not None:
                    add("entropy", (entropy * mask).sum())
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
        self.model.set_requires_gradient_sync(True)
        # Sum over ranks, then normalise: token-level metrics by tokens, per-step ones by steps.
        if self.sp is not None and not self.sp.leader:  # a group's sums once: its ranks computed the same
            sums = {k: (v if k == "grad_norm" else 0.0) for k, v in sums.items()}
        keys = sorted(sums)
        totals = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)
        agg = dict(zip(keys, totals.tolist()))
        n_steps = len(minibatches)
        tokens = max(agg.pop("tokens"), 1.0)
        gen_tokens = max(agg.pop("gen_tokens"), 1.0)
        out = {"loss": agg.pop("loss") / n_steps, "grad_norm": agg.pop("grad_norm") / (n_steps * self.world_size)}
        for key in ("gen_logprob_abs_diff", "gen_train_kl", "is_flagged"):
            out[key] = agg.pop(key) / gen_tokens
        out.update({k: v / tokens for k, v in agg.items()})
        out["lr"] = self.scheduler.get_last_lr()[0]
        return out

    def perf_stats(self) -> dict[str, Any]:
        """This rank's peak memory since the last call and its device's peak FLOP/s for the policy's compute
        dtype (a GPU's from trainer.perf's table; on a CPU a matmul measured once on this rank's threads)."""
        from trainer import perf

        peak, source = perf.device_peak_flops(self.device, self.cfg.policy.param_dtype or self.cfg.model.dtype)
        return {"peak_memory_bytes": perf.peak_memory_bytes(self.device), "peak_flops": peak, "peak_source": source}

    # ----- checkpoints (torch DCP: every rank writes its own shards in parallel) --------------------
    def _state_options(self):
        """With LoRA the checkpoint holds the adapters alone: the frozen base is the model's own files."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        lora = self.lora is not None
        return StateDictOptions(ignore_frozen_params=lora, strict=not lora)

    def _dcp_state(self):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        self._reshard()  # the state dict is of the sharded parameters
        model = get_model_state_dict(self.model, options=self._state_options())
        if self.lora is not None:  # a tied lm_head comes along under its second name despite being frozen
            from trainer.models.lora import is_adapter

            model = {k: v for k, v in model.items() if is_adapter(k)}
        optim = {"optimizer": get_optimizer_state_dict(self.model, self.optimizer), "scheduler": self.scheduler.state_dict()}
        return model, optim

    def save_checkpoint(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        model, optim = self._dcp_state()
        dcp.save(model, checkpoint_id=os.path.join(path, "policy", "weights"))
        dcp.save(optim, checkpoint_id=os.path.join(path, "policy", "optimizer"))
        if self.rank == 0:
            self._save_hf_files(os.path.join(path, "policy"))
        dist.barrier()

    def _save_hf_files(self, policy_dir: str) -> None:
        """Tokenizer and base config beside the weights, so conversion needs nothing else."""
        import shutil

        self.tokenizer.save_pretrained(os.path.join(policy_dir, "tokenizer"))
        hf_dir = os.path.join(policy_dir, "hf_config")
        os.makedirs(hf_dir, exist_ok=True)
        for name in ("config.json", "generation_config.json"):
            src = os.path.join(self.model_path, name)
            if os.path.isfile(src):
                shutil.copy(src, hf_dir)
            elif name == "config.json":
                self.model.config.save_pretrained(hf_dir)
        if self.lora is not None:  # the weights are adapters: what they adapt, for conversion and evaluation
            from trainer.config import to_dict
            from trainer.models.lora import LORA_FILE

            with open(os.path.join(policy_dir, LORA_FILE), "w") as f:
                json.dump({"lora": to_dict(self.lora), "model_name": self.cfg.model.name,
                           "model_path": self.model_path}, f, indent=2)

    def load_checkpoint(self, path: str) -> None:
        """Load weights and optimizer state; DCP reshards, so the rank count may differ from the save."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        model, optim = self._dcp_state()
        dcp.load(model, checkpoint_id=os.path.join(path, "policy", "weights"))
        set_model_state_dict(self.model, model, options=self._state_options())
        dcp.load(optim, checkpoint_id=os.path.join(path, "policy", "optimizer"))
        set_optimizer_state_dict(self.model, self.optimizer, optim["optimizer"])
        self.scheduler.load_state_dict(optim["scheduler"])

    def shutdown(self) -> None:
        if getattr(self, "engine", None) is not None:
            self.engine.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
