"""The policy's forward for logprobs: the labels' logprobs (and entropy) at the positions that predict a
batch's response tokens. Each of the three layouts (:mod:`trainer.policy.batch`: packed rows, padded
rows, the shared-prompt layout) makes its own model calls (:meth:`~trainer.policy.batch.Batch.logprobs`);
here is the head those calls end in (:class:`LogitsHead`, :class:`TiledHead`) and which one a batch takes.
With Ulysses sequence parallelism (:mod:`trainer.policy.ulysses`) a rank runs its slice of a packed row
and the slices' logprobs are gathered, so every rank of the group returns the whole batch's.

The LM head's (positions x vocabulary) logits are never held whole: the model runs with its ``lm_head``
handing back the hidden states it is given (already cut to the positions that predict responses), and
:func:`trainer.algorithms.linear_logprobs.linear_logprobs` projects them tile by tile, recomputing each
tile in backward. That runs inside the same FSDP2 forward as the model (``register_fsdp_forward_method``
on a method of our own): the root unit, which holds ``lm_head`` (or the tied embeddings it shares), is
gathered around it, and the pre-backward hook FSDP puts on the returned logprobs gathers it again before
their backward reads the weight, and reduce-scatters its gradient after. The head's post-processing is the
model's: Gemma's final logit softcapping where the model's own config asks for it, the bias if any.
A head that is not a plain ``nn.Linear`` takes the plain path (:func:`logits_logprobs`: the logits, then
one chunked float32 pass over all of a forward's, :func:`trainer.algorithms.core_algos.logprobs_and_entropy`),
and so does a micro-batch whose float32 logits would stay under :data:`TILE_ABOVE_BYTES`: there the whole tensor costs
less than the tiles' second matmul in backward (the head alone ran 15-20 % slower tiled on a CPU,
bench/README.md), and a small model's run keeps its exact numbers.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from trainer.algorithms import core_algos
from trainer.algorithms.linear_logprobs import linear_logprobs
from trainer.policy.batch import Batch
from trainer.policy.packed_attention import PackedAttention


class LogitsHead:
    """The model's own head: each call's logits at the kept positions, then one chunked float32 pass over
    all of a forward's (kept in the model's dtype)."""

    def __init__(self, temperature: float, with_entropy: bool):
        self.temperature = temperature if temperature > 0 else 1.0  # score the distribution we sampled from
        self.with_entropy = with_entropy

    def project(self, model, labels: torch.Tensor, keep: Callable[[torch.Tensor], torch.Tensor], **inputs):
        out = model(**inputs)
        return keep(out.logits), out.past_key_values

    def join(self, parts: Sequence[torch.Tensor], labels: torch.Tensor, device: torch.device):
        # (B, K, V), or (1, M, V) packed
        logits = parts[0] if len(parts) == 1 else torch.cat(list(parts), dim=1)
        return core_algos.logprobs_and_entropy(
            logits,
            labels.to(device),
            chunk_size=core_algos.logit_chunk_rows(logits.shape[-1], logits.device),
            temperature=self.temperature,
            with_entropy=self.with_entropy,
        )


class TiledHead:
    """The model's ``nn.Linear`` head a tile at a time, inside the root unit's FSDP2 forward (the module
    docstring): each call's logprobs (and entropy) at the kept positions, then joined."""

    def __init__(self, model, temperature: float, with_entropy: bool):
        self.head = model.get_output_embeddings()
        self.softcap = getattr(
            model.config, "final_logit_softcapping", None
        )  # only where the model's forward applies it
        self.temperature = temperature if temperature > 0 else 1.0  # score the distribution we sampled from
        self.with_entropy = with_entropy

    def project(self, model, labels: torch.Tensor, keep: Callable[[torch.Tensor], torch.Tensor], **inputs):
        head = self.head

        def finish(hidden: torch.Tensor, out):
            """(..., H) hidden at every position the model kept -> logprobs (and entropy) of ``labels``."""
            lp, ent = linear_logprobs(keep(hidden), head.weight, head.bias, labels.to(hidden.device),
                                      temperature=self.temperature, softcap=self.softcap,
                                      with_entropy=self.with_entropy)  # fmt: skip
            return (lp, ent), out.past_key_values

        return _root_forward(model)(finish, **inputs)

    def join(self, parts: Sequence[tuple[torch.Tensor, torch.Tensor | None]], labels, device):
        if len(parts) == 1:
            return parts[0]
        logprobs = torch.cat([lp for lp, _ in parts], dim=1)
        entropy = torch.cat([ent for _, ent in parts], dim=1) if self.with_entropy else None
        return logprobs, entropy


def logits_logprobs(
    model,
    batch: Batch,
    device: torch.device,
    attention: PackedAttention | None,
    temperature: float,
    with_entropy: bool = False,
):
    """(B, K) logprobs of the window's labels, and optionally (B, K) entropy, from the model's own logits
    (:class:`LogitsHead`)."""
    return batch.logprobs(model, LogitsHead(temperature, with_entropy), device, attention)


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


def tiled_head(model) -> bool:
    """Whether the model's LM head is a plain linear layer, which :func:`forward_logprobs` projects a tile at a time."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return type(head) is torch.nn.Linear


def forward_logprobs(
    model,
    batch: Batch,
    device: torch.device,
    attention: PackedAttention | None,
    temperature: float,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, Any]:
    """(B, K) logprobs of the window's labels, and optionally (B, K) entropy (no gradient), in float32,
    without the window's (B, K, V) logits ever existing whole (the module docstring). ``attention``: the
    rank's packed attention when the model's attention is it (:mod:`trainer.policy.packed_attention`)."""
    vocab = model.get_output_embeddings().weight.shape[0] if tiled_head(model) else 0
    if not vocab or batch.positions * vocab * 4 <= TILE_ABOVE_BYTES:
        return logits_logprobs(model, batch, device, attention, temperature, with_entropy)
    return batch.logprobs(model, TiledHead(model, temperature, with_entropy), device, attention)
