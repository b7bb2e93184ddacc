"""Oracles for the GRPO math: expected numbers are written out by hand, not recomputed with the
formula under test; property tests cover what a hand example cannot (data-parallel sums, gradients).
"""

from __future__ import annotations

import math

import pytest
import torch

from trainer.algorithms import core_algos as ca
from trainer.algorithms.core_algos import (
    aggregate_loss,
    clipped_policy_loss,
    compute_advantages,
    entropy_from_logits,
    kl_k1,
    kl_k2,
    kl_k3,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
)


def t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


# --------------------------------------------------------------------------- registries


@pytest.mark.parametrize(
    ("getter", "registry", "kind"),
    [
        (ca.get_advantage_estimator, ca.ADVANTAGE_ESTIMATORS, "advantage estimator"),
        (ca.get_advantage_std, ca.ADVANTAGE_STDS, "advantage std"),
        (ca.get_policy_loss, ca.POLICY_LOSSES, "policy loss"),
        (ca.get_ratio_level, ca.RATIO_LEVELS, "ratio level"),
        (ca.get_kl_estimator, ca.KL_ESTIMATORS, "KL estimator"),
        (ca.get_loss_aggregation, ca.LOSS_AGGREGATIONS, "loss aggregation"),
    ],
)
def test_registry_unknown_name_lists_valid_names(getter, registry, kind):
    for name, fn in registry.items():
        assert getter(name) is fn
    with pytest.raises(KeyError) as e:
        getter("nope")
    plugins = ", or module:function" if kind in ("advantage estimator", "policy loss", "KL estimator") else ""
    assert e.value.args[0] == f"unknown {kind} 'nope'; valid: {', '.join(sorted(registry))}{plugins}"


def test_registry_names():
    assert set(ca.ADVANTAGE_ESTIMATORS) == {"mean", "leave_one_out"}
    assert set(ca.ADVANTAGE_STDS) == {"group", "leave_one_out"}
    assert set(ca.POLICY_LOSSES) == {"clipped"}
    assert set(ca.RATIO_LEVELS) == {"token", "sequence"}
    assert set(ca.KL_ESTIMATORS) == {"k1", "k2", "k3"}
    assert set(ca.LOSS_AGGREGATIONS) == {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"}


@pytest.mark.parametrize(
    ("field", "message"),
    [
        (
            "policy_loss",
            "grpo.loss.policy_loss='nope' is not allowed; choose one of: clipped, module:function",
        ),
        (
            "kl_estimator",
            "grpo.loss.kl_estimator='nope' is not allowed; choose one of: k1, k2, k3, module:function",
        ),
        (
            "aggregation",
            "grpo.loss.aggregation='nope' is not allowed; choose one of: token-mean, seq-mean-token-mean, "
            "seq-mean-token-sum-norm",
        ),
        (
            "importance_sampling",
            "grpo.loss.importance_sampling='nope' is not allowed; choose one of: none, tis, mis, seq_mis",
        ),
        ("ratio_level", "grpo.loss.ratio_level='nope' is not allowed; choose one of: token, sequence"),
    ],
)
def test_should_name_the_key_in_one_line_when_a_loss_name_is_not_registered(field, message):
    import dataclasses

    from trainer.config import ConfigError, LossConfig

    # importance_sampling's default null is resolved by Config.validate (tis when async, else none)
    # before anything checks the names, so a bare LossConfig() would fail on it.
    base = LossConfig(importance_sampling="none")
    ca.check_loss_config(base)  # the defaults are registered names
    with pytest.raises(ConfigError) as e:
        ca.check_loss_config(dataclasses.replace(base, **{field: "nope"}))
    assert str(e.value) == message


# --------------------------------------------------------------------------- advantages

# Group 1: [1, 0, 0, 0]: mean 0.25, unbiased var = (0.75^2 + 3 * 0.25^2) / 3 = 0.25, std 0.5.
# Group 2: [3, 1, 2, 2]: mean 2, unbiased var = (1 + 1 + 0 + 0) / 3 = 2/3, std 0.81649658.
REWARDS = [1.0, 0.0, 0.0, 0.0, 3.0, 1.0, 2.0, 2.0]


def test_mean_advantage_unnormalized():
    adv = compute_advantages(t(REWARDS), 4, estimator="mean", normalize_std=False)
    expected = [0.75, -0.25, -0.25, -0.25, 1.0, -1.0, 0.0, 0.0]
    torch.testing.assert_close(adv, t(expected))


def test_mean_advantage_normalized():
    adv = compute_advantages(t(REWARDS), 4, estimator="mean", eps=0.0)
    expected = [1.5, -0.5, -0.5, -0.5, 1.22474487, -1.22474487, 0.0, 0.0]  # 1 / 0.81649658
    torch.testing.assert_close(adv, t(expected))


def test_mean_advantage_eps_is_added_to_std():
    adv = compute_advantages(t([1.0, 0.0, 0.0, 0.0]), 4, eps=0.5)
    torch.testing.assert_close(adv, t([0.75, -0.25, -0.25, -0.25]))  # divided by 0.5 + 0.5


def test_leave_one_out_advantage():
    # Group 1 baselines: [0, 1/3, 1/3, 1/3]; group 2: [5/3, 7/3, 2, 2].
    adv = compute_advantages(t(REWARDS), 4, estimator="leave_one_out", normalize_std=False)
    expected = [1.0, -1 / 3, -1 / 3, -1 / 3, 4 / 3, -4 / 3, 0.0, 0.0]
    torch.testing.assert_close(adv, t(expected))
    adv = compute_advantages(t(REWARDS), 4, estimator="leave_one_out", eps=0.0)
    expected = [2.0, -2 / 3, -2 / 3, -2 / 3, 1.63299316, -1.63299316, 0.0, 0.0]  # (4/3) / 0.81649658
    torch.testing.assert_close(adv, t(expected))


def test_leave_one_out_two_sample_group():
    # Each sample's baseline is the other one: [3, 1] -> [2, -2]; std of [3, 1] is sqrt(2).
    adv = compute_advantages(t([3.0, 1.0]), 2, estimator="leave_one_out", normalize_std=False)
    torch.testing.assert_close(adv, t([2.0, -2.0]))
    adv = compute_advantages(t([3.0, 1.0]), 2, estimator="leave_one_out", eps=0.0)
    torch.testing.assert_close(adv, t([1.41421356, -1.41421356]))


@pytest.mark.parametrize("estimator", ["mean", "leave_one_out"])
@pytest.mark.parametrize(
    ("normalize_std", "std"), [(True, "group"), (True, "leave_one_out"), (False, "group")]
)
@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, 1 / 3, -7.3, 1e6 + 0.1])
def test_zero_variance_group_gives_exactly_zero(estimator, normalize_std, std, value):
    rewards = t([value] * 6 + [1.0, 0.0, 0.0])
    adv = compute_advantages(rewards, 3, estimator=estimator, normalize_std=normalize_std, std=std)
    assert torch.equal(adv[:6], torch.zeros(6))  # exact, not close: no eps blow-up of a rounding residue
    assert adv[6] > 0 and adv[7] < 0


# Leave-one-out std: for sample i, the unbiased std of the other three rewards.
# [3, 1, 2, 0]: others [1, 2, 0] -> std 1; [3, 2, 0] -> var (16 + 1 + 25) / 9 / 2 = 7/3, std 1.52752523;
#   [3, 1, 0] -> the same 1.52752523; [3, 1, 2] -> std 1. (The group std would be sqrt(5/3) = 1.29099445.)
# [1, 0, 0, 0]: sample 0's others [0, 0, 0] have std 0, so it is not divided; the others' others
#   [1, 0, 0] -> var (4 + 1 + 1) / 9 / 2 = 1/3, std 0.57735027.
LOO_REWARDS = [3.0, 1.0, 2.0, 0.0, 1.0, 0.0, 0.0, 0.0]


def test_leave_one_out_std_hand_values():
    std = ca.leave_one_out_std(t(LOO_REWARDS).view(2, 4))
    torch.testing.assert_close(
        std, t([[1.0, 1.52752523, 1.52752523, 1.0], [0.0, 0.57735027, 0.57735027, 0.57735027]])
    )
    assert std[1, 0].item() == 0.0  # exactly: the others all agree


def test_leave_one_out_std_with_mean_baseline():
    # Mean baselines 1.5 and 0.25: [1.5, -0.5, 0.5, -1.5] / [1, 1.5275, 1.5275, 1]; [0.75 (undivided), -0.25 / 0.57735 x 3].
    adv = compute_advantages(t(LOO_REWARDS), 4, estimator="mean", std="leave_one_out", eps=0.0)
    expected = [1.5, -0.32732684, 0.32732684, -1.5, 0.75, -0.4330127, -0.4330127, -0.4330127]
    torch.testing.assert_close(adv, t(expected))


def test_leave_one_out_std_with_leave_one_out_baseline_is_nemo_rl_form():
    # Baselines: [1, 5/3, 4/3, 2] and [0, 1/3, 1/3, 1/3]: [2 / 1, (-2/3) / 1.5275, (2/3) / 1.5275, -2 / 1];
    # [1 (undivided), (-1/3) / 0.57735 x 3].
    adv = compute_advantages(t(LOO_REWARDS), 4, estimator="leave_one_out", std="leave_one_out", eps=0.0)
    expected = [2.0, -0.43643578, 0.43643578, -2.0, 1.0, -0.57735027, -0.57735027, -0.57735027]
    torch.testing.assert_close(adv, t(expected))


def test_leave_one_out_std_leaves_a_sample_whose_others_agree_undivided_not_over_eps():
    adv = compute_advantages(t([1.0, 0.0, 0.0, 0.0]), 4, estimator="leave_one_out", std="leave_one_out")
    assert torch.isfinite(adv).all()
    assert adv[0].item() == 1.0  # 1 - 0, not (1 - 0) / 1e-6
    torch.testing.assert_close(adv[1:], t([-0.57735027] * 3), rtol=1e-5, atol=1e-5)  # / (0.57735 + 1e-6)


def test_group_std_is_the_default_and_unchanged():
    for estimator in ("mean", "leave_one_out"):
        default = compute_advantages(t(REWARDS), 4, estimator=estimator)
        assert torch.equal(default, compute_advantages(t(REWARDS), 4, estimator=estimator, std="group"))


def test_leave_one_out_std_needs_three_samples():
    with pytest.raises(ValueError, match="group_size >= 3"):
        compute_advantages(t([1.0, 0.0]), 2, std="leave_one_out")


def test_advantages_accept_integer_rewards():
    adv = compute_advantages(torch.tensor([1, 0]), 2, normalize_std=False)
    torch.testing.assert_close(adv, t([0.5, -0.5]))


@pytest.mark.parametrize(
    ("rewards", "group_size", "match"),
    [
        ([1.0, 0.0, 1.0], 2, "not a multiple"),
        ([1.0, 0.0], 1, "group_size must be >= 2"),
        ([[1.0, 0.0]], 2, "1-D"),
    ],
)
def test_advantages_reject_bad_layout(rewards, group_size, match):
    with pytest.raises(ValueError, match=match):
        compute_advantages(t(rewards), group_size)


def test_advantages_unknown_estimator():
    with pytest.raises(KeyError, match="valid: leave_one_out, mean"):
        compute_advantages(t([1.0, 0.0]), 2, estimator="median")


# --------------------------------------------------------------------------- KL


def test_kl_estimators_hand_values():
    logp = t([[-1.0, -2.0, -3.0]])
    ref = t([[-1.5, -2.0, -2.0]])  # logp - ref = [0.5, 0, -1]
    torch.testing.assert_close(kl_k1(logp, ref), t([[0.5, 0.0, -1.0]]))
    torch.testing.assert_close(kl_k2(logp, ref), t([[0.125, 0.0, 0.5]]))
    # d = ref - logp = [-0.5, 0, 1]: e^-0.5 + 0.5 - 1 = 0.10653066; e - 2 = 0.71828183
    torch.testing.assert_close(kl_k3(logp, ref), t([[0.10653066, 0.0, 0.71828183]]))


def test_kl_k3_clamps_log_ratio():
    logp = t([[-100.0, 0.0]])
    ref = t([[0.0, -100.0]])  # d = ref - logp = [100, -100], clamped to [20, -20]
    out = kl_k3(logp, ref)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, t([[485165195.4 - 21.0, 19.0 + 2.06e-9]]))  # e^20 - 21, e^-20 + 19


def test_kl_clamp_bounds_the_estimate_both_ways():
    logp = t([[-5.0, 0.0, -1.0]]).requires_grad_(True)
    ref = t([[0.0, -5.0, -1.5]])  # d = ref - logp = [5, -5, -0.5]
    k3 = kl_k3(logp, ref)
    # e^5 - 5 - 1 = 142.41315911; e^-5 + 5 - 1 = 4.00673795; e^-0.5 + 0.5 - 1 = 0.10653066
    torch.testing.assert_close(k3, t([[142.41315911, 4.00673795, 0.10653066]]))
    clamped = ca.clamp_kl(k3, 10.0)
    torch.testing.assert_close(clamped, t([[10.0, 4.00673795, 0.10653066]]))
    assert ca.clamp_kl(k3, None) is k3  # null: no clamp
    torch.testing.assert_close(ca.clamp_kl(kl_k1(logp, ref), 2.0), t([[-2.0, 2.0, 0.5]]))  # k1 = [-5, 5, 0.5]
    clamped.sum().backward()
    # d k3 / d logp = 1 - e^d where live; the clamped token has no gradient.
    torch.testing.assert_close(logp.grad, t([[0.0, 1.0 - math.exp(-5.0), 1.0 - math.exp(-0.5)]]))


def test_kl_k3_is_nonnegative():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(64, 33, generator=g) * 10
    # Large, moderate and tiny (cancellation-prone) differences.
    for scale in (30.0, 1.0, 1e-3, 1e-6, 1e-9):
        ref = logp + torch.randn(64, 33, generator=g) * scale
        assert (kl_k3(logp, ref) >= 0).all(), scale
    assert (kl_k3(logp.double(), (logp + 1e-12).double()) >= 0).all()


def test_kl_k3_bf16_stays_finite_and_nonnegative():
    logp = t([[-1.0, -50.0, -0.01]], torch.bfloat16)
    ref = t([[-1.01, -0.01, -50.0]], torch.bfloat16)
    out = kl_k3(logp, ref)
    assert torch.isfinite(out).all() and (out >= 0).all()


# --------------------------------------------------------------------------- policy loss

# old logprobs are 0, so ratio = exp(logp). Row 0 has A = +2, row 1 has A = -1.
RATIOS = [[1.0, 1.5, 0.5], [1.5, 0.5, 5.0]]
CLIP = dict(ratio_clip_min=0.2, ratio_clip_max=0.28)  # ratio range [0.8, 1.28]


def _policy_inputs():
    logp = torch.log(t(RATIOS)).requires_grad_(True)
    return logp, torch.zeros(2, 3), t([2.0, -1.0])


def test_clipped_policy_loss_hand_values():
    logp, old, adv = _policy_inputs()
    loss, m = clipped_policy_loss(logp, old, adv, **CLIP)
    # A=+2: r=1 -> -2; r=1.5 -> max(-3, -2.56) = -2.56 (clipped); r=0.5 -> max(-1, -1.6) = -1
    # A=-1: r=1.5 -> max(1.5, 1.28) = 1.5; r=0.5 -> max(0.5, 0.8) = 0.8 (clipped); r=5 -> 5
    torch.testing.assert_close(loss, t([[-2.0, -2.56, -1.0], [1.5, 0.8, 5.0]]))
    torch.testing.assert_close(m["clipfrac"], t([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]]))
    torch.testing.assert_close(m["dual_clipfrac"], torch.zeros(2, 3))
    torch.testing.assert_close(m["ratio"], t(RATIOS))
    # ppo_kl = old - logp = -log(ratio): -log 1.5 = -0.40546511, -log 0.5 = 0.69314718, -log 5 = -1.60943791
    torch.testing.assert_close(
        m["ppo_kl"], t([[0.0, -0.40546511, 0.69314718], [-0.40546511, 0.69314718, -1.60943791]])
    )
    assert not any(v.requires_grad for v in m.values())


def test_dual_clip_caps_negative_advantage_tokens():
    logp, old, adv = _policy_inputs()
    loss, m = clipped_policy_loss(logp, old, adv, **CLIP, ratio_clip_c=3.0)
    # Only (A=-1, r=5) changes: min(5, 3 * |A|) = 3. (A=+2, r=1.5) is not capped: dual clip is for A < 0.
    torch.testing.assert_close(loss, t([[-2.0, -2.56, -1.0], [1.5, 0.8, 3.0]]))
    torch.testing.assert_close(m["dual_clipfrac"], t([[0.0, 0.0, 0.0], [0.0, 0.0, 1.0]]))
    torch.testing.assert_close(m["clipfrac"], t([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]]))


def test_dual_clip_does_not_touch_positive_advantage_with_huge_ratio():
    logp = torch.log(t([[10.0]]))
    loss, m = clipped_policy_loss(logp, torch.zeros(1, 1), t([1.0]), **CLIP, ratio_clip_c=3.0)
    torch.testing.assert_close(loss, t([[-1.28]]))
    assert m["dual_clipfrac"].item() == 0.0 and m["clipfrac"].item() == 1.0


def test_clipped_loss_gradient_is_zero_where_clipped():
    for c, grad_last in ((None, 5.0), (3.0, 0.0)):
        logp, old, adv = _policy_inputs()
        loss, m = clipped_policy_loss(logp, old, adv, **CLIP, ratio_clip_c=c)
        loss.sum().backward()
        # d(-A * exp(logp - old)) / dlogp = -A * ratio where live, 0 where clipped or dual-clipped.
        expected = t([[-2.0, 0.0, -1.0], [1.5, 0.0, grad_last]])
        torch.testing.assert_close(logp.grad, expected)
        dead = (m["clipfrac"] + m["dual_clipfrac"]) > 0
        assert (logp.grad[dead] == 0).all()


def test_clipped_loss_per_token_advantages_match_per_sequence():
    logp, old, adv = _policy_inputs()
    a, ma = clipped_policy_loss(logp, old, adv, **CLIP, ratio_clip_c=3.0)
    b, mb = clipped_policy_loss(logp, old, adv[:, None].expand(2, 3), **CLIP, ratio_clip_c=3.0)
    torch.testing.assert_close(a, b)
    for k in ma:
        torch.testing.assert_close(ma[k], mb[k])


def test_clipped_loss_extreme_log_ratio_is_finite():
    logp = t([[0.0, -1000.0]], torch.float32).requires_grad_(True)
    old = t([[-1000.0, 0.0]])
    loss, _ = clipped_policy_loss(logp, old, t([-1.0]), **CLIP)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(logp.grad).all()


def test_on_policy_loss_is_minus_advantage():
    logp = t([[-0.3, -1.2], [-2.0, -0.1]])
    loss, m = clipped_policy_loss(logp, logp.clone(), t([0.5, -1.5]), **CLIP)
    torch.testing.assert_close(loss, t([[-0.5, -0.5], [1.5, 1.5]]))
    assert m["clipfrac"].sum() == 0 and m["ppo_kl"].abs().sum() == 0


# --------------------------------------------------------------------------- GSPO (sequence ratio)

# Row 0: log-ratios [0.2, -0.2, 0.2], mean 1/15, s0 = e^(1/15) = 1.06893911.
# Row 1: log-ratios [-0.1, 0.3] and a padded token (its -3 must not count): mean 0.1, s1 = e^0.1 = 1.10517092.
GSPO_LOGP = [[-1.0, -2.0, -0.5], [-1.0, -1.0, -3.0]]
GSPO_OLD = [[-1.2, -1.8, -0.7], [-0.9, -1.3, 0.0]]
GSPO_MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
S0, S1 = 1.06893911, 1.10517092


def _gspo_loss(clip, logp=None):
    logp = t(GSPO_LOGP).requires_grad_(True) if logp is None else logp
    old, mask, adv = t(GSPO_OLD), t(GSPO_MASK), t([1.0, -1.0])
    log_ratio = ca.sequence_log_ratio(logp, old, mask)
    loss, m = clipped_policy_loss(logp, old, adv, **clip, log_ratio=log_ratio)
    return logp, mask, loss, m


def test_sequence_ratio_is_one_value_per_sequence_from_its_response_tokens():
    logp, mask, loss, m = _gspo_loss(CLIP)  # [0.8, 1.28]: both sequences live
    torch.testing.assert_close(m["ratio"], t([[S0] * 3, [S1] * 3]))
    torch.testing.assert_close(loss, t([[-S0] * 3, [S1] * 3]))  # -A * s_i on every token
    assert m["clipfrac"].sum() == 0
    # ppo_kl keeps its per-token meaning, old - logp.
    torch.testing.assert_close(m["ppo_kl"], t([[-0.2, 0.2, -0.2], [0.1, -0.3, 3.0]]))


def test_sequence_ratio_gradient_is_gspo_gradient():
    logp, mask, loss, _ = _gspo_loss(CLIP)
    aggregate_loss(loss, mask, "seq-mean-token-mean").backward()
    # GSPO: grad of -(1/B) sum_i A_i s_i = -(1/B) sum_i A_i s_i * (1/|y_i|) sum_t grad lp_t.
    by_hand = t([[-S0 / 3 / 2] * 3, [S1 / 2 / 2, S1 / 2 / 2, 0.0]])  # -0.17815652, 0.27629273
    torch.testing.assert_close(logp.grad, by_hand)
    # The same from autograd through the sequence objective written out.
    lp = t(GSPO_LOGP).requires_grad_(True)
    s = torch.exp(ca.masked_mean(lp - t(GSPO_OLD), t(GSPO_MASK), dim=-1))  # (B,)
    (-(t([1.0, -1.0]) * s).mean()).backward()
    torch.testing.assert_close(logp.grad, lp.grad)


def test_sequence_ratio_is_clipped_as_a_whole_at_gspo_clip_ranges():
    logp, mask, loss, m = _gspo_loss(dict(ratio_clip_min=3e-4, ratio_clip_max=4e-4))  # [0.9997, 1.0004]
    # Row 0 (A = +1, s0 = 1.069 > 1.0004): every token clipped to -1.0004, no gradient.
    # Row 1 (A = -1, s1 = 1.105): max(1.105, 1.0004) is the live branch.
    torch.testing.assert_close(loss, t([[-1.0004] * 3, [S1] * 3]))
    torch.testing.assert_close(m["clipfrac"], t([[1.0] * 3, [0.0] * 3]))
    aggregate_loss(loss, mask, "seq-mean-token-mean").backward()
    torch.testing.assert_close(logp.grad, t([[0.0] * 3, [S1 / 4, S1 / 4, 0.0]]))


def test_sequence_ratio_on_policy_is_one_with_the_policy_gradient():
    logp = t(GSPO_LOGP).requires_grad_(True)
    mask = t(GSPO_MASK)
    log_ratio = ca.sequence_log_ratio(logp, logp.detach(), mask)
    loss, m = clipped_policy_loss(logp, logp.detach(), t([0.5, -1.5]), **CLIP, log_ratio=log_ratio)
    assert torch.equal(m["ratio"], torch.ones(2, 3))
    (loss * mask).sum().backward()
    torch.testing.assert_close(logp.grad, t([[-0.5] * 3, [1.5, 1.5, 0.0]]))


def test_sequence_ratio_keeps_a_nonfinite_padded_logprob_out_of_the_gradient():
    logp = t([[-1.0, -2.0, -0.5], [-1.0, -1.0, -math.inf]]).requires_grad_(True)
    _, mask, loss, m = _gspo_loss(CLIP, logp)
    torch.testing.assert_close(m["ratio"][:, 0], t([S0, S1]))
    aggregate_loss(loss, mask, "token-mean").backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[1, 2] == 0


def test_token_ratio_level_is_the_clipped_loss_bit_for_bit():
    for c in (None, 3.0):
        a_logp, old, adv = _policy_inputs()
        a, ma = clipped_policy_loss(a_logp, old, adv, **CLIP, ratio_clip_c=c)
        a.sum().backward()
        b_logp, _, _ = _policy_inputs()
        log_ratio = ca.token_log_ratio(b_logp, old, torch.ones(2, 3))
        b, mb = clipped_policy_loss(b_logp, old, adv, **CLIP, ratio_clip_c=c, log_ratio=log_ratio)
        b.sum().backward()
        assert torch.equal(a, b) and torch.equal(a_logp.grad, b_logp.grad)
        assert all(torch.equal(ma[k], mb[k]) for k in ma)


# --------------------------------------------------------------------------- overlong reward shaping


def test_overlong_penalty_hand_values():
    # L_max 10, buffer 4: free up to 6 tokens, then (6 - length) / 4 * penalty, -penalty from 10 on.
    lengths = t([5.0, 6.0, 7.0, 8.0, 10.0, 12.0])
    torch.testing.assert_close(
        ca.overlong_penalty(lengths, 10, 4, 1.0), t([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    )
    torch.testing.assert_close(
        ca.overlong_penalty(lengths, 10, 4, 0.5), t([0.0, 0.0, -0.125, -0.25, -0.5, -0.5])
    )


def test_overlong_penalty_off_and_integer_lengths():
    assert torch.equal(ca.overlong_penalty(t([3.0, 10.0]), 10, 0, 1.0), torch.zeros(2))  # buffer 0: off
    torch.testing.assert_close(ca.overlong_penalty(torch.tensor([9, 1]), 10, 2, 1.0), t([-0.5, 0.0]))


# --------------------------------------------------------------------------- aggregation

LOSS = [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]]
MASK = [[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]]  # third sequence has no response tokens


@pytest.mark.parametrize(
    ("mode", "kwargs", "expected"),
    [
        ("token-mean", {}, 17 / 5),  # (1+2+3+5+6) / 5 tokens
        ("token-mean", {"num_tokens": 10}, 1.7),
        ("seq-mean-token-mean", {}, 2.5),  # (6/3 + 11/2 + 0) / 3 seqs
        ("seq-mean-token-mean", {"num_seqs": 5}, 1.5),
        ("seq-mean-token-sum-norm", {}, 17 / 12),  # (6/4 + 11/4 + 0) / 3
        ("seq-mean-token-sum-norm", {"max_len": 8}, 17 / 24),
        ("seq-mean-token-sum-norm", {"max_len": 8, "num_seqs": 2}, 17 / 16),
    ],
)
def test_aggregation_hand_values(mode, kwargs, expected):
    out = aggregate_loss(t(LOSS), t(MASK), mode, **kwargs)
    assert out.dim() == 0
    torch.testing.assert_close(out, t(expected))


@pytest.mark.parametrize("mode", sorted(ca.LOSS_AGGREGATIONS))
def test_aggregation_ignores_nonfinite_padding(mode):
    loss = t(LOSS)
    loss[0, 3] = float("nan")
    loss[2, 0] = float("inf")
    expected = aggregate_loss(t(LOSS), t(MASK), mode)
    torch.testing.assert_close(aggregate_loss(loss, t(MASK).bool(), mode), expected)


@pytest.mark.parametrize("mode", sorted(ca.LOSS_AGGREGATIONS))
def test_aggregation_of_empty_mask_is_zero(mode):
    out = aggregate_loss(torch.ones(2, 3), torch.zeros(2, 3), mode)
    assert out.item() == 0.0


def _trim_padding(loss, mask):
    """What a rank would hold after padding its shard only to its own longest response."""
    width = int(mask.sum(-1).max().item()) if mask.any() else 1
    return loss[:, :width], mask[:, :width]


@pytest.mark.parametrize("mode", sorted(ca.LOSS_AGGREGATIONS))
@pytest.mark.parametrize("split", [1, 3, 5])
def test_aggregation_data_parallel_sum_equals_whole_batch(mode, split):
    g = torch.Generator().manual_seed(split)
    B, T = 6, 7
    loss = torch.randn(B, T, generator=g, dtype=torch.float64).requires_grad_(True)
    lengths = torch.tensor([7, 2, 0, 5, 1, 3])  # right-padded responses, one empty
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    counts = dict(num_tokens=mask.sum().item(), num_seqs=B, max_len=T)

    whole = aggregate_loss(loss, mask, mode)
    (whole_grad,) = torch.autograd.grad(whole, loss)
    parts = [
        aggregate_loss(*_trim_padding(loss[:split], mask[:split]), mode, **counts),
        aggregate_loss(*_trim_padding(loss[split:], mask[split:]), mode, **counts),
    ]
    torch.testing.assert_close(parts[0] + parts[1], whole)
    (parts_grad,) = torch.autograd.grad(parts[0] + parts[1], loss)  # what all-reduce SUM of grads sees
    torch.testing.assert_close(parts_grad, whole_grad)


# --------------------------------------------------------------------------- masked reductions


def test_masked_sum_and_mean_hand_values():
    x = t([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    mask = t([[1, 0], [1, 1], [0, 0]])
    torch.testing.assert_close(masked_sum(x, mask), t(8.0))
    torch.testing.assert_close(masked_sum(x, mask, dim=1), t([1.0, 7.0, 0.0]))
    torch.testing.assert_close(masked_sum(x, mask, dim=0), t([4.0, 4.0]))
    torch.testing.assert_close(masked_mean(x, mask), t(8 / 3))
    torch.testing.assert_close(masked_mean(x, mask, dim=1), t([1.0, 3.5, 0.0]))  # empty row -> 0
    torch.testing.assert_close(masked_mean(x, mask.bool(), dim=0), t([2.0, 4.0]))


def test_masked_mean_empty_row_has_finite_gradient():
    x = t([[1.0, 2.0], [float("inf"), 3.0]]).requires_grad_(True)
    mask = t([[1, 1], [0, 0]])
    masked_mean(x, mask, dim=1).sum().backward()
    torch.testing.assert_close(x.grad, t([[0.5, 0.5], [0.0, 0.0]]))


# --------------------------------------------------------------------------- token utilities


def test_logprobs_and_entropy_hand_values():
    # Row: logits [0, ln 3] -> p = [1/4, 3/4]; logits [0, 0] -> p = [1/2, 1/2].
    logits = t([[[0.0, math.log(3.0)], [0.0, 0.0], [0.0, math.log(3.0)]]])
    labels = torch.tensor([[1, 0, 0]])
    expected = t([[-0.28768207, -0.69314718, -1.38629436]])  # ln 3/4, ln 1/2, ln 1/4
    torch.testing.assert_close(logprobs_from_logits(logits, labels), expected)
    torch.testing.assert_close(logprobs_from_logits(logits, labels, chunk_size=2), expected)
    # H = 0.25 ln 4 + 0.75 ln 4/3 = 0.56233514; uniform over 2 -> ln 2
    torch.testing.assert_close(entropy_from_logits(logits), t([[0.56233514, 0.69314718, 0.56233514]]))


def test_entropy_uniform_and_masked_vocab():
    torch.testing.assert_close(entropy_from_logits(torch.zeros(2, 3, 4)), torch.full((2, 3), 1.38629436))
    logits = t([[[0.0, float("-inf"), 0.0, float("-inf")]]])  # two live tokens, equally likely
    torch.testing.assert_close(entropy_from_logits(logits), t([[0.69314718]]))
    torch.testing.assert_close(entropy_from_logits(logits, chunk_size=1), t([[0.69314718]]))


def _random_logits(dtype=torch.float32, seed=0, shape=(3, 5, 11)):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, generator=g) * 4).to(dtype)
    labels = torch.randint(0, shape[-1], shape[:2], generator=g)
    return logits, labels


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 15, 100])
def test_logprobs_chunked_equals_unchunked_equals_log_softmax(chunk_size):
    logits, labels = _random_logits()
    reference = torch.log_softmax(logits, dim=-1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(logprobs_from_logits(logits, labels), reference)
    torch.testing.assert_close(logprobs_from_logits(logits, labels, chunk_size=chunk_size), reference)
    torch.testing.assert_close(
        entropy_from_logits(logits, chunk_size=chunk_size), entropy_from_logits(logits)
    )


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_logprobs_bf16_logits_use_float32_math(chunk_size):
    logits, labels = _random_logits(torch.bfloat16)
    out = logprobs_from_logits(logits, labels, chunk_size=chunk_size)
    assert out.dtype == torch.float32
    reference = torch.log_softmax(logits.double(), dim=-1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(out, reference.float(), rtol=1e-6, atol=1e-5)
    assert entropy_from_logits(logits, chunk_size=chunk_size).dtype == torch.float32


@pytest.mark.parametrize("chunk_size", [1, 4, 100])
def test_chunked_logprobs_gradient_matches_autograd(chunk_size):
    logits, labels = _random_logits(torch.float64, seed=1)
    weights = torch.randn(labels.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    (logprobs_from_logits(a, labels, chunk_size=chunk_size) * weights).sum().backward()
    (torch.log_softmax(b, -1).gather(-1, labels[..., None]).squeeze(-1) * weights).sum().backward()
    torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("chunk_size", [1, 4, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_logprobs_and_entropy_equal_the_separate_functions_at_a_temperature(chunk_size, temperature):
    logits, labels = _random_logits(torch.float64, seed=4)
    logits[0, 0, :3] = float("-inf")  # masked vocabulary: entropy must stay finite
    labels[0, 0] = 5
    weights = torch.randn(labels.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    lp, entropy = ca.logprobs_and_entropy(
        a, labels, chunk_size=chunk_size, temperature=temperature, with_entropy=True
    )
    reference = torch.log_softmax(b / temperature, -1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(lp, reference)
    torch.testing.assert_close(entropy, entropy_from_logits(logits / temperature))
    assert not entropy.requires_grad
    (lp * weights).sum().backward()
    (reference * weights).sum().backward()
    torch.testing.assert_close(a.grad, b.grad)
    assert ca.logprobs_and_entropy(a, labels, chunk_size=chunk_size)[1] is None


def test_fused_logprobs_leave_float32_logits_untouched():
    logits, labels = _random_logits(torch.float32, seed=6)
    before = logits.clone()
    x = logits.requires_grad_(True)
    lp, _ = ca.logprobs_and_entropy(x, labels, chunk_size=4, temperature=0.5, with_entropy=True)
    lp.sum().backward()
    assert torch.equal(logits.detach(), before)  # the saved logits are read again in the backward


def test_chunked_logprobs_gradcheck():
    logits, labels = _random_logits(torch.float64, seed=3, shape=(2, 3, 5))
    logits.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: logprobs_from_logits(x, labels, chunk_size=2), (logits,))


def test_chunked_logprobs_bf16_gradient_dtype():
    logits, labels = _random_logits(torch.bfloat16)
    logits.requires_grad_(True)
    logprobs_from_logits(logits, labels, chunk_size=4).sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad.float()).all()


# ----- importance sampling against the engine's (behaviour) logprobs ----------------------------------


def test_truncated_importance_weights_cap_the_ratio_and_flag_what_they_cut():
    old = t([[0.0, -1.0, -2.0]])
    behaviour = t([[0.0, -2.0, -1.0]])  # ratios e^0 = 1, e^1 = 2.718, e^-1 = 0.368
    mask = t([[1.0, 1.0, 1.0]])
    w, flagged = ca.get_importance_sampling("tis")(old, behaviour, mask, tis_cap=2.0)
    assert torch.allclose(w, t([[1.0, 2.0, math.exp(-1.0)]]))
    assert flagged.tolist() == [[0.0, 1.0, 0.0]]


def test_masked_importance_weights_drop_tokens_outside_the_band():
    old = t([[0.0, -1.0, -2.0, -1.0]])
    behaviour = t([[0.0, -2.0, -1.0, -1.2]])  # ratios 1, 2.718, 0.368, 1.221
    mask = t([[1.0, 1.0, 1.0, 1.0]])
    w, flagged = ca.get_importance_sampling("mis")(old, behaviour, mask, mis_low=0.5, mis_high=2.0)
    assert torch.allclose(w, t([[1.0, 0.0, 0.0, math.exp(0.2)]]))
    assert flagged.tolist() == [[0.0, 1.0, 1.0, 0.0]]


def test_sequence_masked_importance_weights_drop_a_whole_sequence_on_its_geometric_mean():
    # row 0: log-ratios 1 and -1 (mean 0, geometric mean 1): kept, each token with its own ratio;
    # row 1: log-ratios 1 and 1 (geometric mean e = 2.718 > 2): dropped; its padding does not count.
    old = t([[0.0, -2.0, 0.0], [0.0, 0.0, 5.0]])
    behaviour = t([[-1.0, -1.0, 0.0], [-1.0, -1.0, 0.0]])
    mask = t([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    w, flagged = ca.get_importance_sampling("seq_mis")(old, behaviour, mask, mis_low=0.5, mis_high=2.0)
    assert torch.allclose(w[0, :2], t([math.e, math.exp(-1.0)])) and w[1].abs().sum() == 0
    assert flagged[:, :2].tolist() == [[0.0, 0.0], [1.0, 1.0]]


def test_no_importance_weights_are_ones_and_flag_nothing():
    old, behaviour = t([[0.0, -3.0]]), t([[-5.0, 0.0]])
    w, flagged = ca.get_importance_sampling("none")(old, behaviour, torch.ones(1, 2))
    assert w.tolist() == [[1.0, 1.0]] and flagged.tolist() == [[0.0, 0.0]]


def test_importance_weights_carry_no_gradient():
    old = t([[0.0, -1.0]]).requires_grad_(True)
    w, _ = ca.get_importance_sampling("tis")(old, t([[0.0, -0.5]]), torch.ones(1, 2), tis_cap=2.0)
    assert not w.requires_grad


def test_unknown_importance_sampling_lists_the_valid_ones():
    with pytest.raises(KeyError, match="mis, none, seq_mis, tis"):
        ca.get_importance_sampling("sis")


@pytest.mark.parametrize("scale", [1.0, 10.0, 1e4])
def test_should_give_no_advantage_when_a_groups_rewards_differ_by_rounding_alone(scale):
    # A reward model's float32 score of one answer moves by a few ulps with its batch: 2e-6 at 10.
    ulps = torch.tensor([0.0, 2e-7, -1e-7, 3e-7], dtype=torch.float64) * scale
    rewards = (scale + ulps).float()
    assert len(set(rewards.tolist())) > 1  # not exactly equal ...
    for estimator in ("mean", "leave_one_out"):
        adv = compute_advantages(rewards, 4, estimator=estimator)
        assert torch.equal(adv, torch.zeros(4))  # ... and no signal


def test_should_keep_the_advantage_of_a_real_difference_however_small_the_rewards():
    adv = compute_advantages(t([0.0, 0.0, 0.0, 1e-3]), 4)  # a partial credit of 1 in 1000
    assert adv[3] > 1.0 and (adv[:3] < 0).all()
    adv = compute_advantages(t([10.0, 10.0, 10.0, 10.01]), 4)  # a reward model's 1e-3 of its scale
    assert adv[3] > 1.0
