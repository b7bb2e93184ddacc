"""The whole GRPO objective of one micro-batch, as one function of tensors: what the policy worker minimises.

    loss_tok = pg(ratio, A) * w_IS  +  beta * clamp(KL(pi || pi_ref))          (B, T)
    loss     = aggregate(loss_tok, mask; global token, sequence and length counts)

- ``pg``: the clipped surrogate (``grpo.loss.policy_loss``: PPO's clip, dual clip with ``ratio_clip_c``)
  of the ratio pi / pi_old, per token or, with ``ratio_level=sequence``, GSPO's length-normalised ratio
  of each response;
- ``w_IS``: the correction for the engine's sampling distribution (``importance_sampling``: tis, mis,
  seq_mis) from pi_old / pi_engine; it weights the policy-gradient term only, as verl, NeMo-RL and TRL do;
- the KL penalty (``kl_estimator``: k1, k2, k3) against the reference policy, clamped at ``kl_clamp``;
- ``aggregate``: token-mean, seq-mean-token-mean or seq-mean-token-sum-norm over the global counts, so
  that under data parallelism the ranks' losses sum to the single-process loss of the whole batch.

The whole loss contract is here: the global counts a mini-batch's loss divides by (:func:`global_counts`,
taken by the driver over all of the mini-batch's samples), the reduction of a micro-batch's per-token
losses to the scalar that is backpropagated (:meth:`Objective.reduce`: its share of the mini-batch's
loss, scaled by the ranks FSDP averages gradients over), and the denominators of the step's metrics
(:meth:`Objective.metrics`). Every option is chosen by name in :class:`Objective` (from
:mod:`~trainer.algorithms.core_algos`'s registries); the worker keeps micro-batching, the forward, the
backward and the optimizer (:meth:`trainer.policy.worker.PolicyWorker.train`). Beside the loss come the
metrics of the step as sums over masked tokens (the worker adds them up over micro-batches and ranks, then
:meth:`Objective.metrics` divides): the loss, how far the engine that sampled is from the policy, what the
correction truncated or dropped, the KL as penalised, the clip fraction and PPO's KL.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from trainer.algorithms import core_algos
from trainer.config import LossConfig


@dataclass
class LossInputs:
    """One micro-batch's tensors, (B, T) over response positions unless said otherwise.

    ``old_logprobs`` None: on-policy (the policy's own logprobs, detached: the ratio is exactly 1 with its
    gradient). ``behaviour_logprobs``: the engine's, None when unknown (no gap metrics, no correction).
    ``ref_logprobs``: the reference policy's, needed when the objective has a KL penalty. ``advantages``:
    (B,) or (B, T). ``num_tokens`` and ``num_seqs``: the mini-batch's counts over all ranks."""

    logprobs: Tensor
    advantages: Tensor
    mask: Tensor
    num_tokens: float
    num_seqs: float
    old_logprobs: Tensor | None = None
    behaviour_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None


def global_counts(response_masks: Iterable[Sequence[int]]) -> dict[str, float]:
    """What a mini-batch's loss divides by, over all of its samples (skipped ones included, so the loss stays
    the whole mini-batch's mean): ``tokens``, the response tokens that carry loss, and ``seqs``, the samples.
    ``response_masks``: each sample's (L_i,) loss mask."""
    masks = list(response_masks)
    return {"tokens": float(sum(sum(m) for m in masks)), "seqs": float(len(masks))}


# The metric sums every call returns, whatever the options (the same keys on every rank and step).
METRIC_SUMS = (
    "loss",
    "pg_clipfrac",
    "ppo_kl",
    "tokens",
    "gen_logprob_abs_diff",
    "gen_train_kl",
    "is_flagged",
    "gen_tokens",
)


@dataclass
class Objective:
    """``grpo.loss`` turned into functions once; call it on each micro-batch's :class:`LossInputs`."""

    loss: LossConfig
    max_len: int  # generation.max_new_tokens: seq-mean-token-sum-norm's constant length
    kl_penalty: bool  # a reference policy is there (the penalty's beta > 0)
    # The ranks FSDP averages gradients over (all policy ranks; with sequence parallelism too, as each rank
    # of a group computes a disjoint part of its forward, so the group's gradient is its ranks' sum).
    ranks: int = 1

    def __post_init__(self):
        self.policy_loss = core_algos.get_policy_loss(self.loss.policy_loss)
        self.log_ratio = core_algos.get_ratio_level(self.loss.ratio_level)
        self.kl = core_algos.get_kl_estimator(self.loss.kl_estimator) if self.kl_penalty else None
        self.correction = core_algos.get_importance_sampling(self.loss.importance_sampling or "none")
        self.thresholds = {
            "tis_cap": self.loss.tis_cap,
            "mis_low": self.loss.mis_low,
            "mis_high": self.loss.mis_high,
        }

    def metric_keys(self) -> tuple[str, ...]:
        return METRIC_SUMS + (("kl",) if self.kl is not None else ())

    def reduce(
        self, loss_tok: Tensor, mask: Tensor, num_tokens: float, num_seqs: float
    ) -> tuple[Tensor, Tensor]:
        """(B, T) per-token losses under mask (B, T) -> (the scalar to backpropagate, the micro-batch's share of
        the mini-batch's loss). The share aggregates over the mini-batch's global counts, so the shares of
        all micro-batches on all ranks sum to the mini-batch's loss (core_algos' aggregation registry). FSDP
        averages gradients over the ranks, a division by their number that the backward scalar undoes."""
        share = core_algos.aggregate_loss(
            loss_tok,
            mask,
            self.loss.aggregation,
            # A mini-batch whose every loss mask is empty sums to 0: over 0 tokens its loss, and with it every
            # gradient, was NaN (0/0), and the optimizer wrote NaN into the weights; over 1 it is 0, exactly.
            num_tokens=max(num_tokens, 1.0),
            num_seqs=num_seqs,
            max_len=self.max_len,
        )
        return share * self.ranks, share.detach()

    def metrics(self, sums: dict[str, float], steps: int) -> dict[str, float]:
        """The step's metrics from the sums over every micro-batch and rank of ``steps`` optimizer steps
        (:meth:`metric_keys`, the worker's ``grad_norm`` once per step and rank, and its ``entropy``): the
        loss per step, the gradient norm per step and rank, the engine's gap and corrections per token it
        sampled, everything else per token trained on. A step that trained on no engine-sampled token (every
        group skipped, or no engine logprobs) measured no gap: those three keys are absent, not 0. A step that
        trained on no token at all (every group flat and skipped, every loss mask empty) measured no mean over
        tokens either: the clip fraction, PPO's KL, the penalised KL and the entropy are absent too, so that no
        tracker draws a 0.0 nothing measured; the loss (0: nothing to minimise) and the gradient norm (of the
        zero gradient applied) stay."""
        totals = dict(sums)
        tokens = totals.pop("tokens")
        gen_tokens = totals.pop("gen_tokens")
        out = {
            "loss": totals.pop("loss") / steps,
            "grad_norm": totals.pop("grad_norm") / (steps * self.ranks),
        }
        for key in ("gen_logprob_abs_diff", "gen_train_kl", "is_flagged"):
            value = totals.pop(key)
            if gen_tokens > 0:
                out[key] = value / gen_tokens
        if tokens > 0:
            out.update({k: v / tokens for k, v in totals.items()})
        return out

    def __call__(self, x: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
        """The micro-batch's scalar to backpropagate (:meth:`reduce`) and the metric sums over its masked
        tokens, its share of the mini-batch's loss among them (:meth:`metric_keys`; 0-dim tensors, detached)."""
        mask, logprobs = x.mask, x.logprobs
        zero = logprobs.new_zeros(())
        sums = dict.fromkeys(self.metric_keys(), zero)
        old = x.old_logprobs if x.old_logprobs is not None else logprobs.detach()
        weights = None
        if x.behaviour_logprobs is not None:
            behaviour = x.behaviour_logprobs
            gap = old.detach() - behaviour  # log pi_policy - log pi_engine on the sampled tokens
            sums["gen_logprob_abs_diff"] = (gap.abs() * mask).sum()
            sums["gen_train_kl"] = (
                core_algos.kl_k3(behaviour, old.detach()) * mask
            ).sum()  # KL(engine || policy)
            sums["gen_tokens"] = mask.sum()
            if self.loss.importance_sampling not in (None, "none"):
                weights, flagged = self.correction(old.detach(), behaviour, mask, **self.thresholds)
                sums["is_flagged"] = (flagged * mask).sum()
        loss_tok, parts = self.policy_loss(
            logprobs,
            old,
            x.advantages,
            ratio_clip_min=self.loss.ratio_clip_min,
            ratio_clip_max=self.loss.ratio_clip_max,
            ratio_clip_c=self.loss.ratio_clip_c,
            # token: logprobs - old; sequence (GSPO): the mean over each response's loss-mask tokens, so
            # padding and environment turns do not count.
            log_ratio=self.log_ratio(logprobs, old, mask),
        )
        if weights is not None:
            loss_tok = loss_tok * weights  # the policy-gradient term only, as the peers weight it
        if self.kl is not None:
            if x.ref_logprobs is None:
                raise ValueError(
                    "the objective has a KL penalty but the micro-batch has no reference logprobs"
                )
            kl = core_algos.clamp_kl(self.kl(logprobs, x.ref_logprobs), self.loss.kl_clamp)
            loss_tok = loss_tok + self.loss.reference_policy_kl_penalty * kl
            sums["kl"] = (kl.detach() * mask).sum()  # as the penalty saw it: clamped
        loss, sums["loss"] = self.reduce(loss_tok, mask, x.num_tokens, x.num_seqs)
        sums["pg_clipfrac"] = (parts["clipfrac"].float() * mask).sum()
        sums["ppo_kl"] = (parts["ppo_kl"].detach() * mask).sum()
        sums["tokens"] = mask.sum()
        return loss, {k: torch.as_tensor(v).detach() for k, v in sums.items()}
