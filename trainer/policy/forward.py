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
their backward reads the weight, and reduce-scatters its gradient after.

The tiles must end where the model's own logits do: its forward may transform the head's output before
returning it (Granite divides by ``logits_scaling``, Cohere multiplies by ``logit_scale``, Falcon-H1 by
``lm_head_multiplier``, the Gemmas cap). :func:`head_transform` reads that transform off the model, per
transformers class as its forward applies it (:data:`TRANSFORMS`, from the installed transformers' sources;
the bias is the head's own), and a class it does not know whose config names such a key
(:data:`TRANSFORM_KEYS`) takes the plain path. :func:`check_head` measures the head a run will use against
the model's own logits at start-up, on a few tokens, and refuses a gap in one line (``policy.unchecked_head``
overrides it at the user's risk): a model whose forward does something else after its head (a subclass, remote
code) is caught there instead of training on logprobs that are not the model's.

A head that is not a plain ``nn.Linear`` takes the plain path (:func:`logits_logprobs`: the logits, then
one chunked float32 pass over all of a forward's, :func:`trainer.algorithms.core_algos.logprobs_and_entropy`),
and so does a run whose largest micro-batch's float32 logits stay under :data:`TILE_ABOVE_BYTES`: there the
whole tensor costs less than the tiles' second matmul in backward (the head alone ran 15-20 % slower tiled on a
CPU, bench/README.md), and a small model's run keeps its exact numbers. The choice is the run's, not each
micro-batch's (:func:`fix_rows`, from the largest micro-batch its config allows, :func:`run_rows`): the logprob
pass and the training pass cut a step's samples into micro-batches of different sizes, and were each to pick
its head by its own size, the old and the new logprobs of one step would come from two heads, and the
importance ratio of an on-policy step would not be 1 (the two differ by rounding, more in bfloat16).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from trainer.algorithms import core_algos
from trainer.algorithms.linear_logprobs import Transform, linear_logprobs
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
        transform = head_transform(model)
        if transform is None:
            raise ValueError(f"{model_name(model)}: its logits' transform after the head is not known; "
                             "forward_logprobs takes the plain path for it")  # fmt: skip
        self.transform = transform
        self.temperature = temperature if temperature > 0 else 1.0  # score the distribution we sampled from
        self.with_entropy = with_entropy
        self.fused = model.__dict__.get(_FUSED)  # the run's policy.fused_head (fix_rows); None: the device's

    def project(self, model, labels: torch.Tensor, keep: Callable[[torch.Tensor], torch.Tensor], **inputs):
        head = self.head

        def finish(hidden: torch.Tensor, out):
            """(..., H) hidden at every position the model kept -> logprobs (and entropy) of ``labels``."""
            lp, ent = linear_logprobs(keep(hidden), head.weight, head.bias, labels.to(hidden.device),
                                      temperature=self.temperature, transform=self.transform,
                                      with_entropy=self.with_entropy, fused=self.fused)  # fmt: skip
            return (lp, ent), out.past_key_values

        return _root_forward(model)(finish, **inputs)

    def join(self, parts: Sequence[tuple[torch.Tensor, torch.Tensor | None]], labels, device):
        if len(parts) == 1:
            return parts[0]
        logprobs = torch.cat([lp for lp, _ in parts], dim=1)
        if not self.with_entropy:
            return logprobs, None
        entropies = []
        for _, ent in parts:
            assert ent is not None  # with_entropy: every part computed it
            entropies.append(ent)
        return logprobs, torch.cat(entropies, dim=1)


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


def _forward_to_head(model: Any, finish: Callable[[torch.Tensor, Any], Any], **kwargs: Any) -> Any:
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


# ----- the model's transform after its head -------------------------------------------------------


def _text(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _softcap(value) -> Transform:
    return (("softcap", float(value)),) if value is not None else ()


def _scaled(op: str, value) -> Transform:
    return ((op, float(value)),) if value is not None and float(value) != 1.0 else ()  # x * 1.0 is x exactly


def _granite(m) -> Transform:
    return _scaled("div", m.config.logits_scaling)


def _granite_vision(m) -> Transform:
    return _scaled("div", m.config.text_config.logits_scaling)


def _cohere(m) -> Transform:
    return _scaled("mul", m.logit_scale)


def _gemma(m) -> Transform:
    return _softcap(m.config.final_logit_softcapping)


def _gemma_wrapper(m) -> Transform:
    return _softcap(_text(m).final_logit_softcapping)


def _identity(m) -> Transform:
    return ()


def _not_tiled(m) -> None:
    return None


# What each transformers class's forward does to the head's output before returning its logits, in order
# and in the logits' dtype, as transformers 5.19's modeling files write it: every ForCausalLM and
# ForConditionalGeneration whose forward reads one of TRANSFORM_KEYS (tests/policy/test_head_transforms.py
# finds them in the installed sources). A class's constant is read where its forward reads it (Cohere's
# ``self.logit_scale``, Falcon-H1's ``self.model.lm_head_multiplier``). A wrapper whose text config names such
# a key but whose own forward does not apply it, or that scales the hidden states before the head (the
# tiles' input), is the identity; one whose transform the tiles do not do is None (the plain path).
TRANSFORMS: tuple[tuple[tuple[str, ...], Callable[[Any], Transform | None]], ...] = (
    (
        (
            "GraniteForCausalLM",
            "GraniteSWAForCausalLM",
            "GraniteMoeForCausalLM",
            "GraniteMoeSWAForCausalLM",
            "GraniteMoeHybridForCausalLM",
            "GraniteMoeSharedForCausalLM",
        ),
        _granite,
    ),
    (("Granite4VisionForConditionalGeneration",), _granite_vision),
    (
        (
            "CohereForCausalLM",
            "Cohere2ForCausalLM",
            "Cohere2MoeForCausalLM",
            "CohereCompassForCausalLM",
            "CohereCompassForConditionalGeneration",
        ),
        _cohere,
    ),
    (("FalconH1ForCausalLM",), lambda m: _scaled("mul", m.model.lm_head_multiplier)),
    (("HyperCLOVAXForCausalLM",), lambda m: _scaled("mul", m.config.logits_scaling)),
    (("HyperCLOVAXVisionV2ForConditionalGeneration",), lambda m: _scaled("mul", _text(m).logits_scaling)),
    (
        (
            "Gemma2ForCausalLM",
            "Gemma3ForCausalLM",
            "Gemma3nForCausalLM",
            "Gemma4ForCausalLM",
            "Gemma4UnifiedForCausalLM",
            "VaultGemmaForCausalLM",
            "NanoChatForCausalLM",
        ),
        _gemma,
    ),
    (
        (
            "Gemma3nForConditionalGeneration",
            "Gemma4ForConditionalGeneration",
            "Gemma4UnifiedForConditionalGeneration",
        ),
        _gemma_wrapper,
    ),
    (("RecurrentGemmaForCausalLM",), lambda m: _softcap(m.config.logits_soft_cap)),  # always capped
    (
        ("MuseGlimmerForConditionalGeneration",),
        lambda m: _scaled("mul", _text(m).output_multiplier) + _softcap(_text(m).final_logit_softcapping),
    ),
    # The text config's scale or cap is not applied by these wrappers' forwards (5.19); MiniCPM3 divides
    # the hidden states by logits_scaling before its head.
    (
        (
            "Gemma3ForConditionalGeneration",
            "PaliGemmaForConditionalGeneration",
            "AyaVisionForConditionalGeneration",
            "Cohere2VisionForConditionalGeneration",
            "GraniteSpeechForConditionalGeneration",
            "MiniCPM3ForCausalLM",
        ),
        _identity,
    ),
    # Inkling cuts the vocabulary short after its head, xLSTM caps in float32, the T5Gemmas are
    # encoder-decoders and CLVP a speech model: their own logits (the plain path).
    (
        (
            "InklingForCausalLM",
            "InklingForConditionalGeneration",
            "xLSTMForCausalLM",
            "T5GemmaForConditionalGeneration",
            "T5Gemma2ForConditionalGeneration",
            "ClvpModelForConditionalGeneration",
        ),
        _not_tiled,
    ),
)
KNOWN = frozenset(name for names, _ in TRANSFORMS for name in names)  # the classes TRANSFORMS names

# Config keys that mean a transform after the head somewhere in transformers (a scale, a cap, a vocabulary cut
# short): a class not in TRANSFORMS whose config or text config sets one (to other than 1, for the scales of
# _MULTIPLIERS) takes the plain path.
TRANSFORM_KEYS = ("logits_scaling", "logit_scale", "lm_head_multiplier", "output_multiplier",
                  "final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap", "unpadded_vocab_size",
                  "logits_mup_width_multiplier")  # fmt: skip
_MULTIPLIERS = ("logits_scaling", "logit_scale", "lm_head_multiplier", "output_multiplier",
                "logits_mup_width_multiplier")  # fmt: skip


def model_name(model) -> str:
    """The model's class as a person knows it (FSDP2's ``FSDP`` prefix dropped)."""
    name = type(model).__name__
    return name[4:] if name.startswith("FSDP") and hasattr(model, "reshard") else name


def head_transform(model) -> Transform | None:
    """The ops the model's forward runs on its head's output (:data:`trainer.algorithms.linear_logprobs.OPS`),
    in order; () for none; None when they are not known here (a class not in :data:`TRANSFORMS` whose config
    or text config sets one of :data:`TRANSFORM_KEYS`). A class is found along the model's MRO, so a subclass
    is taken for its transformers base: if its forward does more, :func:`check_head` says so."""
    for cls in type(model).__mro__:
        if cls.__name__ in KNOWN and cls.__module__.startswith("transformers."):
            return next(read for names, read in TRANSFORMS if cls.__name__ in names)(model)
    configs = [getattr(model, "config", None)]
    configs.append(_text(model) if configs[0] is not None else None)
    for config in configs:
        for key in TRANSFORM_KEYS:
            value = getattr(config, key, None)
            if value is None or isinstance(value, bool) or (key in _MULTIPLIERS and value == 1):
                continue
            return None
    return ()


def describe(transform: Transform | None) -> str:
    """``scale 1/4.0, softcap 30.0``: the transform as the self-check line says it."""
    if transform is None:
        return "its transform after the head is not known here"
    words = {"mul": "scale {}", "div": "scale 1/{}", "softcap": "softcap {}"}
    return ", ".join(words[op].format(c) for op, c in transform) or "no transform"


# ----- which head a run takes ----------------------------------------------------------------------
# Float32 logits of a micro-batch (positions x vocabulary x 4 bytes) from which the head goes tile by tile:
# 256 MiB, e.g. 1,300 positions of SmolLM2's 49k vocabulary, or 256 of Gemma 3's 262k.
TILE_ABOVE_BYTES = 256 << 20
_ROWS = "_kuberl_head_rows"  # the attribute fix_rows sets on a model
_FUSED = "_kuberl_fused_head"  # and the run's policy.fused_head


def tiled_head(model) -> bool:
    """Whether the model's LM head is a plain linear layer, which :func:`forward_logprobs` projects a tile at a time."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return type(head) is torch.nn.Linear


def run_rows(policy) -> int:
    """The most positions one micro-batch may project on a rank, over the run's training and logprob passes
    (``policy``: the run's PolicyConfig): its token budget where it has one, else its fixed count of sequences
    of the longest length, split over ``sequence_parallel_size`` ranks. A bound, not an estimate: a
    multi-turn response is longer than ``generation.max_new_tokens``, never than the sequence."""
    sp, longest = policy.sequence_parallel_size, policy.max_total_sequence_length
    return max(
        budget or -(-count * longest // sp)
        for budget, count in (
            (policy.max_tokens_per_microbatch, policy.micro_batch_size),
            (policy.logprob_max_tokens_per_microbatch, policy.logprob_micro_batch_size),
        )
    )


def fix_rows(model, rows: int, fused: bool | None = None) -> None:
    """Every later :func:`forward_logprobs` of ``model`` picks its head for ``rows`` positions (the run's
    largest micro-batch, :func:`run_rows`), whatever the size of the micro-batch it is given: one head for the
    whole run, so a step's logprob pass and training pass agree (the module docstring). ``fused``: the run's
    ``policy.fused_head``, whether the tiles run compiled (None: the device's default,
    :func:`trainer.algorithms.linear_logprobs.fused_default`)."""
    model.__dict__[_ROWS] = rows
    model.__dict__[_FUSED] = fused


def takes_tiles(model, rows: int) -> bool:
    """Whether a forward of ``model`` over ``rows`` positions projects its head a tile at a time: a plain linear
    head whose transform is known, and logits above :data:`TILE_ABOVE_BYTES`."""
    if not tiled_head(model) or head_transform(model) is None:
        return False
    return rows * model.get_output_embeddings().weight.shape[0] * 4 > TILE_ABOVE_BYTES


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
    rank's packed attention when the model's attention is it (:mod:`trainer.policy.packed_attention`).
    The head is the run's (:func:`fix_rows`); a model no run has fixed (a test's, a benchmark's) picks it by
    this batch's positions."""
    if not takes_tiles(model, model.__dict__.get(_ROWS, batch.positions)):
        return logits_logprobs(model, batch, device, attention, temperature, with_entropy)
    return batch.logprobs(model, TiledHead(model, temperature, with_entropy), device, attention)


# ----- the start-up self-check ---------------------------------------------------------------------
# The mean gap (nats per token) the self-check allows between the run's head and the model's own logits: a
# float32 head differs by rounding alone (about 1e-6 on the tests' models); a 16-bit one by a unit in the last
# place of a logit here and there (where the tiles' matmul rounds otherwise than the whole one).
CHECK_BOUND = 1e-4
CHECK_BOUND_16BIT = 2e-2


class HeadCheckError(RuntimeError):
    """The run's LM head does not give the model's own logprobs (the message says by how much, and the key)."""


@torch.no_grad()
def check_head(
    model,
    batch: Batch,
    device: torch.device,
    attention: PackedAttention | None,
    temperature: float,
    compute_dtype: torch.dtype,
    unchecked: bool = False,
) -> str:
    """The head the run uses (:func:`forward_logprobs`, with the rows :func:`fix_rows` set) against the model's
    own logits (:func:`logits_logprobs`: ``model(...).logits``, whatever its forward did after the head), on
    ``batch`` (a few tokens): the one ``self-check:`` line, or :class:`HeadCheckError` when the mean gap over
    its response tokens exceeds the bound for ``compute_dtype`` (:data:`CHECK_BOUND`, :data:`CHECK_BOUND_16BIT`)
    and ``unchecked`` is not
    set. Two forwards of the sharded model: with FSDP2 every rank calls it, on the same batch."""
    rows = model.__dict__.get(_ROWS, batch.positions)
    tiled = takes_tiles(model, rows)
    transform = head_transform(model) if tiled_head(model) else ()
    if tiled:
        head = f"tiled, {describe(transform)}"
    elif not tiled_head(model):
        head = "plain: the model's own logits, its head not a plain linear layer"
    elif transform is None:
        head = f"plain: the model's own logits, {describe(transform)}"
    else:
        head = "plain: the model's own logits, the run's micro-batches below the size it tiles from"
    training = model.training
    model.eval()  # dropout, where a config has it, would make the two forwards differ
    try:
        got, _ = forward_logprobs(model, batch, device, attention, temperature)
        want, _ = logits_logprobs(model, batch, device, attention, temperature)
    finally:
        model.train(training)
    mask = batch.loss_mask.to(got.device) > 0
    gaps = (got - want).abs()[mask].double()
    mean, worst = float(gaps.mean()), float(gaps.max())
    bound = CHECK_BOUND if compute_dtype.itemsize >= 4 else CHECK_BOUND_16BIT
    name = model_name(model)
    model_type = getattr(model.config, "model_type", None)
    of = f"{name}'s logits" + (f" (model_type {model_type})" if model_type else "")
    if not mean <= bound:  # not: a NaN fails too
        if not unchecked:
            raise HeadCheckError(
                f"{name}" + (f" (model_type {model_type})" if model_type else "") + f": the LM head ({head}) "
                f"gives logprobs {mean:.3g} nats/token off the model's own logits (bound {bound:g} in "
                f"{str(compute_dtype).removeprefix('torch.')}): its forward transforms the logits after the head "
                "in a way kuberl does not apply; set policy.unchecked_head=true to train on it at your own risk"
            )
        return (f"self-check: lm head ({head}) does NOT match {of}: {mean:.3g} nats/token off (max {worst:.3g}, "
                f"bound {bound:g}); policy.unchecked_head=true: training on it anyway")  # fmt: skip
    tokens = int(mask.sum())
    return f"self-check: lm head ({head}) matches {of} within {mean:.1g} nats/token (max {worst:.1g}, {tokens} tokens)"
