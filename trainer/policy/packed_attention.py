"""Attention over packed rows: each sample attends to itself alone, at the cost of its own pairs.

A packed micro-batch (:class:`~trainer.policy.batch.PackedBatch`) is one row of B samples back to back.
Flash attention's varlen kernel computes just each sample's causal pairs. transformers' ``sdpa`` path
instead builds a dense (N, N) block-diagonal mask from the position ids and computes every pair of the
row, masked or not: for a row of B samples that is up to B times the work the samples need, so on CPUs
(where there is no flash attention) packing saved the padding in the linear layers but paid it back in
attention (bench/README.md, ``make bench-train``). Here the policy's attention is a function of its own,
registered with transformers (``AttentionInterface``): for a packed row it runs sdpa once per sample
with ``is_causal`` (the fused causal kernel, no mask), and for anything else (padded batches, the
reference's, a copy of the model generating with a KV cache) it is transformers' own sdpa, unchanged.

The row in hand is process state (:func:`set_row`), set by the policy rank before each packed forward and
kept until the next one, so a checkpointed backward recomputes with the same row. With Ulysses sequence
parallelism (:mod:`trainer.policy.ulysses`) the same function all-to-alls around the per-sample
attention; its inner attention may then be flash attention's varlen call (GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ATTENTION = "kuberl_packed"  # the name the policy's model config carries


@dataclass
class Row:
    """A packed row's sample boundaries: cu_seqlens (B + 1,) in tokens, and the longest sample."""

    cu_seqlens: torch.Tensor
    max_seqlen: int

    @property
    def bounds(self) -> list[tuple[int, int]]:
        cu = self.cu_seqlens.tolist()
        return list(zip(cu[:-1], cu[1:]))


_ROW: Row | None = None  # the row of the current packed micro-batch, or None (padded layouts)
_SP = None  # the rank's Ulysses group (trainer.policy.ulysses.Group), when sequence parallel
_INNER = "sdpa"  # what runs on a row: sdpa per sample, or a flash varlen implementation


def set_row(row: Row | None) -> None:
    """The row the next forwards (and a checkpointed backward) run on; None for a padded batch."""
    global _ROW
    _ROW = row


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
              sliding_window: int | None = None, softcap: float | None = None, **kwargs):
    """transformers' attention-function signature: q (1, H, n, D), k/v (1, Hkv, n, D) -> ((1, n, H, D), None)."""
    if _ROW is None:  # not a packed row: transformers' sdpa, with the mask it built
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)  # fmt: skip
    tokens = query.shape[2] * (_SP.size if _SP is not None else 1)
    if query.shape[0] != 1 or tokens != int(_ROW.cu_seqlens[-1]):
        raise RuntimeError(f"packed attention: a ({query.shape[0]}, {tokens})-token input is not the row set for "
                           f"this forward ({int(_ROW.cu_seqlens[-1])} tokens): set_row(None) after a packed pass")
    dropout = dropout if module.training else 0.0
    if _SP is None:
        return _attend(module, query, key, value, _ROW, _INNER, dropout, scaling, sliding_window, softcap), None
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads % _SP.size:  # fewer key/value heads than ranks: give every query head its own copy
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    q, k, v = (_SP.to_heads(t) for t in (query, key, value))
    out = _attend(module, q, k, v, _ROW, _INNER, dropout, scaling, sliding_window, softcap)
    return _SP.to_sequence(out), None


def _attend(module, q, k, v, row: Row, inner: str, dropout, scaling, sliding_window, softcap) -> torch.Tensor:
    """Causal attention within each sample of the row: (1, h, N, D) -> (1, N, h, D). The one place where
    devices differ: flash attention's varlen kernel (GPUs), else sdpa once per sample."""
    if inner.startswith("flash"):
        # transformers' own flash wrapper would name the kernel after module.config's implementation,
        # which is this module's: call the function under it with the inner one.
        from transformers.integrations.flash_attention import get_target_dtype
        from transformers.modeling_flash_attention_utils import _flash_attention_forward

        cu = row.cu_seqlens.to(device=q.device, dtype=torch.int32)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (1, N, h, D): flash's layout
        return _flash_attention_forward(
            q, k, v, None, query_length=q.shape[1], is_causal=True, dropout=dropout, softmax_scale=scaling,
            sliding_window=sliding_window, softcap=softcap, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
            max_length_q=row.max_seqlen, max_length_k=row.max_seqlen, target_dtype=get_target_dtype(q, module),
            attn_implementation=inner,
        )
    if softcap is not None:
        raise ValueError("attention logit softcapping needs model.attn_implementation=flash_attention_2 with "
                         "packed rows (policy.sequence_packing)")
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


def _mask(*args, **kwargs):
    """The mask transformers builds for this attention: none for a packed row (the boundaries are in the
    row), sdpa's otherwise."""
    if _ROW is not None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def install(model, inner: str = "sdpa", sp=None) -> None:
    """Route ``model``'s attention through :func:`attention` (every policy model of the process: the
    policy, the reference), with ``inner`` on rows and ``sp`` the rank's Ulysses group, if any."""
    global _INNER, _SP
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, attention)
    AttentionMaskInterface.register(ATTENTION, _mask)
    model.set_attn_implementation(ATTENTION)
    _INNER, _SP = inner, sp
