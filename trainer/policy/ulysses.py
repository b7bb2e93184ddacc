"""Ulysses sequence parallelism: one packed micro-batch split along the sequence over a group of ranks.

``policy.sequence_parallel_size = S`` groups the policy ranks in runs of S consecutive ranks. Every rank
of a group gets the same samples; each packs them into the same row (:class:`~trainer.policy.batch.
PackedBatch`), pads it to a multiple of S and keeps only its own contiguous slice of N / S tokens. The
embeddings, norms, MLPs and the logits of a slice are computed where it lives; attention needs every
token, so around it (DeepSpeed-Ulysses, arXiv 2309.14509):

1. after the q/k/v projections and RoPE (on the slice's own, global, position ids), an all-to-all turns
   (H heads, N / S tokens) on each rank into (H / S heads, N tokens);
2. each rank runs attention over the whole row for its heads: a block-diagonal causal mask built from
   the row's position ids (sdpa on CPU), or flash attention's varlen kernel given the row's sample
   boundaries (GPUs);
3. the inverse all-to-all gives each rank (H heads, N / S tokens) again, for ``o_proj``.

The logprobs of a slice's response tokens are then gathered over the group (:func:`gather_slices`), so
every rank of the group holds the micro-batch's whole (B, C) window and computes the same loss as
without sequence parallelism; its backward keeps only the rank's own part. FSDP2 still shards over all
ranks and averages gradients over all of them: each group's gradient is the sum of its ranks' (each
computed a disjoint part of the forward), so ``loss * world_size`` is the right scale, as for plain data
parallelism. verl (``ulysses_sequence_parallel_size``) and NeMo-RL split the same way; verl pads the row
and all-to-alls inside flash attention's wrapper, where this registers an attention function of its own
with transformers (``AttentionInterface``) and leaves the model's modules as they are.

What differs by device is one call in :func:`_attend`: sdpa with a mask, or flash attention varlen.
Grouped-query attention splits the key/value heads too when S divides them, else repeats them to H.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

ATTENTION = "kuberl_ulysses"  # the name the policy's model config carries while sequence parallel
INNER = ("sdpa", "flash_attention_2", "flash_attention_3")  # what runs inside, on the whole row


@dataclass
class Row:
    """The packed row of the current micro-batch, as every rank of the group sees it."""

    position_ids: torch.Tensor  # (N,) the whole padded row's position ids
    cu_seqlens: torch.Tensor    # (B' + 1,) int32 sample boundaries in the padded row
    max_seqlen: int
    _masks: dict = field(default_factory=dict)

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """(1, 1, N, N) bool: causal within each sample (and within ``sliding_window``), nothing across."""
        if sliding_window not in self._masks:
            pos = self.position_ids
            segment = torch.cumsum(pos == 0, 0)  # a sample starts where its position id is 0
            i = torch.arange(pos.numel(), device=pos.device)
            allowed = (segment[:, None] == segment[None, :]) & (i[None, :] <= i[:, None])
            if sliding_window is not None:
                allowed &= (i[:, None] - i[None, :]) < sliding_window
            self._masks[sliding_window] = allowed[None, None]
        return self._masks[sliding_window]


class Group:
    """A rank's sequence-parallel group: its members, its place in it, and the current row."""

    def __init__(self, size: int, rank: int, world_size: int, inner: str):
        if world_size % size:
            raise ValueError(f"policy.sequence_parallel_size={size} must divide the {world_size} policy ranks")
        self.size, self.rank_in_group, self.inner = size, rank % size, inner
        self.group = None
        # new_group is a collective over the whole world: every rank creates every group, in order.
        for first in range(0, world_size, size):
            members = list(range(first, first + size))
            g = dist.new_group(members)
            if rank in members:
                self.group = g
        self.row: Row | None = None
        self.counts: list[int] = []
        self.first = 0

    @property
    def leader(self) -> bool:
        """Whether this rank speaks for its group (results and metrics are counted once per group)."""
        return self.rank_in_group == 0

    def split(self, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's slice of a :class:`PackedBatch` (:func:`slice_row`), and what attention and the
        gather read until the next split (a checkpointed backward recomputes with it): the row, every
        rank's count of predicted positions, and where this rank's first one lies among the row's M."""
        self.row, ids, pos, predict, self.counts = slice_row(batch, self.size, self.rank_in_group)
        self.first = sum(self.counts[: self.rank_in_group])
        return ids, pos, predict


def slice_row(batch, size: int, rank: int) -> tuple[Row, torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Rank ``rank`` of ``size``'s contiguous slice of a packed row padded to a multiple of ``size``: the
    whole row (:class:`Row`), the slice's input ids (1, n) and position ids (1, n), its positions that
    predict a response token (m,) counted from the slice's start, and every rank's m (size,)."""
    ids, pos, cu = batch.input_ids[0], batch.position_ids[0], batch.cu_seqlens
    total = ids.numel()
    pad = -total % size
    if pad:  # a sample of its own, attending only to itself and predicting nothing
        ids = torch.cat([ids, ids.new_zeros(pad)])
        pos = torch.cat([pos, torch.arange(pad, dtype=pos.dtype)])
        cu = torch.cat([cu, cu.new_tensor([total + pad])])
    n = (total + pad) // size
    row = Row(position_ids=pos, cu_seqlens=cu, max_seqlen=max(batch.max_seqlen, pad))
    lo, predict = rank * n, batch.predict
    counts = torch.bincount(predict // n, minlength=size).tolist()  # predict ascends: slices in order
    mine = predict[(predict >= lo) & (predict < lo + n)] - lo
    return row, ids[lo : lo + n][None], pos[lo : lo + n][None], mine, counts


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all over dim 0 of (S, ...): out[s] = rank s's in[my rank]. Its own adjoint."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.group), None


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous: empty_like keeps a view's strides
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, s: int, group) -> torch.Tensor:
    """(1, H, n, D) on each rank -> (1, H / S, S * n, D): this rank's heads over the whole row."""
    _, h, n, d = x.shape
    parts = _AllToAll.apply(x[0].reshape(s, h // s, n, d), group)  # [r] = rank r's slice, my heads
    return parts.permute(1, 0, 2, 3).reshape(1, h // s, s * n, d)


def _heads_to_seq(x: torch.Tensor, s: int, group) -> torch.Tensor:
    """(1, N, H / S, D) -> (1, N / S, H, D): every head again, over this rank's slice."""
    _, big_n, hs, d = x.shape
    parts = _AllToAll.apply(x[0].reshape(s, big_n // s, hs, d), group)  # [r] = my slice, rank r's heads
    return parts.permute(1, 0, 2, 3).reshape(1, big_n // s, s * hs, d)


_ACTIVE: Group | None = None  # the policy model's group; one policy model per process


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
              sliding_window: int | None = None, softcap: float | None = None, **kwargs):
    """transformers' attention-function signature: q (1, H, n, D), k/v (1, Hkv, n, D) -> ((1, n, H, D), None)."""
    sp = _ACTIVE
    if sp is None or sp.row is None:
        raise RuntimeError("a sequence-parallel model ran outside PolicyWorker's split (trainer.policy.ulysses)")
    s, group = sp.size, sp.group
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads % s:  # fewer key/value heads than ranks: give every query head its own copy
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    q, k, v = (_seq_to_heads(t, s, group) for t in (query, key, value))
    out = _attend(module, q, k, v, sp, dropout if module.training else 0.0, scaling, sliding_window, softcap)
    return _heads_to_seq(out, s, group), None


def _attend(module, q, k, v, sp: Group, dropout, scaling, sliding_window, softcap) -> torch.Tensor:
    """Attention over the whole row for this rank's heads: (1, h, N, D) -> (1, N, h, D)."""
    row = sp.row
    if sp.inner.startswith("flash"):  # GPUs: the varlen kernel, told the boundaries (no mask)
        # transformers' own flash wrapper would name the kernel after module.config's implementation,
        # which is this module's while sequence parallel: call the function under it with the inner one.
        from transformers.integrations.flash_attention import get_target_dtype
        from transformers.modeling_flash_attention_utils import _flash_attention_forward

        cu = row.cu_seqlens.to(device=q.device, dtype=torch.int32)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (1, N, h, D): flash's layout
        return _flash_attention_forward(
            q, k, v, None, query_length=q.shape[1], is_causal=True, dropout=dropout, softmax_scale=scaling,
            sliding_window=sliding_window, softcap=softcap, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
            max_length_q=row.max_seqlen, max_length_k=row.max_seqlen, target_dtype=get_target_dtype(q, module),
            attn_implementation=sp.inner,
        )
    if softcap is not None:
        raise ValueError("attention logit softcapping needs model.attn_implementation=flash_attention_2 "
                         "with policy.sequence_parallel_size > 1")
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=row.mask(sliding_window).to(q.device), dropout_p=dropout, scale=scaling,
        enable_gqa=k.shape[1] != q.shape[1],
    )
    return out.transpose(1, 2)


def install(model, group: Group) -> None:
    """Route the policy model's attention through :func:`attention` (transformers' AttentionInterface)."""
    global _ACTIVE
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, attention)
    model.set_attn_implementation(ATTENTION)
    _ACTIVE = group


class _GatherSlices(torch.autograd.Function):
    """(m_r,) on each rank -> (sum m,) in rank order; backward keeps this rank's part of the gradient
    (every rank of the group computes the same loss from the same gathered values)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, counts: list[int], rank: int, group) -> torch.Tensor:
        ctx.counts, ctx.rank = counts, rank
        width = max(max(counts), 1)
        padded = local.new_zeros(width)
        padded[: local.numel()] = local
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([p[:c] for p, c in zip(parts, counts)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start = sum(ctx.counts[: ctx.rank])
        return grad[start : start + ctx.counts[ctx.rank]], None, None, None


def gather_slices(local: torch.Tensor, counts: list[int], sp: Group) -> torch.Tensor:
    """Per-token values of every rank's slice, in row order (differentiable)."""
    return _GatherSlices.apply(local, counts, sp.rank_in_group, sp.group)


def check_model(config, size: int, attn_implementation: str | None) -> str | None:
    """Why a model cannot run at ``size`` (one line naming the key), or None."""
    text = getattr(config, "text_config", None) or config
    heads = getattr(text, "num_attention_heads", None)
    if heads is None or heads % size:
        return (f"policy.sequence_parallel_size={size} must divide the model's {heads} attention heads "
                "(each rank attends with heads / size of them)")
    if attn_implementation not in (None, *INNER):
        return (f"policy.sequence_parallel_size={size} runs attention with sdpa or flash attention, not "
                f"model.attn_implementation={attn_implementation}; set it to null, sdpa or flash_attention_2")
    return None
