"""``python -m trainer.tools.plan EXP [key=value ...]``: will an experiment fit its GPUs? Per GPU, before
anything is deployed.

For the experiment's config (Hydra, with the overrides given) and its values file (GPU type), the
plan adds up what one device holds at its peak:

- **training GPUs** (FSDP2 over ``train_world_size`` ranks): master weights, gradients and AdamW's two
  moments, each sharded; the units FSDP gathers in ``policy.param_dtype`` (two blocks in flight and
  the root, which stays gathered); the reference policy when the KL penalty is on; activations of one
  micro-batch (every block's saved tensors, or only block inputs plus one block when activation
  checkpointing recomputes them); the logprob pass's working set (one tile of the LM head's logits at a
  time, :mod:`trainer.algorithms.linear_logprobs`, never the micro-batch's whole (positions x vocabulary)
  logits); and a fixed runtime reserve (CUDA context, NCCL, allocator slack);
- **a colocated vLLM engine** on the same GPUs: its ``gpu_memory_utilization`` share while it
  generates, beside the policy's sharded state (which stays on the GPU); asleep it frees both its
  weights and its KV cache, so training does not count it. Its sleep level decides where the weights go
  (:func:`host_device`): nowhere at level 2 (full-weight refits overwrite them), to the training node's
  host memory at level 1 (LoRA), one copy per GPU, against the values file's memory request;
- **generation GPUs** (disaggregated): the engine's weights split over ``tensor_parallel_size`` and
  the KV cache left in its share, as whole sequences of ``policy.max_total_sequence_length``;
- **the model-scored rewards** the run uses (:class:`Scorer`, each planned where its config section says:
  :mod:`trainer.tools.plan_rewards` for the reward model and the judge): each replica on a GPU of the worker
  group that offers its section's ``resource`` (its replicas' GPUs are ``gpu.type``'s too), a vLLM engine's
  share of it, or in host memory for CPU replicas. Either way the plan also says whether it would fit
  **beside the policy**, resident on every training GPU at the policy's peak: an alternative placement,
  reported but not part of the verdict;
- **transients**, what a training GPU holds for a moment only: loading, each rank's shards and one full
  tensor broadcast from rank 0 (the largest: the embeddings), beside a colocated engine already built
  (:mod:`trainer.policy.sharded_init`: the model is sharded on the meta device before any weight is
  read, so the whole model is never on a GPU); then the units FSDP gathers in training and refits. The
  plan names the largest.

A **mixture of experts** (:class:`trainer.models.shape.MoE`) is planned on its total parameters: every
expert is stored, gets gradients and AdamW's moments, is gathered with its block and is sent at every
refit; only activations follow the routing (each token's ``top_k`` routed copies through its experts).
The plan reports the parameters active per token (what MFU counts, :mod:`trainer.perf`), the bytes each
engine receives per refit, and with ``policy.moe.router_replay`` the routes that travel with a step's
batch (vLLM returns ``routed_experts`` per sampled sequence, ``[tokens, layers, top_k]`` in uint8 up to
256 experts, else uint16) and the capture buffer each engine keeps on its GPU
(``max_num_batched_tokens x layers x top_k`` int32: vLLM 0.32's
``model_executor/layers/fused_moe/routed_experts_capturer.py``).

It says ``fits`` or ``does not fit``, which term dominates, and the key to change. The model's shape
comes from instantiating it on the ``meta`` device (exact parameter counts for any architecture,
no memory): from its local directory, the hub cache, or, offline, the public ``config.json`` values of
the models our experiments name (:data:`KNOWN_CONFIGS`).

The activation and logit terms are checked against measured peaks on CPU (``tests/test_plan.py``,
``make plan-check``); on paper against the published set-ups our experiments follow. No peer ships
this: NeMo-RL's and verl's users find out by running out of memory.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from trainer.models.shape import KNOWN_CONFIGS, Shape, ShapeError, model_shape  # noqa: F401 (plan.model_shape)
from trainer.perf import ModelFlops

GiB = 2**30
# Memory per GPU as `nvidia-smi --query-gpu=memory.total` reports it (MiB): what CUDA can allocate from.
GPU_MEMORY = {"h200": 143771 * 2**20, "b200": 183359 * 2**20}
GPU_NAMES = {"h200": "H200 (a3-ultragpu-8g)", "b200": "B200 (a4-highgpu-8g)"}
# CUDA context, NCCL communicators and buffers, the caching allocator's fragmentation: what a GPU
# process holds beyond its tensors (measured 1.5-3 GiB on H100/H200 policy ranks in NeMo-RL and verl
# reports; we take the upper end).
RUNTIME_RESERVE = 3 * GiB
# A CPU node (the ranks, their engines and the driver share one machine's memory), per process, beyond the
# tensors counted: Python, torch, transformers and Ray's worker, the tokenizers, and what the allocator keeps
# of freed memory. Measured as each step's peak resident set (trainer.perf), AMD EPYC, 2026-12: a policy rank
# held 2.9 GiB more than its terms on cpu-demo (SmolLM2-135M) and 3.7 on cpu-gemma3 (Gemma 3 270M), hf engines.
CPU_RANK_RUNTIME = 3 * GiB
# A vLLM engine's own beside its weights, packed kernels and KV cache: vLLM's import (0.3 GiB) and its one
# tokenizer (0.3 GiB at Gemma 3's 262k vocabulary), measured.
CPU_ENGINE_RUNTIME = 0.6 * GiB
# The driver (0.7-0.9 GiB on cpu-gemma3) and Ray's own processes (GCS, raylet, agents: 0.3 GiB).
CPU_DRIVER = 1 * GiB
# Ray's memory monitor kills workers once the node's use passes this share (RAY_memory_usage_threshold).
RAY_MEMORY_THRESHOLD = 0.95
# Terms no key changes: the largest term a plan names is the largest of the others.
FIXED_TERMS = ("runtime reserve", "runtime", "engine runtime", "driver and Ray")
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class PlanError(ValueError):
    """Bad input to the plan: one line naming the problem and the fix."""


# ----- the terms ------------------------------------------------------------------------------------


@dataclass
class Device:
    """One device's plan: named terms in bytes against a capacity."""

    role: str  # "training GPU", "generation GPU", "CPU node"
    capacity: float
    terms: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # Terms that never peak together: the total counts the larger of each pair's sides (activations
    # are freed as backward goes, while the gradients it produces accumulate).
    either: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = ()
    # The key to change for a term, where it is this device's own (else ADVICE's).
    advice: dict[str, str] = field(default_factory=dict)

    @property
    def total(self) -> float:
        apart = {k for pair in self.either for side in pair for k in side}
        total = sum(v for k, v in self.terms.items() if k not in apart)
        for a, b in self.either:
            total += max(sum(self.terms.get(k, 0.0) for k in a), sum(self.terms.get(k, 0.0) for k in b))
        return total

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    @property
    def dominant(self) -> str:
        """The largest term a key changes (fixed reserves aside, unless there is nothing else)."""
        movable = [k for k in self.terms if k.split(" x ")[0] not in FIXED_TERMS] or list(self.terms)
        return max(movable, key=self.terms.get)


@dataclass(frozen=True)
class Micro:
    """One micro-batch as the policy runs it: ``tokens`` through the model, ``logit_rows`` projected."""

    tokens: int
    logit_rows: int
    sequence: int  # the longest sequence in it (attention's working set)


def micro_batch(cfg, training: bool = True) -> Micro:
    """The largest micro-batch one rank runs: the token budget when there is one (per rank), else the
    fixed count of the longest sequences, split over ``policy.sequence_parallel_size`` ranks."""
    p = cfg.policy
    budget = p.max_tokens_per_microbatch if training else p.logprob_max_tokens_per_microbatch
    count = p.micro_batch_size if training else p.logprob_micro_batch_size
    longest, sp = p.max_total_sequence_length, p.sequence_parallel_size
    tokens = budget or -(-count * longest // sp)
    if p.sequence_packing:  # logits only at the positions that predict response tokens
        rows = tokens if budget else min(tokens, -(-count * cfg.generation.max_new_tokens // sp))
    else:  # logits from the shortest prompt on: at worst (one prompt token) every position
        rows = tokens
    return Micro(tokens=tokens, logit_rows=rows, sequence=longest)


def block_activation_bytes(
    shape: Shape, tokens: int, dtype_bytes: int, sequence_parallel: bool = False
) -> float:
    """What one decoder block keeps for its backward, per micro-batch: its input and both norms'
    outputs (h each, and the residual after attention), q/k/v before and q/k after the rotary
    embedding, attention's output, and the gated MLP's four intermediates (gate, up, act(gate),
    act(gate)*up). Attention itself keeps O(tokens) (flash / memory-efficient kernels). Sequence
    parallel, attention's q/k/v and output also exist in the other layout (heads / S over the whole
    row: as many elements as a rank's slice with every head), for the all-to-alls' backward. A MoE
    block (:func:`moe_mlp_per_token`) keeps its experts' intermediates for each routed copy of a token."""
    h, i, hd = shape.hidden, shape.intermediate, shape.head_dim
    q, kv = shape.heads * hd, shape.kv_heads * hd
    mlp = 4 * i if shape.moe is None else moe_mlp_per_token(shape)
    per_token = 4 * h + (q + 2 * kv) + (q + kv) + q + mlp
    if sequence_parallel:
        per_token += (q + 2 * kv) + q
    return tokens * per_token * dtype_bytes


def moe_mlp_per_token(shape: Shape) -> int:
    """Elements a MoE block's MLP keeps per token for its backward: for each of the token's ``top_k``
    routed copies, the gathered input, gate and up, act(gate), act(gate)*up and the expert's output before
    its gate weight scales it (transformers' grouped-GEMM experts, its default, as a saved-tensors hook
    counts them; its experts loop, ``experts_implementation=eager``, keeps each weighted output too: one
    hidden more per copy); a shared expert's four intermediates; the router's logits and their float32
    softmax (three 16-bit elements per expert). A model with dense layers too: the larger of a MoE and a
    dense block's."""
    m = shape.moe
    assert m is not None
    routed = m.top_k * (2 * shape.hidden + 4 * m.intermediate) + 4 * m.shared_intermediate + 3 * m.experts
    return routed if m.layers == shape.layers else max(routed, 4 * shape.intermediate)


# Activations and logits peak as backward starts, when almost no gradient exists yet; at its end the
# gradients are all there and the activations gone (checked with torch's FSDPMemTracker: bench/bench_plan.py).
TRAINING_EITHER = ((("activations", "logits"), ("gradients (sharded)",)),)


def training_terms(cfg, shape: Shape, world: int) -> dict[str, float]:
    """Bytes per training rank, by term; :func:`training_peak` adds them up as they coexist."""
    p = cfg.policy
    master = BYTES[cfg.model.dtype]
    compute = BYTES[p.param_dtype or cfg.model.dtype]
    mb = micro_batch(cfg, training=True)
    sp = p.sequence_parallel_size > 1
    if p.lora.enabled:
        # A frozen base in model.dtype; float32 adapters are all that has gradients and AdamW state
        # (trainer/models/lora.py), and the reference is the base with them switched off.
        adapters = shape.adapter_params(p.lora.rank, list(p.lora.target_modules))
        terms = {
            "weights (sharded)": (shape.params * master + adapters * 4) / world,
            "gradients (sharded)": adapters * 4 / world,
            "optimizer (AdamW, sharded)": 2 * adapters * 4 / world,
        }
    else:
        terms = {
            "weights (sharded)": shape.params * master / world,
            "gradients (sharded)": shape.params * master / world,
            "optimizer (AdamW, sharded)": 2 * shape.params * master / world,
        }
    if p.reshard_after_forward:
        # The root stays gathered from forward to backward; two blocks are in flight (one computing,
        # one prefetched). A block's unsharded gradient is reduce-scattered as soon as it is complete.
        terms["gathered units"] = (shape.root_params + 2 * shape.block_params) * compute
    else:
        terms["gathered units"] = shape.params * compute
    if cfg.grpo.loss.reference_policy_kl_penalty > 0 and not p.lora.enabled:
        terms["reference policy (sharded)"] = shape.params * master / world
    if p.activation_checkpointing:
        # Every block's input; in backward one block recomputed, and the gradients flowing through it
        # (half as much again, as measured on CPU: bench/bench_plan.py).
        block = block_activation_bytes(shape, mb.tokens, compute, sp)
        saved = shape.layers * mb.tokens * shape.hidden * compute + 1.5 * block
    else:
        saved = shape.layers * block_activation_bytes(shape, mb.tokens, compute, sp)
    terms["activations"] = saved
    terms["logits"] = logit_bytes(shape, mb.logit_rows, compute, cfg.cluster.use_gpus, **head_work(cfg))
    if replays_routes(cfg, shape):
        # The engine's expert ids for the micro-batch's tokens, as int64 indices at most (what gathers take).
        assert shape.moe is not None
        terms[ROUTES_TERM] = mb.tokens * shape.layers * shape.moe.top_k * 8
    return terms


def logit_bytes(shape: Shape, rows: int, dtype_bytes: int, gpu: bool = True, *, transform: tuple = (),
                scaled: bool = False, with_entropy: bool = True, fused: bool | None = None) -> float:  # fmt: skip
    """The logprob pass at its peak: one (positions x vocabulary block) tile at the bytes per element the
    tile holds for what the run does (:func:`trainer.algorithms.linear_logprobs.tile_bytes`: the model's
    ``transform`` after its head, a temperature other than 1, entropy, eager or ``fused`` tiles, None: the
    device's default), in forward, or in backward beside the float32 gradient of the ``rows`` hidden states it
    sums over the blocks (and, in 16 bits, each block's share of it before the sum); at the end that gradient
    beside its cast to the model's dtype. Logits that stay under
    :data:`trainer.policy.forward.TILE_ABOVE_BYTES` are projected whole: then they and their gradient."""
    import torch

    from trainer.algorithms import linear_logprobs
    from trainer.policy.forward import TILE_ABOVE_BYTES

    if rows * shape.vocab * 4 <= TILE_ABOVE_BYTES:
        return 2 * rows * shape.vocab * dtype_bytes

    device = torch.device("cuda" if gpu else "cpu")
    budget = linear_logprobs.tile_elements(device)
    step, block = linear_logprobs.tiles(rows, shape.vocab, budget)
    fused = linear_logprobs.fused_default(device) if fused is None else fused
    forward, backward = linear_logprobs.tile_bytes(dtype_bytes, transform, scaled, with_entropy, fused)
    tile = min(rows, step) * block
    grad_hidden = rows * shape.hidden * 4
    # a 16-bit block's product G @ W_b is made before it is added to the float32 sum
    product = rows * shape.hidden * dtype_bytes if dtype_bytes < 4 else 0
    return max(
        tile * forward,
        tile * backward + grad_hidden + product,
        grad_hidden + rows * shape.hidden * dtype_bytes,
    )


def head_work(cfg) -> dict:
    """What the run's training pass does in the LM head's tiles, as :func:`logit_bytes` counts it: the
    transform the model's config names after the head (a softcap per softcapping key, a scale per multiplier
    other than 1: :data:`trainer.policy.forward.TRANSFORM_KEYS`), the sampling temperature, entropy, and
    ``policy.fused_head``."""
    from trainer.models.shape import _hf_config
    from trainer.policy.forward import TRANSFORM_KEYS

    try:
        config = _hf_config(cfg.model.name, cfg.model.trust_remote_code)[0]
    except ShapeError:  # model_shape already said so; the head's work is then that of a plain head
        config = None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    transform = []
    for key in TRANSFORM_KEYS:
        value = getattr(text, key, None)
        if key == "unpadded_vocab_size" or value is None or isinstance(value, bool):
            continue
        if "soft" in key:
            transform.append(("softcap", float(value)))
        elif value != 1:
            transform.append(("mul", float(value)))
    temperature = cfg.generation.temperature
    return {
        "transform": tuple(transform),
        "scaled": temperature > 0 and temperature != 1,
        "with_entropy": cfg.policy.compute_entropy,
        "fused": cfg.policy.fused_head,
    }


def training_peak(cfg, shape: Shape, world: int) -> float:
    """Bytes a training rank holds at its peak, runtime reserve aside."""
    return Device("training", float("inf"), training_terms(cfg, shape, world), either=TRAINING_EITHER).total


def kv_bytes_per_token(shape: Shape, dtype_bytes: int, tp: int) -> float:
    """K and V of every layer for one token, on one of ``tp`` tensor-parallel GPUs."""
    return 2 * shape.layers * max(1, shape.kv_heads // tp) * shape.head_dim * dtype_bytes


def engine_utilization(cfg) -> float:
    from trainer.generation.vllm_engine import (
        COLOCATED_GPU_MEMORY_UTILIZATION,
        DISAGGREGATED_GPU_MEMORY_UTILIZATION,
    )

    if cfg.generation.gpu_memory_utilization is not None:
        return cfg.generation.gpu_memory_utilization
    return DISAGGREGATED_GPU_MEMORY_UTILIZATION if cfg.disaggregated else COLOCATED_GPU_MEMORY_UTILIZATION


def engine_device(cfg, shape: Shape, capacity: float, role: str) -> Device:
    """A vLLM engine's share of one GPU: its weights (split over TP), vLLM's own activation profile
    (about one max-length batch of logits), and the KV cache that is left, in whole sequences."""
    tp = cfg.generation.tensor_parallel_size
    gen = BYTES[cfg.engine_dtype]
    share = engine_utilization(cfg) * capacity
    weights = shape.params * gen / tp
    seq = cfg.policy.max_total_sequence_length
    per_seq = kv_bytes_per_token(shape, gen, tp) * seq
    dev = Device(role, share, {"engine weights": weights, "KV cache (one sequence)": per_seq})
    if replays_routes(cfg, shape):
        dev.terms[CAPTURE_TERM] = capture_bytes(cfg, shape)
    left = share - sum(v for k, v in dev.terms.items() if k != "KV cache (one sequence)")
    sequences = int(left // per_seq) if per_seq else 0
    dev.notes.append(
        f"KV cache for {max(0, sequences)} sequences of {seq} tokens in the engine's "
        f"{engine_utilization(cfg):g} share ({share / GiB:.1f} GiB)"
    )
    return dev


# ----- a mixture of experts: active parameters, refits, routes ------------------------------------

ROUTES_TERM = "routes (one micro-batch)"
CAPTURE_TERM = "routed-experts capture"
# vLLM 0.32's max_num_batched_tokens for its LLM class on a GPU of 70 GiB or more (not an A100): H100,
# H200, B200 (vllm/engine/arg_utils.py, get_batch_defaults); generation.vllm_kwargs may set it.
VLLM_BATCHED_TOKENS = 16384


def active_params(shape: Shape) -> int:
    """Parameters one token goes through: all of a dense model's; a mixture of experts' without the experts
    it is not routed to (:class:`trainer.perf.ModelFlops`'s count)."""
    if shape.moe is None:
        return shape.params
    return shape.params - ModelFlops.from_shape(shape).unrouted_params


def replays_routes(cfg, shape: Shape) -> bool:
    return shape.moe is not None and cfg.policy.moe.router_replay


def routes_bytes_per_token(shape: Shape) -> int:
    """Bytes of one token's routes as vLLM returns them: every hidden layer's top-k expert ids
    (``[layers, top_k]``), uint8 up to 256 experts, else uint16."""
    assert shape.moe is not None
    return shape.layers * shape.moe.top_k * (1 if shape.moe.experts <= 256 else 2)


def step_tokens(cfg) -> int:
    """The most tokens a step's batch holds: every sample a whole ``policy.max_total_sequence_length``."""
    g = cfg.grpo
    return g.num_prompts_per_step * g.num_generations_per_prompt * cfg.policy.max_total_sequence_length


def capture_bytes(cfg, shape: Shape) -> int:
    """The device buffer a vLLM engine fills with the routes of each forward pass (int32, one row per
    token its scheduler batches: ``max_num_batched_tokens x layers x top_k``)."""
    assert shape.moe is not None
    tokens = cfg.generation.vllm_kwargs.get("max_num_batched_tokens") or VLLM_BATCHED_TOKENS
    return tokens * shape.layers * shape.moe.top_k * 4


def refit_engines(cfg) -> int:
    """Engines a refit sends the weights to: one per policy rank colocated, one per tensor-parallel
    group disaggregated."""
    return cfg.num_generation_workers if cfg.disaggregated else cfg.train_world_size


def refit_bytes(cfg, shape: Shape) -> float:
    """Bytes one engine receives per step in a full-weight refit: every parameter in the engine's dtype."""
    return shape.params * BYTES[cfg.engine_dtype]


def moe_lines(cfg, shape: Shape) -> list[str]:
    """What a mixture of experts adds to the plan, in words: active and total parameters, the refit, the
    routes that travel with a batch."""
    m = shape.moe
    if m is None:
        return [f"  active parameters: not counted ({shape.moe_error})"] if shape.moe_error else []
    active = active_params(shape)
    shared = f" and a shared expert of width {m.shared_intermediate}" if m.shared_intermediate else ""
    lines = [
        f"  mixture of experts: {m.experts} experts of width {m.intermediate} in {m.layers} of {shape.layers} "
        f"layers, {m.top_k} routed per token{shared}: {active / 1e9:.2f}B of the {shape.params / 1e9:.2f}B "
        "parameters active per token (what MFU counts); every expert trains: gradients and optimizer "
        f"state on all {shape.params / 1e9:.2f}B"
    ]
    if cfg.generation.backend == "vllm":
        if cfg.policy.lora.enabled:
            lines.append("  refit: the LoRA adapters only")
        else:
            engines = refit_engines(cfg)
            frozen = ", less policy.freeze's parameters" if cfg.policy.freeze else ""
            lines.append(
                f"  refit: every weight after each step, experts included{frozen}: "
                f"{refit_bytes(cfg, shape) / GiB:.2f} GiB of {cfg.engine_dtype} per engine, x {engines} engines"
            )
    if replays_routes(cfg, shape):
        per_token = routes_bytes_per_token(shape)
        width = "uint8" if m.experts <= 256 else "uint16"
        tokens = step_tokens(cfg)
        lines.append(
            f"  router replay (policy.moe.router_replay): routes of {per_token} B per token ({shape.layers} "
            f"layers x top {m.top_k} x {width}); a step's batch of at most {tokens} tokens carries "
            f"{per_token * tokens / GiB:.2f} GiB of them; each engine captures into "
            f"{capture_bytes(cfg, shape) / 2**20:.0f} MiB of int32 on its GPU"
        )
    return lines


# ----- the model-scored rewards (trainer/tools/plan_rewards.py plans each) ---------------------------------


@dataclass(frozen=True)
class Scorer:
    """A model-scored reward's replicas as the plan counts them (the reward model, the judge): what one replica
    holds, by term, in host memory (``terms(None)``) or on a GPU of that capacity, and, for a vLLM engine, what
    its share of the GPU must hold (``share(capacity)``, a device of its own)."""

    what: str  # what people call it: "reward model", "judge"
    section: str  # its config section (a RewardActorsConfig): "reward_model", "judge"
    shape: Shape
    terms: Callable[[float | None], dict[str, float]]
    batch: str  # its largest batch, in words
    share: Callable[[float], Device | None] = lambda capacity: None
    kind: str = "a model"  # what its model is, on its line of the plan: "a score head", "a causal LM"
    advice: dict[str, str] = field(default_factory=dict)  # the key to change for each of its terms


def replica_dtype(dtype: str, gpu: bool) -> str:
    """A replica's dtype setting as it resolves ``auto``: bfloat16 on a GPU or a CPU with native bf16."""
    if dtype != "auto":
        return dtype
    from trainer import hardware

    return "bfloat16" if gpu or hardware.native_bf16() else "float32"


def scorers(cfg) -> list[Scorer]:
    """The model-scored rewards the run uses, each shaped from its config: what the run's components
    (:mod:`trainer.components`) plan, each by the planner its config section names (``plans``)."""
    from trainer import components

    out = []
    for key, target in components.factories(cfg, components.PLANNERS):
        scorer = components.resolve(key, target)(cfg)
        if scorer is not None:
            out.append(scorer)
    return out


def replica_devices(
    cfg, scorer: Scorer, capacity: float, policy: list[Device]
) -> tuple[list[Device], Device]:
    """A model-scored reward's replica where the config puts it (a GPU of the group that offers its section's
    ``resource``, and a vLLM engine's share of it; none for CPU replicas, which :func:`plan` notes), and, as
    the alternative, the training GPU with a replica resident beside the policy at the policy's peak
    (``policy``: its GPU phases)."""
    actors = getattr(cfg, scorer.section)
    gpu_terms = scorer.terms(capacity)
    devices = []
    if actors.num_gpus > 0:
        # One device per replica (the worker loads onto cuda:0 of its GPUs); a fraction of a GPU: that share.
        own = Device(
            f"{scorer.what} GPU ({actors.resource or 'any GPU node'})",
            capacity * min(1.0, actors.num_gpus),
            {**gpu_terms, "runtime reserve": RUNTIME_RESERVE},
            advice=dict(scorer.advice),
        )
        where = f"the worker group that offers {actors.resource}" if actors.resource else "any GPU Ray offers"
        own.notes.append(
            f"{scorer.section}.replicas={actors.replicas} x num_gpus={actors.num_gpus:g} on {where}; {scorer.batch}"
        )
        devices.append(own)
        share = scorer.share(capacity)
        if share is not None:
            share.advice = {**scorer.advice, **share.advice}
            devices.append(share)
    peak = max(policy, key=lambda d: d.total)
    beside = Device(
        f"training GPU with the {scorer.what} beside the policy (an alternative)",
        capacity,
        {POLICY_PEAK: peak.total, **gpu_terms, "runtime reserve": RUNTIME_RESERVE},
        advice={
            **scorer.advice,
            POLICY_PEAK: f"the {scorer.what} on a worker group of its own ({scorer.section}.resource), or CPU replicas",
        },
    )
    beside.notes.append(
        f"the policy at its peak: {peak.role}; one replica resident on each training GPU, a process of its "
        "own (its own CUDA context); the run does not place it there"
    )
    return devices, beside


# ----- the plan -------------------------------------------------------------------------------------


@dataclass
class Plan:
    experiment: str
    target: str  # "8 x H200 (a3-ultragpu-8g) per node" or "CPU"
    shape: Shape
    devices: list[Device]
    # Placements the run does not use but could (a model-scored reward beside the policy): said, not counted.
    alternatives: list[Device] = field(default_factory=list)
    scorers: list[Scorer] = field(default_factory=list)  # the model-scored rewards, a line each
    notes: list[str] = field(default_factory=list)
    model_lines: list[str] = field(default_factory=list)  # below the model's line: a mixture of experts'

    @property
    def fits(self) -> bool:
        return all(d.fits for d in self.devices)

    @property
    def tightest(self) -> Device:
        return max(self.devices, key=lambda d: d.total / d.capacity)

    def transients(self) -> dict[str, float]:
        """What a training GPU holds for a moment only, by name, in bytes: the largest full tensor while
        loading, and the units FSDP gathers (training and refits)."""
        out: dict[str, float] = {}
        for d in self.devices:
            for name, value in d.terms.items():
                if name.startswith(LOADING_TERM) or name == "gathered units":
                    out[name] = max(out.get(name, 0.0), value)
        return out


SLEEPING_TERM = "sleeping engines' weights"
POLICY_PEAK = "policy at its peak"
# The key a user changes when a term is too large.
ADVICE = {
    "weights (sharded)": "more training GPUs (cluster.num_nodes and workerGroups.train.replicas)",
    "gradients (sharded)": "more training GPUs (cluster.num_nodes and workerGroups.train.replicas)",
    "optimizer (AdamW, sharded)": "more training GPUs (cluster.num_nodes and workerGroups.train.replicas)",
    "reference policy (sharded)": "grpo.loss.reference_policy_kl_penalty=0, or more training GPUs",
    "gathered units": "policy.reshard_after_forward=true, or policy.param_dtype=bfloat16",
    "activations": "policy.activation_checkpointing=true, or a smaller policy.max_tokens_per_microbatch "
    "(a larger policy.sequence_parallel_size spreads a long sequence over more ranks)",
    "logits": "a smaller policy.max_tokens_per_microbatch (or policy.micro_batch_size without a budget)",
    "runtime reserve": "nothing: a fixed reserve",
    "engine weights": "a larger generation.tensor_parallel_size",
    "KV cache (one sequence)": "a smaller policy.max_total_sequence_length, or a larger generation.tensor_parallel_size",
    "colocated engine (awake)": "a smaller generation.gpu_memory_utilization, or generation.placement=disaggregated",
    "one full tensor, loading": "more training GPUs (the shards beside it shrink)",
    SLEEPING_TERM: "a larger workerGroups.train.resources.requests.memory in the values file",
    ROUTES_TERM: "a smaller policy.max_tokens_per_microbatch",
    CAPTURE_TERM: "a smaller generation.vllm_kwargs.max_num_batched_tokens",
}
LOADING_TERM = "one full tensor, loading"
CHART_VALUES = Path(__file__).resolve().parents[2] / "charts" / "kuberl" / "values.yaml"
_QUANTITY = {
    "": 1,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}


def host_device(cfg, shape: Shape, host_bytes: float) -> Device | None:
    """A training node's host memory as its colocated vLLM engines use it while they sleep: at level 1
    (LoRA: the base must survive the refit) each copies its weights there, at level 2 (full-weight refits)
    none does (vLLM discards them). Only that term: the rest of the pod's memory (Ray, the processes'
    own) is not counted. None without colocated vLLM engines."""
    from trainer.generation.vllm_engine import sleep_level

    if cfg.generation.backend != "vllm" or cfg.disaggregated:
        return None
    level = sleep_level(cfg.policy.lora.enabled)
    engines = cfg.cluster.gpus_per_node
    per_engine = shape.params * BYTES[cfg.engine_dtype]
    dev = Device(
        "training node, host memory", host_bytes, {SLEEPING_TERM: per_engine * engines if level == 1 else 0.0}
    )
    dev.notes.append(
        f"{engines} colocated engines sleep at level {level}: "
        + (
            f"each copies its {per_engine / GiB:.1f} GiB of weights to host memory (LoRA: the base must survive)"
            if level == 1
            else "their weights are discarded, the refit overwrites them (nothing kept on the host)"
        )
    )
    return dev


def host_memory_request(values: Path | None) -> float:
    """Bytes of host memory a training pod requests: ``workerGroups.train.resources.requests.memory`` of
    the values file, else the chart's default; infinite when neither says."""
    import re

    import yaml

    for path in (values, CHART_VALUES):
        if path is None or not path.is_file():
            continue
        doc = yaml.safe_load(path.read_text()) or {}
        memory = (
            (((doc.get("workerGroups") or {}).get("train") or {}).get("resources") or {})
            .get("requests", {})
            .get("memory")
        )
        if memory is not None:
            m = re.fullmatch(r"([0-9.]+)([kMGT]i?)?", str(memory).strip())
            if not m:
                raise PlanError(
                    f"workerGroups.train.resources.requests.memory={memory!r} in {path}: not a quantity"
                )
            return float(m.group(1)) * _QUANTITY[m.group(2) or ""]
    return float("inf")


def loading_device(cfg, shape: Shape, terms: dict[str, float], capacity: float) -> Device:
    """A training GPU while its rank loads (trainer.policy.sharded_init): its shards, and rank 0's tensors
    broadcast one at a time, so one full tensor in ``model.dtype`` (and its slice) at a moment; a colocated
    vLLM engine is built first and holds its share."""
    name, elements = shape.largest
    loading = {
        "weights (sharded)": terms["weights (sharded)"],
        **({"reference policy (sharded)": terms["reference policy (sharded)"]} if "reference policy (sharded)" in terms else {}),
        LOADING_TERM: elements * BYTES[cfg.model.dtype],
        "runtime reserve": RUNTIME_RESERVE,
    }  # fmt: skip
    if cfg.generation.backend == "vllm" and not cfg.disaggregated:
        loading["colocated engine (awake)"] = engine_utilization(cfg) * capacity
    dev = Device("training GPU, loading", capacity, loading)
    dev.notes.append(f"rank 0 broadcasts the weights one tensor at a time; the largest: {name}")
    return dev


def plan(cfg, gpu: str | None, experiment: str, host_bytes: float = float("inf")) -> Plan:
    """The plan of a validated :class:`trainer.config.Config` on ``gpu`` (a GPU_MEMORY key, or None: CPU);
    ``host_bytes``: a training pod's host memory (:func:`host_memory_request`)."""
    shape = model_shape(cfg.model.name, cfg.model.trust_remote_code)
    world = cfg.train_world_size
    terms = training_terms(cfg, shape, world)
    if not cfg.cluster.use_gpus:
        return _cpu_plan(cfg, shape, terms, experiment)
    if gpu not in GPU_MEMORY:
        raise PlanError(
            f"GPU type {gpu!r} has no memory figure; one of: {', '.join(GPU_MEMORY)} (gpu.type in the values file)"
        )
    capacity = GPU_MEMORY[gpu]
    terms["runtime reserve"] = RUNTIME_RESERVE
    train = Device("training GPU", capacity, terms, either=TRAINING_EITHER)
    devices = [train, loading_device(cfg, shape, terms, capacity)]
    vllm = cfg.generation.backend == "vllm"
    if vllm and not cfg.disaggregated:
        # Generating: the engine's share is taken beside what the policy keeps on the GPU meanwhile.
        awake = Device("training GPU, engine awake", capacity, {
            "weights (sharded)": terms["weights (sharded)"],
            "optimizer (AdamW, sharded)": terms["optimizer (AdamW, sharded)"],
            **({"reference policy (sharded)": terms["reference policy (sharded)"]} if "reference policy (sharded)" in terms else {}),
            "colocated engine (awake)": engine_utilization(cfg) * capacity,
            "runtime reserve": RUNTIME_RESERVE,
        })  # fmt: skip
        devices.append(awake)
        devices.append(engine_device(cfg, shape, capacity, "engine's share"))
        devices.append(host_device(cfg, shape, host_bytes))
    elif vllm:
        devices.append(engine_device(cfg, shape, capacity, "generation GPU (engine's share)"))
    per_node = cfg.cluster.gpus_per_node
    result = Plan(experiment, f"{per_node} x {GPU_NAMES[gpu]} per node", shape, devices)
    result.model_lines = moe_lines(cfg, shape)
    policy = [d for d in devices if d.role.startswith("training GPU")]
    for scorer in scorers(cfg):
        _shaped(result, scorer)
        own, beside = replica_devices(cfg, scorer, capacity, policy)
        result.devices += own
        result.alternatives.append(beside)
        if not own:
            actors = getattr(cfg, scorer.section)
            each = sum(scorer.terms(None).values())
            result.notes.append(
                f"{scorer.what}: {actors.replicas} CPU replica(s) ({scorer.section}.num_gpus=0), {each / GiB:.2f} GiB "
                "of host memory each on the nodes Ray picks"
            )
    return result


def _cpu_plan(cfg, shape: Shape, terms: dict[str, float], experiment: str) -> Plan:
    """CPU ranks share one machine's memory: every rank's terms and its process's runtime (``CPU_RANK_RUNTIME``),
    each engine's weights (a vLLM engine's packed kernels, KV cache and runtime too: :func:`cpu_engine_terms`),
    and the driver with Ray's own processes, against the share of the machine's memory Ray's memory monitor
    lets workers use."""
    ranks = cfg.cluster.cpu_workers_per_node
    either = tuple(
        tuple(tuple(f"{k} x {ranks} ranks" for k in side) for side in pair) for pair in TRAINING_EITHER
    )
    threshold = float(os.environ.get("RAY_memory_usage_threshold", RAY_MEMORY_THRESHOLD))
    node = Device(
        "CPU node",
        _host_memory() * threshold,
        {f"{k} x {ranks} ranks": v * ranks for k, v in terms.items()},
        either=either,
    )
    node.notes.append(
        f"Ray's memory monitor stops workers past {threshold:.0%} of the machine's memory: the plan counts against that"
    )
    node.terms[f"runtime x {ranks} ranks"] = CPU_RANK_RUNTIME * ranks
    node.terms["driver and Ray"] = CPU_DRIVER
    engines = ranks if not cfg.disaggregated else cfg.num_generation_workers
    node.terms[f"engine weights x {engines}"] = shape.params * BYTES[cfg.engine_dtype] * engines
    if cfg.generation.backend == "vllm":
        node.terms.update({f"{k} x {engines}": v * engines for k, v in cpu_engine_terms(cfg, shape).items()})
        node.terms[f"engine runtime x {engines}"] = CPU_ENGINE_RUNTIME * engines
    if cfg.disaggregated:  # a generation actor is a process of its own
        node.terms[f"runtime x {engines} generation actors"] = CPU_RANK_RUNTIME * engines
    result = Plan(experiment, "CPU", shape, [node], model_lines=moe_lines(cfg, shape))
    for scorer in scorers(cfg):  # CPU replicas on the same machine, all scoring at once at worst
        _shaped(result, scorer)
        replicas = getattr(cfg, scorer.section).replicas
        node.advice.update(scorer.advice)
        for k, v in scorer.terms(None).items():
            node.terms[f"{k} x {replicas} replicas"] = v * replicas
    return result


def cpu_engine_terms(cfg, shape: Shape) -> dict[str, float]:
    """What a vLLM engine on CPU holds beside its weights: its packed kernels (vLLM's CPU linears and the LM
    head run from a packed copy of each weight, and kuberl keeps the plain one for refits: together 2.2x the
    weights of Gemma 3 270M, measured) and its KV cache as the engine sizes it
    (:func:`trainer.generation.vllm_cpu.kv_cache_kwargs`: the step's samples in whole blocks, at most
    ``CPU_KV_CACHE_GIB``; ``generation.vllm_kwargs.kv_cache_memory_bytes`` or ``VLLM_CPU_KVCACHE_SPACE``
    when set)."""
    from trainer.generation.vllm_cpu import step_kv_bytes
    from trainer.generation.vllm_engine import llm_kwargs

    dtype_bytes = BYTES[cfg.engine_dtype]
    gen, length = cfg.generation, cfg.policy.max_total_sequence_length
    per_token = int(kv_bytes_per_token(shape, dtype_bytes, 1))
    step = step_kv_bytes(per_token, cfg.grpo.batch_size, length, gen.vllm_kwargs.get("block_size"))
    # the engine's own arguments, the user's vllm_kwargs last
    kwargs = llm_kwargs(cfg.model.name, gen, cfg.engine_dtype, 0, length, True, False, kv_bytes=step)
    kv = kwargs.get("kv_cache_memory_bytes")
    if kv is None:  # VLLM_CPU_KVCACHE_SPACE, whole GiB
        kv = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")) * GiB
    return {"engine packed kernels": shape.params * dtype_bytes, "engine KV cache": float(kv)}


def _shaped(result: Plan, scorer: Scorer) -> None:
    result.scorers.append(scorer)


def _host_memory() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return float("inf")


def render(p: Plan) -> str:
    s = p.shape
    lines = [
        f"{p.experiment} on {p.target}: {s.params / 1e9:.2f}B parameters ({s.layers} layers, hidden {s.hidden}, "
        f"vocab {s.vocab}; config from {s.source})"
    ]
    lines += p.model_lines
    for scorer in p.scorers:
        r = scorer.shape
        lines.append(
            f"  {scorer.what}: {r.params / 1e9:.2f}B parameters ({r.layers} layers, hidden {r.hidden}, "
            f"{scorer.kind}; config from {r.source})"
        )
    for d in p.devices + p.alternatives:
        lines.append(f"  {d.role}:")
        for name, value in sorted(d.terms.items(), key=lambda kv: -kv[1]):
            lines.append(f"    {name:<34} {value / GiB:9.2f} GiB")
        for a, b in d.either:
            lines.append(f"    ({' + '.join(a)} and {' + '.join(b)} do not peak together: the larger counts)")
        verdict = "fits" if d.fits else "does not fit"
        lines.append(f"    {'total':<34} {d.total / GiB:9.2f} GiB of {d.capacity / GiB:.1f} GiB: {verdict}")
        lines += [f"    ({n})" for n in d.notes]
        if not d.fits:
            term = d.dominant.split(" x ")[0]
            key = d.advice.get(term) or ADVICE.get(term, "a larger machine")
            lines.append(f"    largest term: {d.dominant}; change: {key}")
    transients = sorted(p.transients().items(), key=lambda kv: -kv[1])
    if transients:
        lines.append(
            "transients (a training GPU, for a moment): "
            + ", ".join(
                f"{name} {value / GiB:.2f} GiB{' (the largest)' if i == 0 else ''}"
                for i, (name, value) in enumerate(transients)
            )
        )
    lines += p.notes
    for alt in p.alternatives:
        lines.append(
            f"alternative: {alt.role.split(' (')[0]}: {'fits' if alt.fits else 'does not fit'} "
            f"({_usage(alt)}; not part of the verdict)"
        )
    worst = p.tightest
    word = "fits" if p.fits else "does not fit"
    lines.append(f"plan: {word} ({worst.role} at {_usage(worst)}, largest term {worst.dominant})")
    return "\n".join(lines)


def _usage(d: Device) -> str:
    margin = d.capacity - d.total
    return f"{100 * d.total / d.capacity:.0f}%, {'margin' if margin >= 0 else 'short by'} {abs(margin) / GiB:.1f} GiB"


# ----- command line ---------------------------------------------------------------------------------


def _gpu_of(values: Path | None) -> str | None:
    if values is None:
        return None
    import yaml

    doc = yaml.safe_load(values.read_text()) or {}
    return ((doc.get("gpu") or {}).get("type")) or "b200"  # the chart's default


def plan_for(exp: str, overrides: list[str], gpu: str | None = None) -> Plan:
    """``exp`` as `make` takes it (a values file's stem or an experiment), with Hydra overrides."""
    from trainer import config
    from trainer.tools import submit

    release = submit.resolve(exp)
    cfg = config.load([f"experiment={release.experiment}", *overrides])
    gpu = gpu or _gpu_of(release.values)
    if cfg.cluster.use_gpus and gpu in (None, "none"):
        raise PlanError(
            f"experiment {release.experiment} runs on GPUs but has no values file with gpu.type: give GPU=h200 or GPU=b200"
        )
    name = release.values.stem if release.values else release.experiment
    return plan(cfg, gpu, name, host_memory_request(release.values))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.tools.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("exp", nargs="?", help="a values file's stem or an experiment (none: every values file)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, key=value")
    p.add_argument(
        "--gpu", choices=sorted(GPU_MEMORY), help="the GPU type, for an experiment without a values file"
    )
    args = p.parse_args(argv)
    from trainer.config import ConfigError
    from trainer.tools import submit

    exps = [args.exp] if args.exp else [v.stem for v in sorted(submit.VALUES.glob("*.yaml"))]
    bad = 0
    for i, exp in enumerate(exps):
        try:
            result = plan_for(exp, args.overrides, args.gpu)
        except (PlanError, ShapeError, ConfigError, submit.SubmitError) as e:
            print(f"kuberl: plan: {e}", file=sys.stderr)
            return 2
        print(("\n" if i else "") + render(result), flush=True)
        bad += not result.fits
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
