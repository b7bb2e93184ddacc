"""GRPO math as pure functions, chosen by name.

Everything here takes tensors and returns tensors; nothing knows about Ray or FSDP, and only
:func:`check_loss_config` knows the config (the names of its keys). Seven registries map config names
to functions, and an unknown name lists the valid ones:

    ADVANTAGE_ESTIMATORS  group baselines           "mean", "leave_one_out"
    ADVANTAGE_STDS        advantage normalisers     "group", "leave_one_out"
    POLICY_LOSSES         per-token policy losses   "clipped"
    RATIO_LEVELS          log-ratio the loss clips  "token", "sequence" (GSPO)
    KL_ESTIMATORS         per-token KL estimates    "k1", "k2", "k3"
    LOSS_AGGREGATIONS     (B, T) loss -> scalar     "token-mean", "seq-mean-token-mean",
                                                    "seq-mean-token-sum-norm"
    IMPORTANCE_SAMPLING   behaviour-policy weights  "none", "tis", "mis", "seq_mis"

Shapes: B sequences (B = num_prompts * group_size, group-contiguous), T response tokens, V vocab.
``mask`` is 1 (or True) on response tokens and 0 on prompt/padding.

Three registries also take a user's own function as ``module:function`` (resolved as rewards are, by
:func:`trainer.config.import_function`): ``grpo.advantage.estimator``, ``grpo.loss.policy_loss`` and
``grpo.loss.kl_estimator``. :func:`check_algorithms` imports each at start, binds it to the built-in's
signature and tries it on a small batch, so one that breaks the contract its caller relies on (shapes, a
gradient, the loss's metrics) stops the run in one line before anything starts, instead of training on it.

Two flags are plain functions without a registry: ``clamp_kl`` (the KL penalty's per-token bound)
and ``overlong_penalty`` (DAPO's soft length penalty on rewards).

Where this departs from peers, and why:
- The std used to normalise advantages is by default the unbiased (Bessel, ``/(G-1)``) std over the
  whole group, whichever baseline is used, as verl, TRL and NeMo-RL with its mean baseline do.
  NeMo-RL with its leave-one-out baseline divides by the std of the other G-1 samples instead:
  that is the ``leave_one_out`` std here, chosen separately from the baseline. As in NeMo-RL, a
  sample whose G-1 others all scored the same (their std is 0) is not divided at all, rather than
  by eps: [1, 0, 0, 0] is an ordinary sparse-reward group, and 1 / eps would be a huge advantage.
- A group whose rewards are all equal gets exactly zero advantage in every mode. Peers rely on
  ``(r - mean) / (std + eps)`` being zero, which holds only up to rounding (the float mean of
  identical values need not equal them); a tiny non-zero numerator over eps is then a large
  advantage from a prompt that carries no signal.
- Log-ratios are clamped to +-LOG_RATIO_CLAMP before ``exp`` (in k3 and in the policy ratio) so a
  token whose probability collapsed cannot produce inf/NaN; verl clamps at the same magnitude.
- ``logprobs_from_logits`` with ``chunk_size`` uses its own autograd function so that neither the
  forward nor the backward holds a float32 (B, T, V) copy of the logits.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from trainer.config import ConfigError, GRPOConfig, LossConfig, check_name, import_function

# exp(20) ~ 4.9e8: finite in fp32 and bf16, and far outside any sane PPO clip range, so the clamp
# only ever touches tokens that the clip (or dual clip) already dominates.
LOG_RATIO_CLAMP = 20.0


def _lookup(kind: str, registry: dict[str, Callable], name: str, plugins: bool = False) -> Callable:
    """``name`` in ``registry``, or with ``plugins`` an importable ``module:function``; else a KeyError."""
    if name in registry:
        return registry[name]
    if plugins and ":" in name:
        return import_function(name, kind)
    plugin = ", or module:function" if plugins else ""
    raise KeyError(f"unknown {kind} {name!r}; valid: {', '.join(sorted(registry))}{plugin}")


def check_loss_config(loss: LossConfig) -> None:
    """Every name in ``grpo.loss`` against its registry: a ConfigError naming the key; a user's
    ``module:function`` imported and tried on a small batch (:func:`check_plugin`). The policy ranks
    look the functions up by name, so the driver calls this before it starts them."""
    check_plugin("grpo.loss.policy_loss", loss.policy_loss, "policy loss")
    check_plugin("grpo.loss.kl_estimator", loss.kl_estimator, "KL estimator")
    check_name("grpo.loss.aggregation", loss.aggregation, LOSS_AGGREGATIONS)
    check_name("grpo.loss.importance_sampling", loss.importance_sampling, IMPORTANCE_SAMPLING)
    check_name("grpo.loss.ratio_level", loss.ratio_level, RATIO_LEVELS)


def check_algorithms(grpo: GRPOConfig) -> None:
    """Every name of the GRPO math in ``grpo``: the loss's (:func:`check_loss_config`) and the advantage
    estimator's, each a ConfigError naming its key. The loop computes advantages by name on the driver at
    every step, so a run checks this before it starts anything."""
    check_loss_config(grpo.loss)
    check_plugin("grpo.advantage.estimator", grpo.advantage_estimator, "advantage estimator")


# ---------------------------------------------------------------------------------------------
# A user's module:function: its signature and contract, tried on a small batch
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Pluggable:
    """A registry that takes a user's ``module:function``: what it is called as, and its contract on a small
    batch (``inputs``: the call's args and kwargs; ``check``: None, or what is wrong with what it returned)."""

    registry: dict[str, Callable]
    signature: str
    inputs: Callable[[], tuple[tuple, dict]]
    check: Callable[[object, tuple], str | None]


def _shape(x: object) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, Tensor) else f"a {type(x).__name__}"


def _advantage_inputs() -> tuple[tuple, dict]:
    return (torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.5, 1.0, 0.0]]),), {}  # rewards (N=2, G=4)


def _check_baseline(out: object, args: tuple) -> str | None:
    if not isinstance(out, Tensor) or out.shape != args[0].shape:
        return f"returned {_shape(out)} for rewards of shape (2, 4); a baseline per reward is (N, G)"
    if not torch.isfinite(out).all():
        return "returned a non-finite baseline for finite rewards"
    return None


def _token_inputs() -> tuple[Tensor, Tensor]:
    """logprobs (B=2, T=3), with a gradient, and another policy's logprobs of the same tokens."""
    logprobs = torch.tensor([[-1.0, -0.5, -2.0], [-0.1, -3.0, -1.5]], requires_grad=True)
    return logprobs, torch.tensor([[-1.2, -0.4, -2.5], [-0.3, -2.0, -1.5]])


def _check_kl(out: object, args: tuple) -> str | None:
    # the penalty trains through the estimate: a detached one would be a penalty that changes nothing
    if not isinstance(out, Tensor) or out.shape != args[0].shape:
        return f"returned {_shape(out)} for logprobs of shape (2, 3); a KL estimate per token is (B, T)"
    if not torch.isfinite(out).all():
        return "returned a non-finite KL for finite logprobs"
    if not out.requires_grad:
        return "returned a KL with no gradient to logprobs (detached): the penalty would train nothing"
    return None


def _loss_inputs() -> tuple[tuple, dict]:
    """As :class:`trainer.algorithms.objective.Objective` calls a loss, with one advantage per sequence."""
    logprobs, old = _token_inputs()
    clips = {"ratio_clip_min": 0.2, "ratio_clip_max": 0.2, "ratio_clip_c": None}
    return (logprobs, old, torch.tensor([1.0, -1.0])), {**clips, "log_ratio": logprobs - old}


def _check_loss(out: object, args: tuple) -> str | None:
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
        return f"returned {_shape(out)}; a policy loss returns (loss (B, T), metrics dict)"
    loss, metrics = out
    if not isinstance(loss, Tensor) or loss.shape != args[0].shape:
        return f"returned a loss of {_shape(loss)} for logprobs of shape (2, 3); a loss per token is (B, T)"
    if not torch.isfinite(loss).all():
        return "returned a non-finite loss for finite logprobs"
    if not loss.requires_grad:
        return "returned a loss with no gradient to logprobs (detached): the policy would not train"
    for key in ("clipfrac", "ppo_kl"):  # what the objective reads of every loss's metrics
        value = metrics.get(key)
        if not isinstance(value, Tensor) or value.shape != args[0].shape:
            return f"returned metrics[{key!r}] of {_shape(value)}; the objective reads it per token, (B, T)"
    return None


def check_plugin(key: str, name: str, kind: str) -> None:
    """``name`` at ``key``: a name in the ``kind`` registry, or a ``module:function`` that imports, binds to
    the registry's signature and keeps its contract on a small batch; else a ConfigError naming ``key``."""
    plug = _PLUGGABLE[kind]
    if name in plug.registry:
        return
    if not isinstance(name, str) or ":" not in name:
        check_name(key, name, [*plug.registry, "module:function"])
    try:
        fn = import_function(name, kind)
    except KeyError as e:
        raise ConfigError(f"{key}: {e.args[0]}") from None
    args, kwargs = plug.inputs()
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as e:
        raise ConfigError(f"{key}={name}: cannot be called as {plug.signature}: {e}") from None
    except ValueError:  # no signature to read (a builtin): the call below says
        pass
    try:
        out = fn(*args, **kwargs)
    except Exception as e:  # the user's code, on a batch it must take: say what it raised
        raise ConfigError(f"{key}={name}: raised on a small batch: {type(e).__name__}: {e}") from None
    if (failure := plug.check(out, args)) is not None:
        raise ConfigError(f"{key}={name}: {failure}")


# ---------------------------------------------------------------------------------------------
# Masked reductions
# ---------------------------------------------------------------------------------------------


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` where ``mask`` is set. x, mask: same shape (e.g. (B, T)).

    Returns a scalar when ``dim`` is None, else ``x`` reduced over ``dim``.
    """
    mask = mask.to(x.dtype)
    # where() rather than x * mask alone: an inf/NaN in padding (e.g. a logprob of an ignored label)
    # would otherwise turn the whole sum into NaN, since inf * 0 = NaN.
    masked = torch.where(mask != 0, x * mask, torch.zeros_like(x))
    return masked.sum() if dim is None else masked.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over the positions where ``mask`` is set. x, mask: same shape.

    Returns a scalar when ``dim`` is None, else ``x`` reduced over ``dim``. An empty selection
    gives 0 rather than NaN.
    """
    den = mask.to(x.dtype).sum() if dim is None else mask.to(x.dtype).sum(dim)
    # Replace a zero denominator by 1 before dividing (its numerator is 0 too): a torch.where after
    # the division would still send NaN gradients through 0/0.
    safe_den = torch.where(den > 0, den, torch.ones_like(den))
    return masked_sum(x, mask, dim) / safe_den


# ---------------------------------------------------------------------------------------------
# Reward shaping
# ---------------------------------------------------------------------------------------------


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, penalty: float) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025), added to the rewards. lengths: (B,) -> (B,).

    0 up to max_len - buffer tokens, then linear down to -penalty at max_len:
    ((max_len - buffer) - length) / buffer * penalty. Longer than max_len (a multi-turn transcript
    counts all the model's turns) stays at -penalty, as the paper's -1 beyond L_max. buffer 0: all 0.
    """
    lengths = lengths if lengths.is_floating_point() else lengths.float()
    if buffer <= 0:
        return torch.zeros_like(lengths)
    over = lengths - (max_len - buffer)  # (B,) tokens into the buffer
    return (-over / buffer * penalty).clamp(min=-penalty, max=0.0)


# ---------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------


def group_mean_baseline(grouped: Tensor) -> Tensor:
    """GRPO baseline: the group's mean reward. grouped: (N, G) -> (N, G)."""
    return grouped.mean(dim=1, keepdim=True).expand_as(grouped)


def leave_one_out_baseline(grouped: Tensor) -> Tensor:
    """RLOO baseline: for sample i, the mean of the other G-1 rewards. grouped: (N, G) -> (N, G).

    Equivalent to scaling the mean-baseline advantage by G / (G - 1).
    """
    g = grouped.shape[1]
    return (grouped.sum(dim=1, keepdim=True) - grouped) / (g - 1)


ADVANTAGE_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {
    "mean": group_mean_baseline,
    "leave_one_out": leave_one_out_baseline,
}


def get_advantage_estimator(name: str) -> Callable[[Tensor], Tensor]:
    """The baseline function ``(N, G) -> (N, G)`` registered as ``name``, or a user's ``module:function``."""
    return _lookup("advantage estimator", ADVANTAGE_ESTIMATORS, name, plugins=True)


def group_std(grouped: Tensor) -> Tensor:
    """Unbiased (Bessel) std of each whole group, the same for all its samples. (N, G) -> (N, G)."""
    return grouped.std(dim=1, keepdim=True, unbiased=True).expand_as(grouped)


def leave_one_out_std(grouped: Tensor) -> Tensor:
    """For sample i, the unbiased std of the other G-1 rewards of its group (NeMo-RL's std with its
    leave-one-out baseline). (N, G) -> (N, G); needs G >= 3 (one other sample has no std).

    Exactly 0 where the G-1 others are all equal, so the caller can tell "no spread" from a small
    one: their float std can otherwise be an ulp-sized residue (see ``compute_advantages``).
    """
    n, g = grouped.shape
    if g < 3:
        raise ValueError(f"a leave-one-out std needs group_size >= 3 (two others at least), got {g}")
    keep = ~torch.eye(g, dtype=torch.bool, device=grouped.device)  # (G, G): row i leaves out i
    others = grouped[:, None, :].expand(n, g, g)[:, keep].view(n, g, g - 1)  # (N, G, G-1)
    std = others.std(dim=-1, unbiased=True)  # (N, G)
    constant = (others == others[..., :1]).all(dim=-1)  # (N, G)
    return torch.where(constant, torch.zeros_like(std), std)


ADVANTAGE_STDS: dict[str, Callable[[Tensor], Tensor]] = {
    "group": group_std,
    "leave_one_out": leave_one_out_std,
}


def get_advantage_std(name: str) -> Callable[[Tensor], Tensor]:
    """The std function ``(N, G) -> (N, G)`` registered as ``name``."""
    return _lookup("advantage std", ADVANTAGE_STDS, name)


# The spread (max - min) under which a group's rewards count as equal, relative to their scale (floored at 1):
# float32 rounding of one score across batch shapes is ~1e-7 relative (3e-8 measured at 0.4); any reward that
# means a difference differs by far more (a partial credit of 1 in 100 is 1e-2).
FLAT_GROUP_RTOL = 1e-5


def compute_advantages(
    rewards: Tensor,
    group_size: int,
    *,
    estimator: str = "mean",
    normalize_std: bool = True,
    std: str = "group",
    eps: float = 1e-6,
    flat: float = FLAT_GROUP_RTOL,
) -> Tensor:
    """Group-relative advantages. rewards: (B,) -> (B,), float32 (or rewards' float dtype).

    Rows ``[i*G:(i+1)*G]`` are the G samples of prompt i. advantage = reward - baseline, where the
    baseline comes from ``estimator``; with ``normalize_std`` it is then divided by (s + eps), where
    s is each sample's std from ``std`` ("group": the whole group's; "leave_one_out": the other
    G-1 samples'). A sample whose s is exactly 0 is not divided (only possible with leave_one_out
    in a group that is not constant). A flat group gets exactly 0: its rewards spread (max - min) no more than
    ``flat`` x max(1, the largest |reward|), rounding and not signal (:data:`FLAT_GROUP_RTOL`).

    Raises ValueError if rewards is not 1-D, group_size < 2 (< 3 for the leave_one_out std), or
    B is not a multiple of group_size.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (B,), got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 for a group baseline, got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(f"batch of {rewards.numel()} rewards is not a multiple of group_size={group_size}")
    baseline_fn = get_advantage_estimator(estimator)
    std_fn = get_advantage_std(std)

    r = rewards if rewards.is_floating_point() else rewards.float()
    grouped = r.view(-1, group_size)  # (N, G)
    adv = grouped - baseline_fn(grouped)
    if normalize_std:
        s = std_fn(grouped)  # (N, G)
        # A zero std of a non-constant group can only be a leave-one-out std (the others agree):
        # the advantage then keeps its reward scale, as NeMo-RL does, instead of being multiplied
        # by 1 / eps. For the group std this is the division it always was.
        adv = torch.where(s > 0, adv / (s + eps), adv)
    # A flat group has no signal: its float mean can differ from the rewards by an ulp, and rewards that differ
    # by rounding alone (a reward model's float32 scores of the same answer in two batches: 3e-8 at 0.4) would,
    # divided by their near-zero std, be advantages of +-1. Relative to the rewards' scale, floored at 1.
    spread = grouped.max(dim=1, keepdim=True).values - grouped.min(dim=1, keepdim=True).values
    scale = grouped.abs().max(dim=1, keepdim=True).values.clamp(min=1.0)
    constant = spread <= flat * scale
    adv = torch.where(constant, torch.zeros_like(adv), adv)
    return adv.reshape(-1)


# ---------------------------------------------------------------------------------------------
# KL estimators (Schulman, "Approximating KL Divergence", 2020), estimating KL(pi || pi_ref) from
# tokens sampled from pi. logprobs, ref_logprobs: (B, T) -> (B, T).
# ---------------------------------------------------------------------------------------------


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = log pi - log pi_ref. Unbiased, high variance, can be negative. (B, T) -> (B, T)."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = 0.5 * (log pi - log pi_ref)^2. Biased, low variance, >= 0. (B, T) -> (B, T)."""
    return 0.5 * (logprobs - ref_logprobs).square()


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 = exp(d) - d - 1 with d = log pi_ref - log pi. Unbiased, low variance, >= 0. (B, T) -> (B, T).

    d is clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] so a collapsed token gives a large finite
    value instead of inf.
    """
    d = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    # expm1(d) - d rather than exp(d) - d - 1: for small d, exp(d) - 1 cancels catastrophically and
    # can round below d; expm1 is accurate and, rounded to nearest, never below d, so k3 >= 0 holds.
    return torch.expm1(d) - d


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def get_kl_estimator(name: str) -> Callable[[Tensor, Tensor], Tensor]:
    """The KL estimator ``(logprobs (B,T), ref_logprobs (B,T)) -> (B,T)`` registered as ``name``, or a
    user's ``module:function``."""
    return _lookup("KL estimator", KL_ESTIMATORS, name, plugins=True)


def clamp_kl(kl: Tensor, bound: float | None) -> Tensor:
    """The per-token KL estimate clamped to [-bound, bound]; None leaves it. (B, T) -> (B, T).

    verl (``kl_penalty``) and NeMo-RL (``calculate_kl``) clamp at 10: LOG_RATIO_CLAMP keeps k3
    finite, but one token 5 nats from the reference still gives k3 = e^5 - 6 ~ 142 and dominates
    the penalty. A clamped token has no KL gradient, like a clipped token in the policy loss.
    """
    return kl if bound is None else kl.clamp(-bound, bound)


# ---------------------------------------------------------------------------------------------
# Policy loss
# ---------------------------------------------------------------------------------------------


def clipped_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    *,
    ratio_clip_min: float,
    ratio_clip_max: float,
    ratio_clip_c: float | None = None,
    log_ratio: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate per token, with optional dual clip.

    logprobs, old_logprobs: (B, T); advantages: (B,) (one per sequence) or (B, T).
    ratio = exp(logprobs - old_logprobs);
    loss = max(-A * ratio, -A * clip(ratio, 1 - ratio_clip_min, 1 + ratio_clip_max)).
    With ``ratio_clip_c`` (> 1; Ye et al. 2020, dual-clip PPO), tokens with A < 0 are further capped
    at c * |A|. Clip values are validated by the config, not here.
    ``log_ratio`` (B, T), when given, replaces logprobs - old_logprobs as the log of the ratio
    (from a ``RATIO_LEVELS`` function, e.g. GSPO's sequence ratio); ``ppo_kl`` stays per token.

    Returns ``(loss (B, T), metrics)``; metrics are detached (B, T) tensors:
      ``clipfrac``       1.0 where the clipped branch set the loss (its gradient is then zero)
      ``dual_clipfrac``  1.0 where the dual-clip cap set the loss (always 0 without ratio_clip_c)
      ``ppo_kl``         old_logprobs - logprobs (k1 estimate of KL(old || new))
      ``ratio``          the importance ratio
    Reduce them with ``masked_mean`` over the response mask.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)  # (B,) -> (B, 1), broadcast over tokens
    if log_ratio is None:
        log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - ratio_clip_min, 1.0 + ratio_clip_max)
    # where() rather than torch.maximum: on a tie maximum splits the gradient between the branches;
    # here a tie keeps the unclipped (live) gradient and only a strictly larger clipped term wins.
    is_clipped = clipped > unclipped
    loss = torch.where(is_clipped, clipped, unclipped)

    is_dual = torch.zeros_like(is_clipped)
    if ratio_clip_c is not None:
        # -A * c is positive only for A < 0: it caps the loss of a bad token whose ratio exploded
        # (the max above is then unbounded, as -A * ratio grows with ratio). A > 0 is left alone.
        cap = -advantages * ratio_clip_c
        is_dual = (advantages < 0) & (loss > cap)
        loss = torch.where(is_dual, cap.expand_as(loss), loss)

    metrics = {
        "clipfrac": is_clipped.to(logprobs.dtype),
        "dual_clipfrac": is_dual.to(logprobs.dtype),
        "ppo_kl": (old_logprobs - logprobs).detach(),
        "ratio": ratio.detach(),
    }
    return loss, metrics


POLICY_LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {"clipped": clipped_policy_loss}


def get_policy_loss(name: str) -> Callable[..., tuple[Tensor, dict[str, Tensor]]]:
    """The policy loss registered as ``name``, or a user's ``module:function``; see
    :func:`clipped_policy_loss` for the signature."""
    return _lookup("policy loss", POLICY_LOSSES, name, plugins=True)


# ---------------------------------------------------------------------------------------------
# Ratio level: the log importance ratio the policy loss clips. (logprobs (B, T), old_logprobs
# (B, T), mask (B, T)) -> log_ratio (B, T), with the gradient of the surrogate it stands for.
# ---------------------------------------------------------------------------------------------


def token_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """PPO/GRPO: each token's own log pi - log pi_old. The mask is not needed. (B, T) -> (B, T)."""
    return logprobs - old_logprobs


def sequence_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """GSPO (Zheng et al. 2025), in its GSPO-token form. (B, T) -> (B, T).

    s_i = exp(mean over the response tokens of log pi - log pi_old), the length-normalised
    sequence ratio; every token t of sequence i gets the ratio sg[s_i] * exp(lp_t - sg[lp_t]).
    Its value is s_i, so the clip decides per sequence (one decision for all its tokens), and its
    gradient is s_i * grad lp_t, so with per-token advantages equal to A_i and seq-mean-token-mean
    the gradient is GSPO's: s_i * A_i * mean_t grad lp_t. Padding (mask 0) gets log s_i and no
    gradient, so a non-finite logprob there cannot reach the backward.

    GSPO's ratios live near 1 (the mean shrinks the per-token noise): the paper clips at
    ratio_clip_min=3e-4, ratio_clip_max=4e-4, not PPO's 0.2.
    """
    seq = masked_mean(logprobs.detach() - old_logprobs.detach(), mask, dim=-1)  # (B,) log sg[s_i]
    live = torch.where(
        mask != 0, logprobs - logprobs.detach(), torch.zeros_like(logprobs)
    )  # (B, T): 0, with grad
    return seq[:, None] + live


RATIO_LEVELS: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "token": token_log_ratio,
    "sequence": sequence_log_ratio,
}


def get_ratio_level(name: str) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """``(logprobs (B,T), old_logprobs (B,T), mask (B,T)) -> log_ratio (B,T)`` registered as ``name``."""
    return _lookup("ratio level", RATIO_LEVELS, name)


# ---------------------------------------------------------------------------------------------
# Importance sampling against the behaviour policy: the engine that sampled the tokens.
#
# The generation engine (vLLM's kernels and sampler, a bf16 copy, or weights some steps old) never
# assigns exactly the probabilities the FSDP policy does, so the samples are slightly off-policy.
# Each function turns the proximal policy's logprobs ``old`` (B, T) and the engine's ``behaviour``
# logprobs (B, T) into detached per-token weights (B, T) that multiply the policy loss, and a (B, T)
# indicator of the tokens it truncated or masked (its masked mean is the metric). Ratios are pi_old / pi_behaviour, as in verl's rollout
# correction and Yao et al. 2025 ("Your efficient RL framework secretly brings you off-policy RL").
# ---------------------------------------------------------------------------------------------


def _behaviour_log_ratio(old: Tensor, behaviour: Tensor) -> Tensor:
    return (old - behaviour).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def no_importance_weights(old: Tensor, behaviour: Tensor, mask: Tensor, **_: float) -> tuple[Tensor, Tensor]:
    """Weights 1: train as if the engine had sampled from the policy itself."""
    return torch.ones_like(old), torch.zeros_like(old)


def truncated_importance_weights(
    old: Tensor, behaviour: Tensor, mask: Tensor, *, tis_cap: float = 2.0, **_: float
) -> tuple[Tensor, Tensor]:
    """TIS: per-token ratio, truncated from above at ``tis_cap``; returns (weights, truncated)."""
    ratio = torch.exp(_behaviour_log_ratio(old, behaviour)).detach()
    return ratio.clamp(max=tis_cap), (ratio > tis_cap).to(old.dtype)


def masked_importance_weights(
    old: Tensor, behaviour: Tensor, mask: Tensor, *, mis_low: float = 0.5, mis_high: float = 2.0, **_: float
) -> tuple[Tensor, Tensor]:
    """MIS: per-token ratio where it lies in ``[mis_low, mis_high]``, 0 (token dropped) elsewhere."""
    ratio = torch.exp(_behaviour_log_ratio(old, behaviour)).detach()
    keep = ((ratio >= mis_low) & (ratio <= mis_high)).to(old.dtype)
    return ratio * keep, 1.0 - keep


def sequence_masked_importance_weights(
    old: Tensor, behaviour: Tensor, mask: Tensor, *, mis_low: float = 0.5, mis_high: float = 2.0, **_: float
) -> tuple[Tensor, Tensor]:
    """Sequence MIS: each token keeps its own ratio, but a whole sequence is dropped when the
    geometric mean of its ratios, exp(mean log-ratio), leaves ``[mis_low, mis_high]``; returns the
    weights and the tokens of dropped sequences."""
    log_ratio = _behaviour_log_ratio(old, behaviour).detach()
    seq = torch.exp(masked_mean(log_ratio, mask, dim=-1))  # (B,) geometric mean per sequence
    keep = ((seq >= mis_low) & (seq <= mis_high)).to(old.dtype)[:, None]  # (B, 1)
    return torch.exp(log_ratio) * keep, (1.0 - keep).expand_as(old)


IMPORTANCE_SAMPLING: dict[str, Callable[..., tuple[Tensor, Tensor]]] = {
    "none": no_importance_weights,
    "tis": truncated_importance_weights,
    "mis": masked_importance_weights,
    "seq_mis": sequence_masked_importance_weights,
}


def get_importance_sampling(name: str) -> Callable[..., tuple[Tensor, Tensor]]:
    """``(old (B,T), behaviour (B,T), mask (B,T), **thresholds) -> (weights (B,T), flagged (B,T))``."""
    return _lookup("importance sampling", IMPORTANCE_SAMPLING, name)


# ---------------------------------------------------------------------------------------------
# Loss aggregation: (B, T) per-token loss -> scalar.
#
# All three take the same keywords so the caller can pass every global count and let the mode pick.
# Under data parallelism each rank passes its LOCAL loss and mask with the GLOBAL counts (tokens,
# sequences, max_len across all ranks); the ranks' results then sum (all-reduce SUM of gradients)
# to the single-process result on the concatenated batch. The defaults are the local counts, right
# for one process only.
# ---------------------------------------------------------------------------------------------


def token_mean(
    loss: Tensor,
    mask: Tensor,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_len: int | None = None,
) -> Tensor:
    """sum(loss * mask) / num_tokens (default: mask.sum()). Every token weighs the same (DAPO).

    loss, mask: (B, T) -> scalar. num_seqs and max_len are ignored.
    """
    if num_tokens is None:
        # max(., 1): a batch with no response tokens has numerator 0 and should give 0, not NaN.
        return masked_sum(loss, mask) / mask.to(loss.dtype).sum().clamp(min=1.0)
    return masked_sum(loss, mask) / num_tokens


def seq_mean_token_mean(
    loss: Tensor,
    mask: Tensor,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_len: int | None = None,
) -> Tensor:
    """Token-mean within each sequence, then sum over sequences / num_seqs (default B).

    The original GRPO objective: every sequence weighs the same, so tokens of long responses weigh
    less. A sequence with no response tokens contributes 0. loss, mask: (B, T) -> scalar.
    """
    per_seq = masked_mean(loss, mask, dim=-1)  # (B,)
    return per_seq.sum() / (loss.shape[0] if num_seqs is None else num_seqs)


def seq_mean_token_sum_norm(
    loss: Tensor,
    mask: Tensor,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_len: int | None = None,
) -> Tensor:
    """Dr. GRPO: per-sequence token SUM / max_len (a constant; default T), then sum / num_seqs.

    Dividing by a constant instead of each sequence's length removes GRPO's length bias. Under
    data parallelism pass the same max_len on every rank (e.g. the generation max_tokens), as the
    local T differs with padding. loss, mask: (B, T) -> scalar.
    """
    per_seq = masked_sum(loss, mask, dim=-1) / (loss.shape[-1] if max_len is None else max_len)  # (B,)
    return per_seq.sum() / (loss.shape[0] if num_seqs is None else num_seqs)


LOSS_AGGREGATIONS: dict[str, Callable[..., Tensor]] = {
    "token-mean": token_mean,
    "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum-norm": seq_mean_token_sum_norm,
}


def get_loss_aggregation(name: str) -> Callable[..., Tensor]:
    """The aggregation ``(loss (B,T), mask (B,T), *, num_tokens, num_seqs, max_len) -> scalar``."""
    return _lookup("loss aggregation", LOSS_AGGREGATIONS, name)


def aggregate_loss(
    loss: Tensor,
    mask: Tensor,
    mode: str,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_len: int | None = None,
) -> Tensor:
    """Reduce a per-token loss (B, T) under mask (B, T) to a scalar with the aggregation ``mode``.

    Pass the global counts under data parallelism (see the section comment above).
    """
    fn = get_loss_aggregation(mode)
    return fn(loss, mask, num_tokens=num_tokens, num_seqs=num_seqs, max_len=max_len)


# ---------------------------------------------------------------------------------------------
# Token utilities
# ---------------------------------------------------------------------------------------------


def _math_dtype(logits: Tensor) -> torch.dtype:
    """float32 for bf16/fp16/fp32 logits (half-precision log-softmax loses ~2 digits), float64 kept."""
    return torch.promote_types(logits.dtype, torch.float32)


class _ChunkedLogprobs(torch.autograd.Function):
    """log_softmax(logits * scale)[label] over (N, V) rows, chunk by chunk, in at least float32,
    and optionally each row's entropy from the same pass (no gradient).

    Plain autograd would save each chunk's upcast copy for the backward, i.e. a full (N, V)
    float32 copy again. This keeps only the logits (already held by the graph) and the (N,)
    log-normalisers, and recomputes softmax per chunk in the backward. With small chunks the
    float32 working set stays in cache, so on a CPU this is also faster than one pass over the whole
    block (the figure: bench/README.md, "Figures behind choices in the math, the cluster and the heap").
    """

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, chunk_size: int, scale: float, with_entropy: bool):
        dtype = _math_dtype(logits)  # (N, V), (N,) -> (N,), (N,) or (0,)
        out = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)
        lse = torch.empty_like(out)
        entropy = torch.empty_like(out) if with_entropy else out.new_empty(0)
        for s in range(0, logits.shape[0], chunk_size):
            rows = slice(s, s + chunk_size)
            chunk = logits[rows].to(dtype)  # (n, V): the only upcast copy alive (the logits if float32)
            if scale != 1.0:
                chunk = chunk * scale
            lse[rows] = torch.logsumexp(chunk, dim=-1)
            out[rows] = chunk.gather(-1, labels[rows, None]).squeeze(-1) - lse[rows]
            if with_entropy:  # H = lse - sum(softmax * x); p == 0 where x == -inf, and 0 * -inf is NaN
                p = torch.exp(chunk - lse[rows, None])
                entropy[rows] = lse[rows] - torch.where(p > 0, p * chunk, 0.0).sum(-1)
        ctx.save_for_backward(logits, labels, lse)
        ctx.chunk_size, ctx.scale = chunk_size, scale
        ctx.mark_non_differentiable(entropy)
        return out, entropy

    @staticmethod
    def backward(ctx, grad_out: Tensor, _grad_entropy: Tensor):  # (N,) -> (N, V)
        logits, labels, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], ctx.chunk_size):
            rows = slice(s, s + ctx.chunk_size)
            g = grad_out[rows, None].to(lse.dtype) * ctx.scale  # (n, 1)
            x = logits[rows].to(lse.dtype)  # never modified: it is the saved logits when they are float32
            if ctx.scale != 1.0:
                x = x * ctx.scale
            softmax = torch.exp(x - lse[rows, None])  # (n, V), a new tensor
            # d(s x[y] - lse(s x))/dx = s (onehot(y) - softmax(s x))
            grad[rows] = (softmax.mul_(-g)).scatter_add_(-1, labels[rows, None], g).to(grad.dtype)
        return grad, None, None, None, None


def logit_chunk_rows(vocab: int, device: torch.device) -> int:
    """Rows per chunk for the chunked logprobs: about 2 MiB of float32 on a CPU, so that a chunk is
    still in cache when it is read again; 256 MiB on an accelerator, for few kernel launches."""
    budget = 2**19 if device.type == "cpu" else 2**26
    return max(1, budget // vocab)


def logprobs_from_logits(logits: Tensor, labels: Tensor, *, chunk_size: int | None = None) -> Tensor:
    """Log-probability of each label under the logits. logits: (B, T, V), labels: (B, T) -> (B, T).

    Math and result are float32 for bf16/fp16/fp32 logits (float64 stays float64). Labels must be
    valid token ids in [0, V); put any id (e.g. 0) at padding and mask the result.
    ``chunk_size`` (positions per chunk, over the flattened B*T) bounds the float32 working set to
    chunk_size * V in both forward and backward; None computes all positions at once. Chunking
    flattens (B, T) with reshape, which copies non-contiguous logits (e.g. ``logits[:, :-1]``) once
    in their own dtype; slice the labels instead, or make the model return only response positions.
    """
    labels = labels.long()  # gather wants int64 ids
    if chunk_size is None:
        x = logits.to(_math_dtype(logits))
        return x.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, dim=-1)
    return logprobs_and_entropy(logits, labels, chunk_size=chunk_size)[0]


def logprobs_and_entropy(
    logits: Tensor,
    labels: Tensor,
    *,
    chunk_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Logprobs of ``labels`` (B, T) under ``logits / temperature`` (B, T, V), with a gradient, and
    with ``with_entropy`` the (B, T) entropies of the same distributions (no gradient), both from
    one chunked pass over the logits (see ``logprobs_from_logits`` for ``chunk_size``). The logits
    keep their dtype; nothing of size (B, T, V) is made in float32."""
    flat, entropy = _ChunkedLogprobs.apply(
        logits.reshape(-1, logits.shape[-1]),
        labels.long().reshape(-1),
        chunk_size,
        1.0 / temperature,
        with_entropy,
    )
    return flat.view(labels.shape), entropy.view(labels.shape) if with_entropy else None


def entropy_from_logits(logits: Tensor, *, chunk_size: int | None = None) -> Tensor:
    """Entropy of the softmax over the last dim, in float32 (or float64). logits: (B, T, V) -> (B, T).

    H = logsumexp(x) - sum(softmax(x) * x). ``chunk_size`` (positions per chunk) bounds the float32
    working set; it is a plain autograd loop, meant for metrics under no_grad.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    chunks = flat.split(chunk_size) if chunk_size is not None else (flat,)
    parts = []
    for chunk in chunks:
        x = chunk.to(_math_dtype(chunk))
        p = torch.softmax(x, dim=-1)
        # p == 0 where x == -inf (masked vocabulary); 0 * -inf would be NaN, the limit is 0.
        parts.append(torch.logsumexp(x, dim=-1) - torch.where(p > 0, p * x, torch.zeros_like(x)).sum(-1))
    return torch.cat(parts).view(logits.shape[:-1])


# The registries that take a user's module:function (check_plugin), by the kind their messages name.
_PLUGGABLE = {
    "advantage estimator": _Pluggable(
        ADVANTAGE_ESTIMATORS,
        "an advantage estimator fn(rewards (N, G)) -> baselines (N, G)",
        _advantage_inputs,
        _check_baseline,
    ),
    "KL estimator": _Pluggable(
        KL_ESTIMATORS,
        "a KL estimator fn(logprobs (B, T), ref_logprobs (B, T)) -> (B, T)",
        lambda: (_token_inputs(), {}),
        _check_kl,
    ),
    "policy loss": _Pluggable(
        POLICY_LOSSES,
        "a policy loss fn(logprobs, old_logprobs, advantages, *, ratio_clip_min, ratio_clip_max, ratio_clip_c, "
        "log_ratio) -> (loss (B, T), metrics)",
        _loss_inputs,
        _check_loss,
    ),
}
