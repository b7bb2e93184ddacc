"""The whole GRPO objective as one function (trainer/algorithms/objective.py), without a policy worker:
expected numbers written out by hand, and the data-parallel property the worker relies on."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.algorithms.objective import LossInputs, Objective, global_counts
from trainer.config import LossConfig


def t(x):
    return torch.tensor(x, dtype=torch.float32)


MASK = t([[1, 1, 0], [1, 1, 1]])  # 5 tokens, the first response padded


def _inputs(logprobs, **kw) -> LossInputs:
    logprobs = logprobs.clone().requires_grad_(True)
    return LossInputs(
        logprobs=logprobs,
        advantages=kw.pop("advantages", t([1.0, -2.0])),
        mask=MASK,
        num_tokens=kw.pop("num_tokens", 5.0),
        num_seqs=kw.pop("num_seqs", 2.0),
        **kw,
    )


def test_should_be_minus_the_token_mean_advantage_with_its_gradient_when_on_policy():
    objective = Objective(LossConfig(importance_sampling="none"), max_len=3, kl_penalty=False)
    x = _inputs(t([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]]))
    loss, sums = objective(x)
    # ratio 1 everywhere: loss = -(1 + 1 - 2 - 2 - 2) / 5
    assert loss.item() == pytest.approx(4 / 5)
    loss.backward()
    assert torch.allclose(x.logprobs.grad, t([[-1 / 5, -1 / 5, 0], [2 / 5, 2 / 5, 2 / 5]]))
    assert sums["tokens"].item() == 5 and sums["pg_clipfrac"].item() == 0 and sums["ppo_kl"].item() == 0
    assert sums["gen_tokens"].item() == 0 and "kl" not in sums


def test_should_weight_only_the_policy_gradient_term_when_tis_truncates_the_engines_ratio():
    loss_cfg = LossConfig(
        importance_sampling="tis",
        tis_cap=2.0,
        reference_policy_kl_penalty=0.5,
        kl_estimator="k1",
        kl_clamp=None,
    )
    objective = Objective(loss_cfg, max_len=3, kl_penalty=True)
    lp = t([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    behaviour = lp - math.log(3.0)  # pi_old / pi_engine = 3 on every token: truncated to 2
    x = _inputs(lp, behaviour_logprobs=behaviour, ref_logprobs=lp - 0.2)  # k1 = 0.2 per token
    loss, sums = objective(x)
    # per token: 2 * (-A) + 0.5 * 0.2; A = 1 (2 tokens), -2 (3 tokens); token-mean over 5
    assert loss.item() == pytest.approx((2 * (-1) * 2 + 2 * 2 * 3 + 0.1 * 5) / 5)
    assert sums["is_flagged"].item() == 5  # every token's ratio was truncated
    assert sums["gen_logprob_abs_diff"].item() == pytest.approx(5 * math.log(3.0))
    assert sums["kl"].item() == pytest.approx(5 * 0.2)


def test_should_sum_over_ranks_to_the_whole_batchs_loss_when_each_rank_passes_the_global_counts():
    torch.manual_seed(0)
    loss_cfg = LossConfig(importance_sampling="mis", aggregation="seq-mean-token-mean")
    objective = Objective(loss_cfg, max_len=3, kl_penalty=False)
    lp, old, gen = (-torch.rand(4, 3) for _ in range(3))
    mask = t([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    adv = t([1.0, -1.0, 0.5, 2.0])

    def on(rows, seqs, tokens):
        return LossInputs(
            logprobs=lp[rows],
            advantages=adv[rows],
            mask=mask[rows],
            num_tokens=tokens,
            num_seqs=seqs,
            old_logprobs=old[rows],
            behaviour_logprobs=gen[rows],
        )

    whole, _ = objective(on(slice(0, 4), 4, mask.sum().item()))
    halves = [objective(on(rows, 4, mask.sum().item()))[0] for rows in (slice(0, 2), slice(2, 4))]
    assert (halves[0] + halves[1]).item() == pytest.approx(whole.item(), rel=1e-6)


def test_should_clip_each_response_as_one_when_the_ratio_is_gspos_sequence_ratio():
    loss_cfg = LossConfig(
        importance_sampling="none",
        ratio_level="sequence",
        ratio_clip_min=0.1,
        ratio_clip_max=0.1,
        aggregation="seq-mean-token-mean",
    )
    objective = Objective(loss_cfg, max_len=3, kl_penalty=False)
    old = t([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    lp = old + t(
        [[0.5, 0.5, 9.0], [0.0, 0.0, 0.0]]
    )  # response 0: ratio e^0.5 over its 2 tokens (padding ignored)
    _, sums = objective(_inputs(lp, old_logprobs=old, advantages=t([1.0, 1.0])))
    assert (
        sums["pg_clipfrac"].item() == 2
    )  # both tokens of response 0 clipped, as one, and none of response 1


def test_should_refuse_a_kl_penalty_without_reference_logprobs():
    objective = Objective(
        LossConfig(importance_sampling="none", reference_policy_kl_penalty=0.1), max_len=3, kl_penalty=True
    )
    with pytest.raises(ValueError, match="no reference logprobs"):
        objective(_inputs(t([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])))


def test_should_list_the_valid_names_when_an_option_is_unknown():
    with pytest.raises(KeyError, match="valid: mis, none, seq_mis, tis"):
        Objective(LossConfig(importance_sampling="cispo"), max_len=3, kl_penalty=False)


def test_should_backpropagate_the_share_times_the_ranks_and_report_the_share_when_fsdp_averages_ranks():
    torch.manual_seed(1)
    lp = -torch.rand(2, 3)
    one = Objective(LossConfig(importance_sampling="none"), max_len=3, kl_penalty=False)
    four = Objective(LossConfig(importance_sampling="none"), max_len=3, kl_penalty=False, ranks=4)
    x1, x4 = _inputs(lp), _inputs(lp)
    (loss1, sums1), (loss4, sums4) = one(x1), four(x4)
    assert (
        loss4.item() == pytest.approx(4 * loss1.item()) and sums4["loss"] == sums1["loss"] == loss1.detach()
    )
    loss1.backward()
    loss4.backward()
    assert torch.allclose(x4.logprobs.grad, 4 * x1.logprobs.grad)  # FSDP's average over 4 ranks undoes it


def test_should_divide_each_metric_by_its_own_count_when_the_step_is_summed_over_ranks():
    objective = Objective(LossConfig(), max_len=3, kl_penalty=False, ranks=2)
    sums = dict.fromkeys(objective.metric_keys(), 0.0) | {
        "loss": 0.6,  # summed over 3 steps' micro-batches and ranks
        "grad_norm": 6.0,  # once per step and rank: 3 x 2
        "tokens": 10.0,
        "pg_clipfrac": 2.0,
        "gen_tokens": 4.0,
        "gen_train_kl": 1.0,
        "entropy": 5.0,
    }
    out = objective.metrics(sums, steps=3)
    assert out["loss"] == pytest.approx(0.2) and out["grad_norm"] == pytest.approx(1.0)
    assert out["pg_clipfrac"] == 0.2 and out["entropy"] == 0.5 and out["gen_train_kl"] == 0.25
    assert "tokens" not in out and "gen_tokens" not in out
    # No token trained on (every group flat and skipped, every loss mask empty): no mean over tokens was
    # measured, and a 0.0 clip fraction, KL or entropy would read as one; the loss and grad norm stay.
    untrained = objective.metrics(dict.fromkeys(sums, 0.0) | {"kl": 0.0}, steps=1)
    assert untrained == {"loss": 0.0, "grad_norm": 0.0}
    # No engine-sampled token trained on (every group skipped): the engine's gap was not measured, and a
    # 0.0 would read as a perfect match on the dashboard.
    quiet = objective.metrics(sums | {"gen_tokens": 0.0, "gen_train_kl": 0.0}, steps=3)
    assert not {"gen_logprob_abs_diff", "gen_train_kl", "is_flagged"} & quiet.keys()


def test_should_count_the_loss_tokens_and_samples_when_the_driver_takes_a_mini_batchs_counts():
    assert global_counts([[1, 1, 0, 1], [1], [0, 0]]) == {"tokens": 4.0, "seqs": 3.0}
