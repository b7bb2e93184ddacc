"""Packing rollouts into training tensors, and splitting a batch over data-parallel ranks.

A sample is ``prompt_ids + response_ids``; only response tokens carry loss. Logprobs are stored per
response token, aligned with ``response_ids``.

Three layouts: :class:`PackedBatch` (``policy.sequence_packing``, the default) concatenates the
samples into one row without padding, with position ids that restart at 0 for each sample, so a
ragged batch costs its real tokens and not B x its longest one; :class:`PrefixBatch` runs every
distinct prompt once and lets all of its samples attend to that one prompt's keys and values (GRPO
draws several samples per prompt, so the prompt tokens would otherwise be computed, and
back-propagated, once per sample); :class:`PaddedBatch` is the plain right-padded layout. With both
``sequence_packing`` and ``shared_prefix`` on (the defaults), each micro-batch takes whichever of the
first two runs fewer positions (:func:`prefers_prefix`).

Each layout is a :class:`Batch`: the loss's (B, K) tensors, and its own forward (the model calls that give
the window's logprobs, with a :class:`Head` that turns the hidden states at the positions that predict
responses into logprobs: :mod:`trainer.policy.forward`) and its own unpadding back to per-sample values.

A micro-batch is a fixed number of samples (``policy.micro_batch_size``) or, with
``policy.max_tokens_per_microbatch``, as many as fit a token budget (:func:`budget_micro_batches`,
first-fit decreasing), split further until every data-parallel rank runs the same number
(:func:`split_to_count`): FSDP's gathers are collectives, so no rank may take an extra forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from trainer.models import moe
from trainer.models.prompts import distinct_prompts
from trainer.policy.packed_attention import PackedAttention


@dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    advantage: float = 0.0
    old_logprobs: list[float] | None = None  # (L,) policy logprobs before the update
    ref_logprobs: list[float] | None = None  # (L,) reference-policy logprobs (KL penalty)
    response_mask: list[int] | None = None  # (L,) 0 marks tokens the model did not write (multi-turn)
    gen_logprobs: list[float] | None = None  # (L,) the engine's logprobs when it sampled (behaviour policy)
    # An MoE engine's routes (prompt + L - 1, layers, k) expert ids: trainer.models.moe (None: none returned)
    routes: Any = None
    extra: dict = field(default_factory=dict)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


class Head(Protocol):
    """How a forward's positions become logprobs (:mod:`trainer.policy.forward`: the model's own logits, or
    its head a tile at a time). A layout calls :meth:`project` once per model call, then :meth:`join`."""

    def project(
        self, model: Any, labels: torch.Tensor, keep: Callable[[torch.Tensor], torch.Tensor], **inputs: Any
    ) -> tuple[Any, Any]:
        """``model(**inputs)``; of what its head gives (or takes), the positions ``keep`` selects, which
        predict ``labels``: a part for :meth:`join`, and the call's cache."""
        ...

    def join(
        self, parts: Sequence[Any], labels: torch.Tensor, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The parts of one forward, in order along dim 1 -> logprobs of ``labels`` and the entropy (or None)."""
        ...


class Batch(Protocol):
    """One micro-batch in one layout: the loss reads its (B, K) window, where K is the layout's."""

    loss_mask: torch.Tensor  # (B, K) 1 where the label is a response token the model wrote
    advantages: torch.Tensor  # (B,)
    old_logprobs: torch.Tensor | None  # (B, K)
    ref_logprobs: torch.Tensor | None  # (B, K)
    gen_logprobs: torch.Tensor | None  # (B, K)
    routing: moe.Mode  # what an MoE model's routers do in this batch's calls (replay, record)

    @property
    def positions(self) -> int:
        """Positions whose logits the logprob pass projects."""
        ...

    def logprobs(
        self, model: Any, head: Head, device: torch.device, attention: PackedAttention | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, K) logprobs of the window's labels and (B, K) entropy or None, from ``model``'s forward.
        ``attention``: the rank's packed attention when the model's attention is it, else None."""
        ...

    def unpad(self, samples: list[Sample], logprobs: torch.Tensor) -> list[list[float]]:
        """(B, K) window values -> per-sample response values (L_i,)."""
        ...


@dataclass
class PaddedBatch:
    """Right-padded sequences, and label-aligned tensors over the window where responses live.

    Only positions ``start .. T-2`` predict response tokens (``start`` = shortest prompt - 1), so
    the policy computes logits for those K = T-1-start positions alone: the (B, T, V) projection
    over the prompts is the largest single cost for short answers and a 49k vocabulary.
    """

    input_ids: torch.Tensor  # (B, T) right-padded prompt+response
    attention_mask: torch.Tensor  # (B, T)
    start: int  # first position (of T-1) whose label can be a response token
    labels: torch.Tensor  # (B, K) input_ids[:, start+1:]: the token each position predicts
    loss_mask: torch.Tensor  # (B, K) 1 where the label is a response token the model wrote
    advantages: torch.Tensor  # (B,)
    old_logprobs: torch.Tensor | None  # (B, K), aligned with labels
    ref_logprobs: torch.Tensor | None  # (B, K)
    gen_logprobs: torch.Tensor | None  # (B, K)
    routes: torch.Tensor | None = None  # (B, T, layers, k) the engine's expert ids, moe.FREE where none
    routing: moe.Mode = field(default_factory=moe.Mode)

    @property
    def positions(self) -> int:
        return int(self.labels.numel())

    def logprobs(
        self, model: Any, head: Head, device: torch.device, attention: PackedAttention | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        width = self.input_ids.shape[1]
        with moe.calling(model, self.routing.call(self.routes, _but_last(self.attention_mask, self.routing))):
            part, _ = head.project(
                model,
                self.labels,
                lambda x: x[:, :-1],  # the last position predicts past the end
                input_ids=self.input_ids.to(device),
                attention_mask=self.attention_mask.to(device),
                logits_to_keep=width - self.start,  # project only the positions that predict responses
                use_cache=False,
            )
        return head.join([part], self.labels, device)

    def unpad(self, samples: list[Sample], logprobs: torch.Tensor) -> list[list[float]]:
        out = []
        for row, s in enumerate(samples):
            first = len(s.prompt_ids) - 1 - self.start
            out.append(logprobs[row, first : first + len(s.response_ids)].tolist())
        return out


def _but_last(mask: torch.Tensor, routing: moe.Mode) -> torch.Tensor | None:
    """A right-padded (B, T) token mask without each row's last token: the positions an MoE engine routed (the
    last sampled token is never fed back, and its output predicts nothing), which the routing statistics count
    (trainer.models.moe.stat_sums); None when nothing records them (a dense model's every forward)."""
    if not routing.record:
        return None
    out = mask.clone()
    lengths = mask.sum(1)
    rows = torch.nonzero(lengths > 0).flatten()
    out[rows, lengths[rows] - 1] = 0
    return out


def _scatter(
    samples: list[Sample], attr: str, shape: tuple[int, ...], firsts: list[int]
) -> torch.Tensor | None:
    """Per-response-token values of ``attr`` into a (B, K) window; row i starts at column ``firsts[i]``."""
    if any(getattr(s, attr) is None for s in samples):
        return None
    out = torch.zeros(shape)
    for row, (s, first) in enumerate(zip(samples, firsts)):
        values = getattr(s, attr)
        out[row, first : first + len(values)] = torch.tensor(values, dtype=torch.float32)
    return out


def pad_batch(samples: list[Sample], pad_id: int) -> PaddedBatch:
    width = max(s.length for s in samples)
    start = min(len(s.prompt_ids) for s in samples) - 1
    input_ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), width), dtype=torch.long)
    shape = (len(samples), width - 1 - start)
    loss_mask = torch.zeros(shape)
    firsts = [len(s.prompt_ids) - 1 - start for s in samples]  # window column of each first response label
    for row, (s, first) in enumerate(zip(samples, firsts)):
        ids = s.prompt_ids + s.response_ids
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
        mask = s.response_mask if s.response_mask is not None else [1] * len(s.response_ids)
        loss_mask[row, first : first + len(s.response_ids)] = torch.tensor(mask, dtype=torch.float32)
    return PaddedBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        start=start,
        labels=input_ids[:, start + 1 :],
        loss_mask=loss_mask,
        advantages=torch.tensor([s.advantage for s in samples], dtype=torch.float32),
        old_logprobs=_scatter(samples, "old_logprobs", shape, firsts),
        ref_logprobs=_scatter(samples, "ref_logprobs", shape, firsts),
        gen_logprobs=_scatter(samples, "gen_logprobs", shape, firsts),
        routes=_padded_routes(samples, width),
    )


def _sample_routes(samples: list[Sample]) -> list[torch.Tensor] | None:
    """Each sample's routes over its positions (:func:`trainer.models.moe.positions`), or None when no sample of
    the batch carries any."""
    present = [s.routes for s in samples if s.routes is not None]
    if not present:
        return None
    _, layers, k = present[0].shape
    return moe.positions([s.routes for s in samples], [s.length for s in samples], layers, k)


def _padded_routes(samples: list[Sample], width: int) -> torch.Tensor | None:
    per = _sample_routes(samples)
    if per is None:
        return None
    out = torch.full((len(samples), width, *per[0].shape[1:]), moe.FREE, dtype=torch.int64)
    for row, r in enumerate(per):
        out[row, : r.shape[0]] = r
    return out


@dataclass
class PrefixBatch:
    """Distinct prompts once (left-padded, so they all end at column P-1), responses right-padded.

    The first response token is predicted by the prompt's last position, the others by the
    response's own positions, so the (B, C) window below has column j = response token j.
    """

    prompt_ids: torch.Tensor  # (U, P) distinct prompts, left-padded
    prompt_mask: torch.Tensor  # (U, P)
    rows: torch.Tensor  # (B,) the prompt row of each sample
    response_ids: torch.Tensor  # (B, C) right-padded; also the labels of the window
    response_mask: torch.Tensor  # (B, C) 1 on real response tokens (attention)
    loss_mask: torch.Tensor  # (B, C) 1 where the token is one the model wrote
    advantages: torch.Tensor  # (B,)
    old_logprobs: torch.Tensor | None  # (B, C)
    ref_logprobs: torch.Tensor | None  # (B, C)
    gen_logprobs: torch.Tensor | None  # (B, C)
    prompt_routes: torch.Tensor | None = None  # (U, P, layers, k), left-padded as prompt_ids
    response_routes: torch.Tensor | None = None  # (B, C, layers, k)
    routing: moe.Mode = field(default_factory=moe.Mode)

    @property
    def labels(self) -> torch.Tensor:
        return self.response_ids

    @property
    def positions(self) -> int:
        return int(self.labels.numel())

    def logprobs(
        self, model: Any, head: Head, device: torch.device, attention: PackedAttention | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        from transformers import DynamicCache

        # Each distinct prompt once; its keys and values (still in the autograd graph) are then gathered to
        # every sample of it, so its gradient sums over the group as a padded batch would. The prompt's last
        # position predicts response token 0, for each sample of the prompt (rows).
        prompt_mask = self.prompt_mask.to(device)
        rows = self.rows.to(device)
        with moe.calling(model, self.routing.call(self.prompt_routes, self.prompt_mask)):
            first, cache = head.project(
                model,
                self.labels[:, :1],
                lambda x: x[rows],  # (B, 1, .)
                input_ids=self.prompt_ids.to(device),
                attention_mask=prompt_mask,
                position_ids=(prompt_mask.cumsum(1) - 1).clamp(min=0),
                past_key_values=DynamicCache(config=getattr(model, "config", None)),
                use_cache=True,
                logits_to_keep=1,
            )
        cache.batch_select_indices(rows)
        lengths = prompt_mask.sum(1)[rows]  # (B,)
        width = self.response_ids.shape[1]
        with moe.calling(
            model, self.routing.call(self.response_routes, _but_last(self.response_mask, self.routing))
        ):
            rest, _ = head.project(
                model,
                self.labels[:, 1:],
                lambda x: x[:, :-1],  # the last predicts past the end
                input_ids=self.response_ids.to(device),
                attention_mask=torch.cat([prompt_mask[rows], self.response_mask.to(device)], dim=1),
                position_ids=lengths[:, None] + torch.arange(width, device=device),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=width,
            )
        return head.join([first, rest], self.labels, device)

    def unpad(self, samples: list[Sample], logprobs: torch.Tensor) -> list[list[float]]:
        return [logprobs[row, : len(s.response_ids)].tolist() for row, s in enumerate(samples)]


def prefix_batch(samples: list[Sample], pad_id: int) -> PrefixBatch:
    prompt_ids, prompt_mask, rows = distinct_prompts([s.prompt_ids for s in samples], pad_id)
    c = max(max(len(s.response_ids) for s in samples), 1)
    response_ids = torch.full((len(samples), c), pad_id, dtype=torch.long)
    response_mask = torch.zeros((len(samples), c), dtype=torch.long)
    loss_mask = torch.zeros((len(samples), c))
    for row, s in enumerate(samples):
        n = len(s.response_ids)
        response_ids[row, :n] = torch.tensor(s.response_ids, dtype=torch.long)
        response_mask[row, :n] = 1
        mask = s.response_mask if s.response_mask is not None else [1] * n
        loss_mask[row, :n] = torch.tensor(mask, dtype=torch.float32)
    prompt_routes, response_routes = _prefix_routes(samples, rows, prompt_ids.shape[1], c)
    return PrefixBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        rows=torch.tensor(rows, dtype=torch.long),
        response_ids=response_ids,
        response_mask=response_mask,
        loss_mask=loss_mask,
        advantages=torch.tensor([s.advantage for s in samples], dtype=torch.float32),
        old_logprobs=_scatter(samples, "old_logprobs", loss_mask.shape, [0] * len(samples)),
        ref_logprobs=_scatter(samples, "ref_logprobs", loss_mask.shape, [0] * len(samples)),
        gen_logprobs=_scatter(samples, "gen_logprobs", loss_mask.shape, [0] * len(samples)),
        prompt_routes=prompt_routes,
        response_routes=response_routes,
    )


def _prefix_routes(
    samples: list[Sample], rows: list[int], width: int, c: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The shared-prompt layout's routes: each distinct prompt's from its first sample (left-padded), and
    each sample's response positions."""
    per = _sample_routes(samples)
    if per is None:
        return None, None
    shape = per[0].shape[1:]
    prompts = torch.full((max(rows) + 1, width, *shape), moe.FREE, dtype=torch.int64)
    responses = torch.full((len(samples), c, *shape), moe.FREE, dtype=torch.int64)
    seen: set[int] = set()
    for s, row, r in zip(samples, rows, per):
        if row not in seen:
            seen.add(row)
            prompts[row, width - len(s.prompt_ids) :] = r[: len(s.prompt_ids)]
    for i, (s, r) in enumerate(zip(samples, per)):
        p = len(s.prompt_ids)
        responses[i, : r.shape[0] - p] = r[p:]
    return prompts, responses


@dataclass
class PackedBatch:
    """All samples in one row, no padding; position ids restart at 0 at each sample, which is how
    transformers tells packed sequences apart (and the policy's sdpa runs each sample on its own:
    :mod:`trainer.policy.packed_attention`; flash attention's varlen kernels), so attention never crosses
    from one sample into the next.

    The loss sees the same (B, C) window as :class:`PrefixBatch` (column j = response token j, right-
    padded), so every aggregation, ratio and KL is computed exactly as for the padded layouts. Only the
    M packed positions that predict a response token are projected to the vocabulary; ``window_index``
    says where each of their M logprobs goes in the flattened (B * C) window.
    """

    input_ids: torch.Tensor  # (1, N) every sample's prompt + response, back to back
    position_ids: torch.Tensor  # (1, N) 0 .. len_i - 1 for each sample
    cu_seqlens: torch.Tensor  # (B + 1,) int32 sample boundaries in the row (flash-attention varlen)
    max_seqlen: int  # the longest sample
    predict: torch.Tensor  # (M,) packed positions whose next token is a response token
    window_index: torch.Tensor  # (M,) row * C + column of each predicted token in the window
    labels: torch.Tensor  # (B, C) response ids, right-padded
    loss_mask: torch.Tensor  # (B, C)
    advantages: torch.Tensor  # (B,)
    old_logprobs: torch.Tensor | None  # (B, C)
    ref_logprobs: torch.Tensor | None  # (B, C)
    gen_logprobs: torch.Tensor | None  # (B, C)
    routes: torch.Tensor | None = None  # (N, layers, k) the engine's expert ids per packed position
    routing: moe.Mode = field(default_factory=moe.Mode)

    @property
    def flat_labels(self) -> torch.Tensor:
        """(M,) the token each of ``predict`` predicts."""
        return self.labels.reshape(-1)[self.window_index]

    def to_window(self, flat: torch.Tensor) -> torch.Tensor:
        """(M,) per-predicted-token values -> (B, C), zero off the responses; differentiable."""
        b, c = self.labels.shape
        return flat.new_zeros(b * c).index_copy(0, self.window_index.to(flat.device), flat).view(b, c)

    @property
    def positions(self) -> int:
        return int(self.window_index.numel())

    def logprobs(
        self, model: Any, head: Head, device: torch.device, attention: PackedAttention | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """No attention mask and no cache. The policy's own attention (``attention``) runs each sample of the
        row on its own, told the row by the ``packed_row`` keyword; with Ulysses this rank runs its slice of
        the row (attention sees the whole row) and the slices' logprobs are gathered over the group. A model
        running flash attention gets the boundaries themselves, so it runs its varlen kernel without
        inferring them in every layer. Others (eager): transformers reads the boundaries from the position
        ids (a block-diagonal mask)."""
        sp = attention.sp if attention is not None else None
        input_ids, position_ids, predict = self.input_ids, self.position_ids, self.predict
        labels = self.flat_labels[None]
        keywords: dict[str, Any] = self._flash_boundaries(model, device)
        routes, counted = self.routes, None
        if self.routing.record:  # the positions the statistics count: each sample's but its last (_but_last)
            counted = torch.ones(self.input_ids.shape[1], dtype=torch.long)
            counted[self.cu_seqlens[1:].long() - 1] = 0
        if sp is not None:
            assert attention is not None
            row, input_ids, position_ids, predict = sp.split(self)
            # this rank's slice of the routes, the row padded as slice_row pads it (no routes there)
            n = input_ids.shape[1]
            lo = sp.rank_in_group * n
            if routes is not None:
                pad = routes.new_full((n * sp.size - routes.shape[0], *routes.shape[1:]), moe.FREE)
                routes = torch.cat([routes, pad])[lo : lo + n]
            if counted is not None:
                counted = torch.cat([counted, counted.new_zeros(n * sp.size - counted.numel())])[lo : lo + n]
            keywords = {"packed_row": attention.row(row.cu_seqlens, row.max_seqlen, row.tokens)}
            labels = labels[:, sp.first : sp.first + predict.numel()]  # (1, M of this slice)
        elif attention is not None:
            keywords = {
                "packed_row": attention.row(self.cu_seqlens, self.max_seqlen, self.input_ids.shape[1])
            }
        with moe.calling(model, self.routing.call(routes, counted)):
            part, _ = head.project(
                model,
                labels,
                lambda x: x,
                input_ids=input_ids.to(device),
                position_ids=position_ids.to(device),
                logits_to_keep=predict.to(device),  # project only the positions that predict responses
                use_cache=False,
                **keywords,
            )
        logprobs, entropy = head.join([part], labels, device)  # (1, M), of this rank's slice with SP
        if sp is not None:  # every slice's tokens, so each rank of the group has them all
            from trainer.policy.ulysses import gather_slices

            logprobs = gather_slices(logprobs[0], sp.counts, sp)[None]
            entropy = gather_slices(entropy[0], sp.counts, sp)[None] if entropy is not None else None
        return self.to_window(logprobs[0]), self.to_window(entropy[0]) if entropy is not None else None

    def _flash_boundaries(self, model: Any, device: torch.device) -> dict[str, Any]:
        """The row's sample boundaries as flash attention's varlen arguments, for a model that runs flash
        attention (so it need not infer them in every layer); nothing for any other implementation."""
        if "flash" not in (getattr(model.config, "_attn_implementation", None) or ""):
            return {}
        cu = self.cu_seqlens.to(device)
        return dict(
            cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=self.max_seqlen, max_length_k=self.max_seqlen
        )

    def unpad(self, samples: list[Sample], logprobs: torch.Tensor) -> list[list[float]]:
        return [logprobs[row, : len(s.response_ids)].tolist() for row, s in enumerate(samples)]


def pack_batch(samples: list[Sample], pad_id: int) -> PackedBatch:
    """Samples back to back in one (1, N) row; ``pad_id`` only fills the (B, C) label window."""
    c = max(max(len(s.response_ids) for s in samples), 1)
    labels = torch.full((len(samples), c), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((len(samples), c))
    ids: list[int] = []
    positions: list[int] = []
    predict: list[int] = []
    window: list[int] = []
    bounds = [0]
    for row, s in enumerate(samples):
        n = len(s.response_ids)
        if n:
            # Response token j is predicted by the position before it: prompt_len - 1 + j in the sample.
            first = len(ids) + len(s.prompt_ids) - 1
            predict.extend(range(first, first + n))
            window.extend(range(row * c, row * c + n))
            labels[row, :n] = torch.tensor(s.response_ids, dtype=torch.long)
            mask = s.response_mask if s.response_mask is not None else [1] * n
            loss_mask[row, :n] = torch.tensor(mask, dtype=torch.float32)
        ids.extend(s.prompt_ids + s.response_ids)
        positions.extend(range(s.length))
        bounds.append(len(ids))
    return PackedBatch(
        input_ids=torch.tensor([ids], dtype=torch.long),
        position_ids=torch.tensor([positions], dtype=torch.long),
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32),
        max_seqlen=max(s.length for s in samples),
        predict=torch.tensor(predict, dtype=torch.long),
        window_index=torch.tensor(window, dtype=torch.long),
        labels=labels,
        loss_mask=loss_mask,
        advantages=torch.tensor([s.advantage for s in samples], dtype=torch.float32),
        old_logprobs=_scatter(samples, "old_logprobs", loss_mask.shape, [0] * len(samples)),
        ref_logprobs=_scatter(samples, "ref_logprobs", loss_mask.shape, [0] * len(samples)),
        gen_logprobs=_scatter(samples, "gen_logprobs", loss_mask.shape, [0] * len(samples)),
        routes=_packed_routes(samples),
    )


def _packed_routes(samples: list[Sample]) -> torch.Tensor | None:
    per = _sample_routes(samples)
    return None if per is None else torch.cat(per)


def layout(samples: list[Sample], pad_id: int, prefix: bool, packed: bool) -> Batch:
    """``samples`` as one micro-batch: the shared-prompt layout when ``prefix``, else packed rows when
    ``packed``, else padded rows (a type checker holds each to :class:`Batch` here)."""
    if prefix:
        return prefix_batch(samples, pad_id)
    return pack_batch(samples, pad_id) if packed else pad_batch(samples, pad_id)


def unpad_logprobs(samples: list[Sample], batch: Batch, logprobs: torch.Tensor) -> list[list[float]]:
    """(B, K) window logprobs -> per-sample response logprobs (L_i,)."""
    return batch.unpad(samples, logprobs)


def prefix_positions(samples: list[Sample]) -> int:
    """Positions :class:`PrefixBatch` runs through the model for ``samples``: each distinct prompt once at
    the longest prompt's width, and every response at the longest response's width."""
    prompts = {tuple(s.prompt_ids) for s in samples}
    return len(prompts) * max(map(len, prompts)) + len(samples) * max(
        max(len(s.response_ids) for s in samples), 1
    )


def prefers_prefix(samples: list[Sample]) -> bool:
    """Whether the shared-prompt layout runs fewer positions than the packed row (``sum`` of lengths):
    a micro-batch of whole GRPO groups with short, even responses (each prompt once instead of once per
    sample); ragged or prompt-light micro-batches pack. Both layouts give the same values (the packing
    equality tests), so the cheaper one is chosen per micro-batch."""
    return prefix_positions(samples) < sum(s.length for s in samples)


def micro_batch_tokens(lengths: list[int], packed: bool) -> int:
    """Tokens one forward computes for samples of ``lengths``: their sum packed, B x the longest padded."""
    return sum(lengths) if packed else len(lengths) * max(lengths, default=0)


def budget_micro_batches(lengths: list[int], max_tokens: int, packed: bool) -> list[list[int]]:
    """Sample indices per micro-batch, each within ``max_tokens`` (:func:`micro_batch_tokens`), by first-fit
    decreasing: longest first, each into the first micro-batch it fits, else a new one. Within a
    micro-batch the indices are longest first (padded: the first sets the width)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    bins: list[list[int]] = []
    used: list[int] = []
    for i in order:
        if lengths[i] > max_tokens:
            raise ValueError(
                f"a sample of {lengths[i]} tokens exceeds the micro-batch budget of {max_tokens}"
            )
        for b, members in enumerate(bins):
            cost = used[b] + lengths[i] if packed else (len(members) + 1) * lengths[members[0]]
            if cost <= max_tokens:
                members.append(i)
                used[b] = cost
                break
        else:
            bins.append([i])
            used.append(lengths[i])
    return bins


def split_to_count(bins: list[list[int]], count: int, lengths: list[int]) -> list[list[int]]:
    """Split the micro-batch with the most tokens in two (halves of its tokens, in order) until there
    are ``count``: another rank has more, and every rank must run the same number (FSDP collectives).
    Possible whenever there are at least ``count`` samples; every part stays within the budget."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        splittable = [b for b in bins if len(b) > 1]
        if not splittable:
            raise ValueError(f"{sum(map(len, bins))} samples cannot fill {count} micro-batches")
        big = max(splittable, key=lambda b: sum(lengths[i] for i in b))
        total, acc, cut = sum(lengths[i] for i in big), 0, 1
        for cut in range(1, len(big)):
            acc += lengths[big[cut - 1]]
            if 2 * acc >= total:
                break
        bins.remove(big)
        bins.extend([big[:cut], big[cut:]])
    return bins


def with_policy_gradient(samples: list[Sample], world_size: int) -> list[Sample]:
    """The samples that carry a policy gradient, i.e. a non-zero advantage, topped up with the
    shortest zero-advantage ones to a multiple of ``world_size`` (every rank takes the same number
    of micro-steps). A zero-advantage sample adds exactly zero to a loss that is linear in the
    advantage, so training on the result with the whole batch's token and sequence counts gives the
    same gradient as training on all of ``samples``. Empty when no sample has an advantage.
    """
    kept = [s for s in samples if s.advantage != 0]
    zero = sorted((s for s in samples if s.advantage == 0), key=lambda s: s.length)
    return kept + zero[: -len(kept) % world_size]


def shard_for_ranks(samples: list[Sample], world_size: int) -> list[list[int]]:
    """Indices per rank, balanced by token count, equal sample counts (FSDP needs equal step counts).

    When the samples form equal-sized groups with a shared prompt (GRPO) and the groups divide
    evenly over the ranks, whole groups go to one rank, so each prompt is computed once
    (:class:`PrefixBatch`). Units (groups, or single samples otherwise) are sorted by tokens and dealt
    in a snake order, so each rank gets a similar mix of long and short ones, and consecutive
    samples within a rank have similar lengths (less padding).
    """
    if len(samples) % world_size:
        raise ValueError(f"{len(samples)} samples do not split evenly over {world_size} ranks")
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(tuple(s.prompt_ids), []).append(i)
    units = list(groups.values())
    if len({len(u) for u in units}) != 1 or len(units) % world_size:
        units = [[i] for i in range(len(samples))]
    units = [sorted(u, key=lambda i: samples[i].length, reverse=True) for u in units]
    units.sort(key=lambda u: sum(samples[i].length for i in u), reverse=True)
    shards: list[list[int]] = [[] for _ in range(world_size)]
    for pos, unit in enumerate(units):
        lap, offset = divmod(pos, world_size)
        shards[offset if lap % 2 == 0 else world_size - 1 - offset].extend(unit)
    return shards
