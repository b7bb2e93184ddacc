"""Attention over packed rows: each sample attends to itself alone, at the cost of its own pairs.

A packed micro-batch (:class:`~trainer.policy.batch.PackedBatch`) is one row of B samples back to back.
Flash attention's varlen kernel computes just each sample's causal pairs. transformers' ``sdpa`` path
instead builds a dense (N, N) block-diagonal mask from the position ids and computes every pair of the
row, masked or not: for a row of B samples that is up to B times the work the samples need, so on CPUs
(where there is no flash attention) packing saved the padding in the linear layers but paid it back in
attention (bench/README.md, ``make bench-train``). Here the policy's attention is a function of its own,
registered with transformers (``AttentionInterface``): for a packed row it runs torch's own varlen
kernel (``torch.nn.attention.varlen.varlen_attn``: one fused call over the whole row, its boundaries as
cu_seqlens) where that kernel takes the call (CUDA, fp16/bf16, no dropout; :func:`_varlen`); on a CPU in
bf16/fp16, the samples padded into a few batches of like length, each one batched eager attention
(:func:`_batched`: torch's fused CPU kernel is slow on short half-precision samples); else sdpa once per
sample with ``is_causal`` (the fused causal kernel, no mask); for anything else (padded
batches, the reference's, a copy of the model generating with a KV cache) it is transformers' own sdpa,
unchanged.

The row travels with the call: a packed forward passes its :class:`Row` to the model as the ``packed_row``
keyword, which transformers hands on, through every decoder layer, to each attention call (its
``**kwargs``, the same way flash attention's ``cu_seq_lens_q`` travel), and a checkpointed layer's
recompute gets it again from the keywords it kept. No call, no row: padded batches and the shared-prompt
layout run the model's own attention. What a rank's rows have in common (the implementation that runs on
them, its Ulysses group, the shapes torch's varlen kernel refused) is one :class:`PackedAttention`, owned
by the rank, that every row points to. With Ulysses sequence parallelism (:mod:`trainer.policy.ulysses`)
the same function all-to-alls around the per-sample attention; its inner attention may then be flash
attention's varlen call (GPUs).
"""

from __future__ import annotations

import inspect
import logging
import math
import sys
from functools import lru_cache
from typing import Any, cast

import torch

log = logging.getLogger(__name__)

# The names the policy's model config carries: the attention off a row is transformers' sdpa, or, for a
# model whose own attention is eager, that eager attention (:func:`install`).
ATTENTION = "kuberl_packed"
ATTENTION_EAGER = "kuberl_packed_eager"


class PackedAttention:
    """What every packed row of a rank shares: what runs on a row (``inner``: sdpa per sample, or a flash
    varlen implementation), the rank's Ulysses group (None without sequence parallelism), and the shapes
    torch's varlen kernel refused (:func:`_varlen`: each is tried and logged once per rank)."""

    def __init__(self, inner: str = "sdpa", sp: Any = None):
        self.inner = on_rows(inner)
        self.sp = sp  # trainer.policy.ulysses.SequenceParallelGroup (not imported: ulysses imports Row)
        self.refused: dict[tuple, str] = {}  # (dtype, head dim, heads, kv heads, window) -> why

    def row(self, cu_seqlens: torch.Tensor, max_seqlen: int, tokens: int | None = None) -> Row:
        return Row(cu_seqlens, max_seqlen, self, tokens)


class Row:
    """A packed row's sample boundaries: cu_seqlens (B + 1,) in tokens, and the longest sample; the
    ``packed_row`` keyword of a packed forward. A plain class, not a dataclass: FSDP2 rebuilds the
    dataclasses among a forward's keywords (to cast their tensors), which would drop the device copies."""

    def __init__(
        self,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        attention: PackedAttention | None = None,
        tokens: int | None = None,
    ):
        """``tokens``: the row's length (cu_seqlens[-1]) when the caller knows it as a number, so that no
        layer reads it back from a tensor (a scalar read per layer is a host sync on a GPU)."""
        self.cu_seqlens, self.max_seqlen = cu_seqlens, max_seqlen
        self.tokens = int(cu_seqlens[-1]) if tokens is None else tokens
        self.attention = attention if attention is not None else PackedAttention()
        self._on: dict[torch.device, torch.Tensor] = {}  # device -> int32 copy
        self._batches: dict[tuple, Batches] = {}  # (device, heads, window) -> the row as batches (CPU bf16)

    def window(self, sliding_window: int | None) -> int | None:
        """The sliding window where it cuts: None when no sample of the row is longer (plain causal)."""
        return sliding_window if sliding_window is not None and self.max_seqlen > sliding_window else None

    @property
    def bounds(self) -> list[tuple[int, int]]:
        cu = self.cu_seqlens.tolist()
        return list(zip(cu[:-1], cu[1:]))

    def cu_on(self, device: torch.device) -> torch.Tensor:
        """cu_seqlens as int32 on ``device``: copied once per row, then every layer (and a checkpointed
        backward's recompute) reuses it."""
        if device not in self._on:
            self._on[device] = self.cu_seqlens.to(device=device, dtype=torch.int32)
        return self._on[device]


# Never inside a compiled graph (policy.compile compiles the decoder blocks around it): a packed row's loop
# over its samples reads their boundaries as numbers, which a graph would be specialised on, one compile per
# set of lengths; torch's varlen kernel and the Ulysses all-to-alls are one call each, as fast eager.
@torch.compiler.disable
def attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    packed_row: Row | None = None,
    **kwargs,
):
    """transformers' attention-function signature: q (1, H, n, D), k/v (1, Hkv, n, D) -> ((1, n, H, D), None).
    ``packed_row``: the row the forward runs on (the module docstring), None off a row."""
    if packed_row is None:  # off a row: the model's eager attention or transformers' sdpa, with its mask
        if module.config._attn_implementation == ATTENTION_EAGER:
            if attention_mask is None and query.shape[2] > 1:  # eager without a mask attends to every pair
                raise RuntimeError("packed attention: eager off a packed row needs an attention mask")
            return _eager(module)(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                  sliding_window=sliding_window, softcap=softcap, **kwargs)  # fmt: skip
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)  # fmt: skip
    row, sp = packed_row, packed_row.attention.sp
    tokens = query.shape[2] * (sp.size if sp is not None else 1)
    if query.shape[0] != 1 or tokens != row.tokens:
        raise RuntimeError(
            f"packed attention: a ({query.shape[0]}, {tokens})-token input is not the row passed to "
            f"this forward ({row.tokens} tokens)"
        )
    dropout = dropout if module.training else 0.0
    inner = row.attention.inner
    if sp is None:
        return _attend(module, query, key, value, row, inner, dropout, scaling, sliding_window, softcap), None
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads % sp.size:  # fewer key/value heads than ranks: give every query head its own copy
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    q, k, v = (sp.to_heads(t) for t in (query, key, value))
    out = _attend(module, q, k, v, row, inner, dropout, scaling, sliding_window, softcap)
    return sp.to_sequence(out), None


def _attend(module, q, k, v, row: Row, inner: str, dropout, scaling, sliding_window, softcap) -> torch.Tensor:
    """Causal attention within each sample of the row: (1, h, N, D) -> (1, N, h, D). The one place where
    devices differ: flash attention's varlen kernel when ``inner`` is a flash one (flash_attn, GPUs);
    else torch's own varlen kernel where it takes the call (:func:`_varlen`: CUDA, fp16/bf16), else on a CPU
    in fp16/bf16 batches of like-length samples (:func:`_batched`), else sdpa once per sample
    (:func:`_per_sample`: CPU float32, a GPU without flash attention, ...)."""
    if inner.startswith("flash"):
        # transformers' own flash wrapper would name the kernel after module.config's implementation,
        # which is this module's: call the function under it with the inner one.
        from transformers.integrations.flash_attention import get_target_dtype
        from transformers.modeling_flash_attention_utils import _flash_attention_forward

        # int32, as flash's kernels take them; transformers annotates them torch.LongTensor, a legacy type
        # that no .to() returns: the cast is for its annotation, not a conversion.
        cu = cast(torch.LongTensor, row.cu_seqlens.to(device=q.device, dtype=torch.int32))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (1, N, h, D): flash's layout
        return _flash_attention_forward(
            q,
            k,
            v,
            None,
            query_length=q.shape[1],
            is_causal=True,
            dropout=dropout,
            softmax_scale=scaling,
            sliding_window=sliding_window,
            softcap=softcap,
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=row.max_seqlen,
            max_length_k=row.max_seqlen,
            target_dtype=get_target_dtype(q, module),
            attn_implementation=inner,
        )
    if softcap is not None:
        raise ValueError(
            "attention logit softcapping needs model.attn_implementation=flash_attention_2 with "
            "packed rows (policy.sequence_packing)"
        )
    out = _varlen(q, k, v, row, dropout, scaling, sliding_window)
    if out is not None:
        return out
    if q.device.type == "cpu" and q.dtype in HALF:
        return _batched(q, k, v, row, dropout, scaling, sliding_window)
    return _per_sample(q, k, v, row, dropout, scaling, sliding_window)


def _per_sample(q, k, v, row: Row, dropout, scaling, sliding_window) -> torch.Tensor:
    """sdpa once per sample of the row, causal (or causal within the last ``sliding_window`` tokens):
    (1, h, N, D) -> (1, N, h, D). Any device, any dtype."""
    gqa = k.shape[1] != q.shape[1]
    parts = []
    for a, b in row.bounds:
        mask = None
        if sliding_window is not None and b - a > sliding_window:
            i = torch.arange(b - a, device=q.device)
            mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < sliding_window)
        parts.append(torch.nn.functional.scaled_dot_product_attention(
            q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], attn_mask=mask, dropout_p=dropout, scale=scaling,
            is_causal=mask is None, enable_gqa=gqa,
        ))  # fmt: skip
    return torch.cat(parts, dim=2).transpose(1, 2)


HALF = (torch.bfloat16, torch.float16)
# How much padding a batch of samples may add to the work its samples need (each sample's L^2 pairs), and
# the most bytes one batch's float32 scores may take: a length-skewed row splits into several batches.
# Below PAD_PAIRS padded pairs a batch is not worth a call of its own (at 490 GFLOP/s, one bf16 core, 64^2
# pairs of 9 heads of 64 cost about 30 us forward and backward).
PAD_WASTE = 1.5
PAD_PAIRS = 64 * 64
SCORE_BYTES = 64 << 20
# Samples longer than this run sdpa per sample: there the fused kernel wins (2-core AMD EPYC, bf16, 9 heads
# of 64, forward and backward: batches 2.2x faster at 128 tokens, 1.4x at 256, 0.47x at 512), and it keeps
# no (L, L) scores for the backward.
BATCH_MAX_LEN = 256


class Batches:
    """A packed row's samples laid out as batches of like length for :func:`_batched`, per row and window
    (every layer and a checkpointed recompute reuse it): each batch's gather index into the row plus one
    zero token (a pad slot points at it), its additive float32 mask; the samples longer than
    ``BATCH_MAX_LEN`` (``alone``: their bounds), which run sdpa one at a time; and where each of the row's
    tokens lands in the outputs laid end to end, the batches' first."""

    def __init__(self, row: Row, heads: int, window: int | None, device: torch.device):
        lengths = [b - a for a, b in row.bounds]
        # short to long: a batch's last sample is its longest
        order = sorted(range(len(lengths)), key=lengths.__getitem__)
        groups: list[list[int]] = []
        pairs = 0  # the last group's own pairs, sum of L^2
        self.alone = [row.bounds[i] for i in order if lengths[i] > BATCH_MAX_LEN]
        for i in (i for i in order if lengths[i] <= BATCH_MAX_LEN):
            n = lengths[i]
            padded = (len(groups[-1]) + 1) * n * n if groups else 0
            if (
                groups
                and padded <= PAD_WASTE * (pairs + n * n) + PAD_PAIRS
                and padded * heads * 4 <= SCORE_BYTES
            ):
                groups[-1].append(i)
                pairs += n * n
            else:
                groups.append([i])
                pairs = n * n
        starts = row.cu_seqlens.tolist()
        self.index, self.mask = [], []
        where = torch.empty(row.tokens, dtype=torch.long)
        offset = 0
        for g in groups:
            width = lengths[g[-1]]
            index = torch.full((len(g), width), row.tokens, dtype=torch.long)  # the zero token
            for slot, i in enumerate(g):
                a, n = starts[i], lengths[i]
                index[slot, :n] = torch.arange(a, a + n)
                where[a : a + n] = offset + slot * width + torch.arange(n)
            offset += len(g) * width
            t = torch.arange(width)
            query, key = t[:, None], t[None, :]
            allowed = (key <= query) & (key < torch.tensor([lengths[i] for i in g])[:, None, None])
            if window is not None:
                allowed &= (query - key) < window
            # finite, not -inf: a pad query that sees no key gets a uniform softmax, never a NaN that
            # softmax's backward would spread into the real keys' gradients
            mask = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)
            self.index.append(index.to(device))
            self.mask.append(mask[:, None, None].to(device))  # (n, 1, 1, L, L): over kv heads and groups
        for a, b in self.alone:
            where[a:b] = offset + torch.arange(b - a)
            offset += b - a
        self.where = where.to(device)


def _batched(q, k, v, row: Row, dropout, scaling, sliding_window) -> torch.Tensor:
    """The row's samples padded into batches of like length (:class:`Batches`), each attended in one
    batched eager attention with a causal (windowed) mask: (1, h, N, D) -> (1, N, h, D). For bf16/fp16 on
    a CPU, where torch's fused sdpa kernel runs each short sample at a small fraction of the matmul peak:
    on a 2-core AMD EPYC one packed row of 33 samples of 40-90 tokens (SmolLM2's 9 heads, 3 kv heads)
    took 18.6 ms forward and backward per layer this way and 61.9 ms as sdpa per sample (bench/README.md).
    Scores and softmax in float32, the probabilities rounded to the input dtype for the values' matmul,
    as transformers' eager attention computes them; samples longer than ``BATCH_MAX_LEN`` run sdpa alone."""
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[-1]
    group = heads // kv_heads
    window = row.window(sliding_window)
    key = (q.device, heads, window)
    batches = row._batches.get(key)
    if batches is None:
        batches = row._batches[key] = Batches(row, heads, window, q.device)
    scale = head_dim**-0.5 if scaling is None else scaling
    # (h, N + 1, D): the row's tokens and a zero token that the pad slots gather
    qz, kz, vz = (torch.cat([t[0], t.new_zeros(t.shape[1], 1, head_dim)], dim=1) for t in (q, k, v))
    outs = []
    for index, mask in zip(batches.index, batches.mask):
        n, width = index.shape
        # query heads grouped under their kv head (head h reads kv head h // group, as repeat_kv lays
        # them out): (n, kv, group * L, D) against keys (n, kv, L, D), no copy of the keys per group
        qb = qz[:, index].transpose(0, 1).reshape(n, kv_heads, group * width, head_dim)
        kb, vb = (t[:, index].transpose(0, 1) for t in (kz, vz))
        scores = torch.matmul(qb, kb.transpose(-1, -2)).view(n, kv_heads, group, width, width)
        probs = torch.softmax(scores.float() * scale + mask, dim=-1).to(q.dtype)
        if dropout:
            probs = torch.nn.functional.dropout(probs, p=dropout, training=True)
        out = torch.matmul(probs.view(n, kv_heads, group * width, width), vb)  # (n, kv, group * L, D)
        outs.append(out.view(n, heads, width, head_dim).transpose(1, 2).reshape(n * width, heads, head_dim))
    for a, b in batches.alone:  # a row of its own: sdpa on its tokens, nothing read back from a tensor
        alone = Row(row.cu_seqlens.new_tensor([a, b]), b - a, row.attention, tokens=b - a)
        outs.append(_per_sample(q, k, v, alone, dropout, scaling, sliding_window)[0])
    return torch.cat(outs)[batches.where].unsqueeze(0)


# torch's varlen attention (torch.nn.attention.varlen.varlen_attn), whose signature changed between the
# torch versions this runs on; the keywords are chosen from the signature (:func:`_varlen_kwargs`):
#   2.10 (its docs):  (q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None)
#   2.11 (docs/gpu-tests.md's GPU runs):  (q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
#                             scale=None, window_size=(-1, -1))
#   2.13 (the job image's lock and the CPU venv):  (..., max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
#                             enable_gqa=False, seqused_k=None, block_table=None, num_splits=None)
# Every version: q (T, Hq, D), k/v (T, Hkv, D), out (T, Hq, D); flash attention's kernel (aten
# _flash_attention_forward/_backward: fp16/bf16, head dim a multiple of 8 up to 256, sm80+), dropout
# fixed at 0, with a backward. window_size (left, right) is flash's: key j is seen by query i when
# i - left <= j <= i + right, -1 unbounded, so (-1, 0) is causal (varlen_attn compares the tuple
# itself: `window_size == (-1, 0)`) and the last W tokens are (W - 1, 0), transformers' sliding window.
# Versions without ``enable_gqa`` check no head counts and hand k/v of fewer heads to the kernel, which
# shares each key/value head among its group of query heads (as sdpa's flash path does with enable_gqa);
# 2.13 refuses fewer heads unless told ``enable_gqa=True``.


@lru_cache(maxsize=1)
def _varlen_attn():
    """torch's varlen_attn, or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@lru_cache(maxsize=8)
def _parameters(fn) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


@lru_cache(maxsize=16)
def _flash_device(device: torch.device) -> bool:
    """Whether ``device`` is a GPU that runs this torch's flash attention: CUDA, a build with flash
    attention, sm80 or newer (ROCm builds decide for themselves)."""
    available = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    if device.type != "cuda" or not available():
        return False
    return torch.version.hip is not None or torch.cuda.get_device_capability(device) >= (8, 0)


def fused_rows(device: torch.device, dtype: torch.dtype, inner: str) -> bool:
    """Whether a packed row's attention is one fused varlen call on ``device`` computing in ``dtype``
    (flash attention's when ``inner`` is a flash implementation; torch's own on a CUDA GPU in fp16/bf16,
    :func:`_varlen`), rather than sdpa once per sample."""
    if "flash" in inner:
        return True
    return (
        inner == "sdpa"
        and dtype in (torch.float16, torch.bfloat16)
        and _varlen_attn() is not None
        and _flash_device(device)
    )


def _varlen_kwargs(
    params: frozenset[str],
    heads: int,
    kv_heads: int,
    head_dim: int,
    scaling: float | None,
    window: int | None,
) -> dict | None:
    """The keywords that make ``varlen_attn`` (whose parameter names are ``params``) compute the per-sample
    loop's attention: causal (within the last ``window`` tokens when it is not None), the softmax scale
    ``scaling``, ``kv_heads`` key/value heads for ``heads`` query heads; None where it can't say that."""
    kw: dict[str, Any] = {}
    if "window_size" in params:
        kw["window_size"] = (-1, 0) if window is None else (window - 1, 0)  # a tuple: see above
    elif "is_causal" in params and window is None:
        kw["is_causal"] = True
    else:
        return None
    if "scale" in params:
        kw["scale"] = scaling
    elif scaling is not None and not math.isclose(scaling, head_dim**-0.5, rel_tol=1e-6):
        return None
    if heads != kv_heads and "enable_gqa" in params:
        kw["enable_gqa"] = True
    return kw


def _varlen(q, k, v, row: Row, dropout, scaling, sliding_window) -> torch.Tensor | None:
    """The row's attention in one call of torch's varlen kernel, (1, h, N, D) -> (1, N, h, D); None where
    that kernel can't take it (then the caller runs :func:`_per_sample`): not CUDA, not fp16/bf16, dropout,
    a head size or head grouping flash attention lacks, a sliding window or scale this torch's varlen_attn
    can't express, no varlen_attn at all. A refusal by the kernel itself (the first forward of a shape)
    is remembered (the row's :class:`PackedAttention`) and logged once, and that shape runs per sample from
    then on."""
    fn = _varlen_attn()
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[-1]
    if (
        fn is None
        or q.dtype not in (torch.float16, torch.bfloat16)
        or dropout
        or k.dtype != q.dtype
        or v.dtype != q.dtype
        or v.shape[1] != kv_heads
        or v.shape[-1] != head_dim
        or head_dim % 8
        or head_dim > 256
        or heads % kv_heads
        or not _flash_device(q.device)
    ):
        return None
    window = row.window(sliding_window)
    if window is not None and window < 1:
        return None
    kw = _varlen_kwargs(_parameters(fn), heads, kv_heads, head_dim, scaling, window)
    key = (q.dtype, head_dim, heads, kv_heads, window is not None)
    refused = row.attention.refused
    if kw is None or key in refused:
        return None
    cu = row.cu_on(q.device)
    qt, kt, vt = (t[0].transpose(0, 1) for t in (q, k, v))  # (N, h, D), the kernel's layout
    qt, kt, vt = (t if t.stride(-1) == 1 else t.contiguous() for t in (qt, kt, vt))
    try:
        out = fn(qt, kt, vt, cu, cu, row.max_seqlen, row.max_seqlen, **kw)
    except torch.cuda.OutOfMemoryError:
        raise
    except (RuntimeError, ValueError) as e:  # the kernel refused this shape: per sample from now on
        refused[key] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        log.warning(
            "packed attention: torch varlen_attn refused %s (%s); running sdpa per sample instead",
            key,
            refused[key],
        )
        return None
    return out.unsqueeze(0)


def _eager(module):
    """The eager attention function of ``module``'s model (transformers defines one per modeling file)."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise RuntimeError(
            f"packed attention: {type(module).__module__} has no eager_attention_forward; "
            "set model.attn_implementation=sdpa"
        )
    return fn


def _mask(*args, **kwargs):
    """The mask transformers builds for this attention: none where the forward passed no padding mask
    (a packed row, whose boundaries are in the row; every other forward of the policy passes one), else
    the one the attention off a row takes (eager's additive mask, or sdpa's)."""
    if kwargs.get("attention_mask") is None:
        return None
    from transformers.masking_utils import eager_mask, sdpa_mask

    eager = kwargs["config"]._attn_implementation == ATTENTION_EAGER
    return (eager_mask if eager else sdpa_mask)(*args, **kwargs)


def takes(inner: str, config) -> bool:
    """Whether :func:`install` takes a model of ``config`` whose own attention is ``inner``: sdpa, and
    eager where the model has no attention logit softcapping (which sdpa per sample cannot compute)."""
    return inner == "sdpa" or (inner == "eager" and getattr(config, "attn_logit_softcapping", None) is None)


def on_rows(inner: str) -> str:
    """What :func:`install` runs on a packed row for a model whose own attention is ``inner``."""
    return "sdpa" if inner == "eager" else inner


def install(model, inner: str = "sdpa", sp=None) -> PackedAttention:
    """Route ``model``'s attention through :func:`attention` (every policy model of the rank: the policy, the
    reference); what its rows share, with ``inner`` on rows and ``sp`` the rank's Ulysses group, if any.

    A model whose own attention is eager keeps it off a row (padded batches and the shared-prompt
    layout: on CPU eager's backward beats sdpa's with a mask), while its rows run sdpa once per sample:
    eager over a packed row computes the dense (N, N) block-diagonal mask, every pair of the row, so its
    cost grew with the token budget, where sdpa per sample costs each sample's own pairs (bench/README.md,
    ``make bench-train``: "Eager models attended over the whole packed row")."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = ATTENTION_EAGER if inner == "eager" else ATTENTION
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, _mask)
    model.set_attn_implementation(name)
    return PackedAttention(inner, sp)
