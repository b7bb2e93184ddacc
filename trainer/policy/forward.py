"""The policy's forward for logprobs: the labels' logprobs (and entropy) at the positions that predict a
batch's response tokens, in each of the three layouts (:mod:`trainer.policy.batch`: packed rows, padded
rows, the shared-prompt layout). With Ulysses sequence parallelism (:mod:`trainer.policy.ulysses`) a
rank runs its slice of a packed row and the slices' logprobs are gathered, so every rank of the group
returns the whole batch's.

The LM head's (positions x vocabulary) logits are never held whole: the model runs with its ``lm_head``
handing back the hidden states it is given (already cut to the positions that predict responses), and
:func:`trainer.algorithms.linear_logprobs.linear_logprobs` projects them tile by tile, recomputing each
tile in backward. That runs inside the same FSDP2 forward as the model (``register_fsdp_forward_method``
on a method of our own): the root unit, which holds ``lm_head`` (or the tied embeddings it shares), is
gathered around it, and the pre-backward hook FSDP puts on the returned logprobs gathers it again before
their backward reads the weight, and reduce-scatters its gradient after. The head's post-processing is the
model's: Gemma's final logit softcapping where the model's own config asks for it, the bias if any.
A head that is not a plain ``nn.Linear`` takes the plain path (:func:`logits_logprobs`: the logits, then
one chunked float32 pass, :func:`trainer.algorithms.core_algos.logprobs_and_entropy`), and so does a
micro-batch whose float32 logits would stay under :data:`TILE_ABOVE_BYTES`: there the whole tensor costs
less than the tiles' second matmul in backward (the head alone ran 15-20 % slower tiled on a CPU,
bench/README.md), and a small model's run keeps its exact numbers.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING

import torch

from trainer.algorithms import core_algos
from trainer.algorithms.linear_logprobs import linear_logprobs
from trainer.policy.batch import PackedBatch, PaddedBatch, PrefixBatch
from trainer.policy.packed_attention import Row

if TYPE_CHECKING:
    from trainer.policy.ulysses import SequenceParallelGroup


def set_row(packed_attention: bool, row) -> None:
    """The packed row the policy's attention runs on until the next forward (None: a padded batch)."""
    if packed_attention:
        from trainer.policy.packed_attention import set_row as set_packed_row

        set_packed_row(row)


def flash_boundaries(model, batch: PackedBatch, device: torch.device) -> dict:
    """The packed row's sample boundaries as flash attention's varlen arguments, for a model that runs
    flash attention (so it need not infer them in every layer); nothing for any other implementation."""
    if "flash" not in (getattr(model.config, "_attn_implementation", None) or ""):
        return {}
    cu = batch.cu_seqlens.to(device)
    return dict(
        cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=batch.max_seqlen, max_length_k=batch.max_seqlen
    )


def window_logits(
    model,
    batch: PaddedBatch | PrefixBatch | PackedBatch,
    device: torch.device,
    sp: SequenceParallelGroup | None,
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
        varlen = flash_boundaries(model, batch, dev)
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


def logits_logprobs(
    model,
    batch: PaddedBatch | PrefixBatch | PackedBatch,
    device: torch.device,
    sp: SequenceParallelGroup | None,
    packed_attention: bool,
    temperature: float,
    with_entropy: bool = False,
):
    """(B, K) logprobs of the window's labels, and optionally (B, K) entropy, from one forward and one
    chunked float32 pass over the whole window's logits (kept in the model's dtype)."""
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
    return _to_window(batch, sp, logprobs, entropy)


def _to_window(batch, sp: SequenceParallelGroup | None, logprobs: torch.Tensor, entropy: torch.Tensor | None):
    """A packed row's (1, M) results (of this rank's slice with SP) -> the (B, C) window the loss reads."""
    if not isinstance(batch, PackedBatch):
        return logprobs, entropy
    if sp is not None:  # every slice's tokens, so each rank of the group has them all
        from trainer.policy.ulysses import gather_slices

        logprobs = gather_slices(logprobs[0], sp.counts, sp)[None]
        entropy = gather_slices(entropy[0], sp.counts, sp)[None] if entropy is not None else None
    logprobs = batch.to_window(logprobs[0])
    entropy = batch.to_window(entropy[0]) if entropy is not None else None
    return logprobs, entropy


# ----- the head, a tile at a time -------------------------------------------------------------------
_METHOD = "_kuberl_forward_to_head"  # the method FSDP2 treats as a forward of the root unit


def _forward_to_head(model, finish, **kwargs):
    """``model.forward(**kwargs)`` with ``lm_head`` handing back its input, then ``finish(hidden, output)``:
    hidden (..., H) as the head received it, output the model's (its logits empty). Called through the
    method FSDP2 wraps, so the root's parameters are gathered for ``finish`` too."""
    head = model.get_output_embeddings()
    seen: list[torch.Tensor] = []

    def keep(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(hidden)
        return hidden.new_empty(*hidden.shape[:-1], 0)  # what the model does after the head runs on nothing

    head.forward = keep  # the instance's own forward, removed below: nn.Module calls self.forward
    try:
        out = model.forward(**kwargs)  # not model(...): FSDP's hooks already ran around this method
    finally:
        del head.forward
    return finish(seen[-1], out)


def _root_forward(model):
    """The model's :func:`_forward_to_head`, bound once per model and registered with FSDP2 (a no-op without it)."""
    method = model.__dict__.get(_METHOD)
    if method is None:
        from torch.distributed.fsdp import register_fsdp_forward_method

        setattr(model, _METHOD, types.MethodType(_forward_to_head, model))
        register_fsdp_forward_method(model, _METHOD)
        method = model.__dict__[_METHOD]
    return method


# Float32 logits of a micro-batch (positions x vocabulary x 4 bytes) from which the head goes tile by tile:
# 256 MiB, e.g. 1,300 positions of SmolLM2's 49k vocabulary, or 256 of Gemma 3's 262k.
TILE_ABOVE_BYTES = 256 << 20


def positions(batch: PaddedBatch | PrefixBatch | PackedBatch) -> int:
    """Positions whose logits a batch's logprob pass projects."""
    return int(batch.flat_labels.numel() if isinstance(batch, PackedBatch) else batch.labels.numel())


def tiled_head(model) -> bool:
    """Whether the model's LM head is a plain linear layer, which :func:`forward_logprobs` projects a tile at a time."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return type(head) is torch.nn.Linear


def forward_logprobs(
    model,
    batch: PaddedBatch | PrefixBatch | PackedBatch,
    device: torch.device,
    sp: SequenceParallelGroup | None,
    packed_attention: bool,
    temperature: float,
    with_entropy: bool = False,
):
    """(B, K) logprobs of the window's labels, and optionally (B, K) entropy (no gradient), in float32,
    without the window's (B, K, V) logits ever existing whole (the module docstring)."""
    vocab = model.get_output_embeddings().weight.shape[0] if tiled_head(model) else 0
    if not vocab or positions(batch) * vocab * 4 <= TILE_ABOVE_BYTES:
        return logits_logprobs(model, batch, device, sp, packed_attention, temperature, with_entropy)
    head = model.get_output_embeddings()
    softcap = getattr(
        model.config, "final_logit_softcapping", None
    )  # only where the model's forward applies it
    temperature = temperature if temperature > 0 else 1.0  # score the distribution we sampled from

    def logprobs_of(labels: torch.Tensor):
        """finish: (..., H) hidden at the positions that predict ``labels`` (...,) -> (logprobs, entropy)."""

        def finish(hidden: torch.Tensor, out):
            lp, ent = linear_logprobs(hidden, head.weight, head.bias, labels.to(hidden.device), temperature=temperature,
                                      softcap=softcap, with_entropy=with_entropy)  # fmt: skip
            return lp, ent, out.past_key_values

        return finish

    run = _root_forward(model)
    dev = device
    set_row(packed_attention, None)
    if isinstance(batch, PackedBatch):
        varlen = flash_boundaries(model, batch, dev)
        input_ids, position_ids, predict = batch.input_ids, batch.position_ids, batch.predict
        labels = batch.flat_labels[None]
        if sp is not None:
            row, input_ids, position_ids, predict = sp.split(batch)
            set_row(packed_attention, row)
            varlen = {}
            labels = labels[:, sp.first : sp.first + predict.numel()]  # (1, M of this slice)
        elif packed_attention:
            set_row(packed_attention, Row(batch.cu_seqlens, batch.max_seqlen))
        logprobs, entropy, _ = run(
            logprobs_of(labels), input_ids=input_ids.to(dev), position_ids=position_ids.to(dev),
            logits_to_keep=predict.to(dev), use_cache=False, **varlen,
        )  # fmt: skip
        return _to_window(batch, sp, logprobs, entropy)
    if isinstance(batch, PaddedBatch):
        width = batch.input_ids.shape[1]
        last = batch.labels.shape[
            1
        ]  # (B, K): the head's W positions but the last, which predicts past the end
        logprobs, entropy, _ = run(
            lambda hidden, out: logprobs_of(batch.labels)(hidden[:, :last], out),
            input_ids=batch.input_ids.to(dev), attention_mask=batch.attention_mask.to(dev),
            logits_to_keep=width - batch.start, use_cache=False,
        )  # fmt: skip
        return logprobs, entropy
    from transformers import DynamicCache

    # As in window_logits: each distinct prompt once, its cache gathered to every sample of it. The
    # prompt's last position predicts response token 0, for each sample of the prompt (rows).
    prompt_mask = batch.prompt_mask.to(dev)
    rows = batch.rows.to(dev)
    cache = DynamicCache(config=getattr(model, "config", None))
    first, first_entropy, cache = run(
        lambda hidden, out: logprobs_of(batch.labels[:, :1])(hidden[rows], out),  # (B, 1, H)
        input_ids=batch.prompt_ids.to(dev), attention_mask=prompt_mask,
        position_ids=(prompt_mask.cumsum(1) - 1).clamp(min=0), past_key_values=cache, use_cache=True,
        logits_to_keep=1,
    )  # fmt: skip
    cache.batch_select_indices(rows)
    lengths = prompt_mask.sum(1)[rows]  # (B,)
    width = batch.response_ids.shape[1]
    rest, rest_entropy, _ = run(
        lambda hidden, out: logprobs_of(batch.labels[:, 1:])(hidden[:, :-1], out),  # the last predicts past the end
        input_ids=batch.response_ids.to(dev),
        attention_mask=torch.cat([prompt_mask[rows], batch.response_mask.to(dev)], dim=1),
        position_ids=lengths[:, None] + torch.arange(width, device=dev), past_key_values=cache, use_cache=True,
        logits_to_keep=width,
    )  # fmt: skip
    entropy = torch.cat([first_entropy, rest_entropy], dim=1) if with_entropy else None
    return torch.cat([first, rest], dim=1), entropy
