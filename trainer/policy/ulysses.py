"""Ulysses sequence parallelism: one packed micro-batch split along the sequence over a group of ranks.

``policy.sequence_parallel_size = S`` groups the policy ranks in runs of S consecutive ranks. Every rank
of a group gets the same samples; each packs them into the same row (:class:`~trainer.policy.batch.
PackedBatch`), pads it to a multiple of S and keeps only its own contiguous slice of N / S tokens. The
embeddings, norms, MLPs and the logits of a slice are computed where it lives; attention needs every
token, so around it (DeepSpeed-Ulysses, arXiv 2309.14509):

1. after the q/k/v projections and RoPE (on the slice's own, global, position ids), an all-to-all turns
   (H heads, N / S tokens) on each rank into (H / S heads, N tokens);
2. each rank runs attention over the whole row for its heads, within each sample
   (:mod:`trainer.policy.packed_attention`: sdpa per sample, or flash attention's varlen kernel on GPUs);
3. the inverse all-to-all gives each rank (H heads, N / S tokens) again, for ``o_proj``.

The logprobs of a slice's response tokens are then gathered over the group (:func:`gather_slices`), so
every rank of the group holds the micro-batch's whole (B, C) window and computes the same loss as
without sequence parallelism; its backward keeps only the rank's own part. FSDP2 still shards over all
ranks and averages gradients over all of them: each group's gradient is the sum of its ranks' (each
computed a disjoint part of the forward), so the objective scales its loss by all the ranks
(:meth:`trainer.algorithms.objective.Objective.reduce`), as for plain data parallelism. verl
(``ulysses_sequence_parallel_size``) and NeMo-RL split the same way; verl pads the row and all-to-alls
inside flash attention's wrapper, where here the all-to-alls sit in the packed-row attention function the
policy registers with transformers anyway, and the model's modules stay as they are.
Grouped-query attention splits the key/value heads too when S divides them, else repeats them to H.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer.policy.packed_attention import Row

INNER = ("sdpa", "flash_attention_2", "flash_attention_3")  # what may run on the whole row


class SequenceParallelGroup:
    """A rank's sequence-parallel group: its members, its place in it, and the current row."""

    def __init__(self, size: int, rank: int, world_size: int):
        if world_size % size:
            raise ValueError(
                f"policy.sequence_parallel_size={size} must divide the {world_size} policy ranks"
            )
        self.size, self.rank_in_group = size, rank % size
        self.group = None
        # new_group is a collective over the whole world: every rank creates every group, in order.
        for first in range(0, world_size, size):
            members = list(range(first, first + size))
            g = dist.new_group(members)
            if rank in members:
                self.group = g
        self.counts: list[int] = []
        self.first = 0

    @property
    def leader(self) -> bool:
        """Whether this rank speaks for its group (results and metrics are counted once per group)."""
        return self.rank_in_group == 0

    def split(self, batch) -> tuple[Row, torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's slice of a :class:`PackedBatch` (:func:`slice_row`), and what the gather reads until
        the next split (a checkpointed backward recomputes with it): every rank's count of predicted
        positions, and where this rank's first one lies among the row's M."""
        row, ids, pos, predict, self.counts = slice_row(batch, self.size, self.rank_in_group)
        self.first = sum(self.counts[: self.rank_in_group])
        return row, ids, pos, predict

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(1, H, n, D) on each rank -> (1, H / S, S * n, D): this rank's heads over the whole row."""
        (_, h, n, d), s = x.shape, self.size
        parts = _AllToAll.apply(x[0].reshape(s, h // s, n, d), self.group)  # [r] = rank r's slice, my heads
        return parts.permute(1, 0, 2, 3).reshape(1, h // s, s * n, d)

    def to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """(1, N, H / S, D) -> (1, N / S, H, D): every head again, over this rank's slice."""
        (_, big_n, hs, d), s = x.shape, self.size
        parts = _AllToAll.apply(
            x[0].reshape(s, big_n // s, hs, d), self.group
        )  # [r] = my slice, rank r's heads
        return parts.permute(1, 0, 2, 3).reshape(1, big_n // s, s * hs, d)


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
    row = Row(cu_seqlens=cu, max_seqlen=max(batch.max_seqlen, pad), tokens=total + pad)
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
    out = torch.empty(
        x.shape, dtype=x.dtype, device=x.device
    )  # contiguous: empty_like keeps a view's strides
    dist.all_to_all_single(out, x, group=group)
    return out


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


def gather_slices(local: torch.Tensor, counts: list[int], sp: SequenceParallelGroup) -> torch.Tensor:
    """Per-token values of every rank's slice, in row order (differentiable)."""
    return _GatherSlices.apply(local, counts, sp.rank_in_group, sp.group)


def check_model(config, size: int, attn_implementation: str | None) -> str | None:
    """Why a model cannot run at ``size`` (one line naming the key), or None."""
    text = getattr(config, "text_config", None) or config
    heads = getattr(text, "num_attention_heads", None)
    if heads is None or heads % size:
        return (
            f"policy.sequence_parallel_size={size} must divide the model's {heads} attention heads "
            "(each rank attends with heads / size of them)"
        )
    if attn_implementation not in (None, *INNER):
        return (
            f"policy.sequence_parallel_size={size} runs attention with sdpa or flash attention, not "
            f"model.attn_implementation={attn_implementation}; set it to null, sdpa or flash_attention_2"
        )
    return None
