"""The policy's forward for logprobs: the logits at the positions that predict a batch's response tokens,
in each of the three layouts (:mod:`trainer.policy.batch`: packed rows, padded rows, the shared-prompt
layout), then the labels' logprobs (and entropy) in one chunked float32 pass
(:func:`trainer.algorithms.core_algos.logprobs_and_entropy`). With Ulysses sequence parallelism
(:mod:`trainer.policy.ulysses`) a rank runs its slice of a packed row and the slices' logprobs are
gathered, so every rank of the group returns the whole batch's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from trainer.algorithms import core_algos
from trainer.policy.batch import PackedBatch, PaddedBatch, PrefixBatch
from trainer.policy.packed_attention import Row

if TYPE_CHECKING:
    from trainer.policy.ulysses import SequenceParallelGroup


def set_row(packed_attention: bool, row) -> None:
    """The packed row the policy's attention runs on until the next forward (None: a padded batch)."""
    if packed_attention:
        from trainer.policy.packed_attention import set_row as set_packed_row

        set_packed_row(row)


def window_logits(
    model, batch: PaddedBatch | PrefixBatch | PackedBatch, device: torch.device, sp: SequenceParallelGroup | None,
    packed_attention: bool,
) -> torch.Tensor:
    """(B, K, V) logits at the positions that predict ``batch.labels``; (1, M, V) for a packed
    batch, at its ``predict`` positions."""
    dev = device
    set_row(packed_attention, None)
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
        if sp is not None:  # this rank's slice of the row; attention sees the whole row
            row, input_ids, position_ids, predict = sp.split(batch)
            set_row(packed_attention, row)
            varlen = {}
        elif packed_attention:
            set_row(packed_attention, Row(batch.cu_seqlens, batch.max_seqlen))
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


def forward_logprobs(
    model, batch: PaddedBatch | PrefixBatch | PackedBatch, device: torch.device, sp: SequenceParallelGroup | None,
    packed_attention: bool, temperature: float, with_entropy: bool = False,
):
    """(B, K) logprobs of the window's labels, and optionally (B, K) entropy, from one forward
    and one chunked float32 pass over the logits (kept in the model's dtype)."""
    logits = window_logits(model, batch, device, sp, packed_attention)  # (B, K, V), or (1, M, V) packed
    packed = isinstance(batch, PackedBatch)
    labels = batch.flat_labels[None] if packed else batch.labels
    if packed and sp is not None:  # (M of this slice with SP)
        labels = labels[:, sp.first : sp.first + logits.shape[1]]
    logprobs, entropy = core_algos.logprobs_and_entropy(
        logits,
        labels.to(device),
        chunk_size=core_algos.logit_chunk_rows(logits.shape[-1], logits.device),
        temperature=temperature if temperature > 0 else 1.0,  # score the distribution we sampled from
        with_entropy=with_entropy,
    )
    if packed and sp is not None:  # every slice's tokens, so each rank of the group has them all
        from trainer.policy.ulysses import gather_slices

        logprobs = gather_slices(logprobs[0], sp.counts, sp)[None]
        entropy = gather_slices(entropy[0], sp.counts, sp)[None] if entropy is not None else None
    if packed:  # (1, M) -> the (B, C) window the loss reads, as for the padded layouts
        logprobs = batch.to_window(logprobs[0])
        entropy = batch.to_window(entropy[0]) if entropy is not None else None
    return logprobs, entropy
