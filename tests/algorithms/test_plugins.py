"""A user's own advantage estimator, policy loss and KL estimator, named as ``module:function``
(trainer/algorithms/core_algos.py): the functions below are the users', reached by this module's name. Each
is used where the built-ins are (the advantages of a step, the objective), with expected numbers written out
by hand; one that does not import, does not bind to the built-in's signature or breaks its contract on a small
batch stops the run at start in one line naming the key."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor

from trainer.algorithms import core_algos
from trainer.algorithms.objective import LossInputs, Objective
from trainer.config import AdvantageConfig, ConfigError, GRPOConfig, LossConfig, load

MOD = "tests.algorithms.test_plugins"


# ----------------------------------------------------------------------------- the users' functions


def half_mean_baseline(grouped: Tensor) -> Tensor:
    """Half the group's mean as the baseline. (N, G) -> (N, G)."""
    return 0.5 * grouped.mean(dim=1, keepdim=True).expand_as(grouped)


def squared_log_ratio(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """(log pi - log pi_ref)^2: twice k2. (B, T) -> (B, T)."""
    return (logprobs - ref_logprobs).square()


def reinforce_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    *,
    ratio_clip_min: float,
    ratio_clip_max: float,
    ratio_clip_c: float | None = None,
    log_ratio: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """-A * ratio per token, never clipped. (B, T) -> ((B, T), metrics (B, T))."""
    ratio = torch.exp(logprobs - old_logprobs if log_ratio is None else log_ratio)
    loss = -advantages.unsqueeze(-1) * ratio
    zeros = torch.zeros_like(loss).detach()
    return loss, {"clipfrac": zeros, "ppo_kl": (old_logprobs - logprobs).detach()}


NOT_CALLABLE = 3


def two_argument_loss(logprobs: Tensor, advantages: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    return -advantages.unsqueeze(-1) * logprobs, {}


def per_sequence_loss(logprobs, old_logprobs, advantages, **_):
    loss = -(advantages.unsqueeze(-1) * logprobs).sum(-1)  # (B,): the objective needs (B, T)
    return loss, {"clipfrac": torch.zeros_like(logprobs), "ppo_kl": torch.zeros_like(logprobs)}


def loss_without_ppo_kl(logprobs, old_logprobs, advantages, **_):
    return -advantages.unsqueeze(-1) * logprobs, {"clipfrac": torch.zeros_like(logprobs)}


def detached_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return (logprobs - ref_logprobs).detach()


def per_group_baseline(grouped: Tensor) -> Tensor:
    return grouped.mean(dim=1, keepdim=True)  # (N, 1): one per group, not one per reward


def raising_baseline(grouped: Tensor) -> Tensor:
    raise ValueError("no baseline today")


# ----------------------------------------------------------------------------- helpers


def grpo(estimator: str = "mean", **loss: object) -> GRPOConfig:
    """The section as a run has it after load (which resolves importance_sampling's null)."""
    loss = {"importance_sampling": "none", **loss}
    return GRPOConfig(advantage=AdvantageConfig(estimator=estimator), loss=LossConfig(**loss))  # type: ignore[arg-type]


def t(x) -> Tensor:
    return torch.tensor(x, dtype=torch.float32)


# ----------------------------------------------------------------------------- used where the built-ins are


def test_should_subtract_the_users_baseline_when_the_advantage_estimator_is_a_module_function():
    name = f"{MOD}:half_mean_baseline"
    core_algos.check_algorithms(grpo(estimator=name))
    rewards = t([1.0, 0.0, 0.0, 1.0, 3.0, 1.0])  # two groups of 3: means 1/3 and 5/3
    adv = core_algos.compute_advantages(rewards, 3, estimator=name, normalize_std=False)
    assert torch.allclose(adv, t([1 - 1 / 6, -1 / 6, -1 / 6, 1 - 5 / 6, 3 - 5 / 6, 1 - 5 / 6]))


def test_should_read_the_estimator_from_the_config_when_a_run_loads_it():
    cfg = load(["experiment=tiny", f"grpo.advantage.estimator={MOD}:half_mean_baseline"])
    assert cfg.grpo.advantage_estimator == f"{MOD}:half_mean_baseline"
    assert load(["experiment=tiny", "grpo.use_leave_one_out_baseline=true"]).grpo.advantage_estimator == (
        "leave_one_out"
    )


def test_should_refuse_two_baselines_in_one_line_when_both_keys_choose_one():
    with pytest.raises(ConfigError) as e:
        load(["experiment=tiny", "grpo.use_leave_one_out_baseline=true", f"grpo.advantage.estimator={MOD}:x"])
    assert str(e.value).startswith("grpo.use_leave_one_out_baseline=true and grpo.advantage.estimator=")
    assert "\n" not in str(e.value)


def test_should_train_on_the_users_loss_and_kl_when_both_are_module_functions():
    loss_cfg = LossConfig(
        policy_loss=f"{MOD}:reinforce_loss",
        kl_estimator=f"{MOD}:squared_log_ratio",
        reference_policy_kl_penalty=0.5,
        kl_clamp=None,
        importance_sampling="none",
    )
    core_algos.check_loss_config(loss_cfg)
    objective = Objective(loss_cfg, max_len=3, kl_penalty=True)
    logprobs = t([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]]).requires_grad_(True)
    x = LossInputs(
        logprobs=logprobs,
        advantages=t([1.0, -2.0]),
        mask=t([[1, 1, 0], [1, 1, 1]]),
        num_tokens=5.0,
        num_seqs=2.0,
        ref_logprobs=logprobs.detach() - 0.2,  # (log pi - log pi_ref)^2 = 0.04 per token
    )
    loss, sums = objective(x)
    # on-policy, ratio 1: -A per token (1, 1 on the first response, -2 x 3 on the second) plus 0.5 * 0.04,
    # token-mean over 5
    assert loss.item() == pytest.approx((-1 * 2 + 2 * 3 + 0.5 * 0.04 * 5) / 5)
    assert sums["kl"].item() == pytest.approx(0.04 * 5) and sums["pg_clipfrac"].item() == 0
    loss.backward()  # d/dlogprobs: -A / 5 (the ratio's), plus 0.5 * 2 * 0.2 / 5 (the penalty's)
    assert torch.allclose(logprobs.grad, t([[-0.2 + 0.04, -0.2 + 0.04, 0], [0.44, 0.44, 0.44]]))


# ----------------------------------------------------------------------------- refused at start, in one line


@pytest.mark.parametrize(
    ("key", "name", "message"),
    [
        (
            "grpo.loss.policy_loss",
            "no_such_module_of_kuberl:loss",
            "grpo.loss.policy_loss: policy loss 'no_such_module_of_kuberl:loss': cannot import module "
            "'no_such_module_of_kuberl' (No module named 'no_such_module_of_kuberl')",
        ),
        (
            "grpo.loss.kl_estimator",
            f"{MOD}:NOT_CALLABLE",
            f"grpo.loss.kl_estimator: KL estimator '{MOD}:NOT_CALLABLE': module '{MOD}' has no callable "
            "'NOT_CALLABLE'",
        ),
        (
            "grpo.loss.policy_loss",
            f"{MOD}:two_argument_loss",
            f"grpo.loss.policy_loss={MOD}:two_argument_loss: cannot be called as a policy loss fn(logprobs, "
            "old_logprobs, advantages, *, ratio_clip_min, ratio_clip_max, ratio_clip_c, log_ratio) -> "
            "(loss (B, T), metrics): too many positional arguments",
        ),
        (
            "grpo.loss.policy_loss",
            f"{MOD}:per_sequence_loss",
            f"grpo.loss.policy_loss={MOD}:per_sequence_loss: returned a loss of shape (2,) for logprobs of "
            "shape (2, 3); a loss per token is (B, T)",
        ),
        (
            "grpo.loss.policy_loss",
            f"{MOD}:loss_without_ppo_kl",
            f"grpo.loss.policy_loss={MOD}:loss_without_ppo_kl: returned metrics['ppo_kl'] of a NoneType; the "
            "objective reads it per token, (B, T)",
        ),
        (
            "grpo.loss.kl_estimator",
            f"{MOD}:detached_kl",
            f"grpo.loss.kl_estimator={MOD}:detached_kl: returned a KL with no gradient to logprobs (detached): "
            "the penalty would train nothing",
        ),
        (
            "grpo.advantage.estimator",
            f"{MOD}:per_group_baseline",
            f"grpo.advantage.estimator={MOD}:per_group_baseline: returned shape (2, 1) for rewards of shape "
            "(2, 4); a baseline per reward is (N, G)",
        ),
        (
            "grpo.advantage.estimator",
            f"{MOD}:raising_baseline",
            f"grpo.advantage.estimator={MOD}:raising_baseline: raised on a small batch: ValueError: no "
            "baseline today",
        ),
        (
            "grpo.advantage.estimator",
            "median",
            "grpo.advantage.estimator='median' is not allowed; choose one of: mean, leave_one_out, "
            "module:function",
        ),
    ],
)
def test_should_name_the_key_in_one_line_when_a_users_function_cannot_serve(key, name, message):
    field = key.rpartition(".")[2]
    cfg = grpo(estimator=name) if field == "estimator" else grpo(**{field: name})
    with pytest.raises(ConfigError) as e:
        core_algos.check_algorithms(cfg)
    assert str(e.value) == message


def test_should_stop_before_ray_or_any_model_when_a_run_names_a_loss_that_breaks_the_contract(monkeypatch):
    from trainer import cluster, models, run

    def started(*args, **kwargs):
        raise AssertionError("the run got past its checks")

    monkeypatch.setattr(cluster, "init_ray", started)
    monkeypatch.setattr(models, "resolve_model", started)
    monkeypatch.setattr(run, "check_backend", started)
    cfg = load(["experiment=tiny", f"grpo.loss.policy_loss={MOD}:per_sequence_loss"])
    with pytest.raises(ConfigError, match=r"^grpo.loss.policy_loss=.*a loss per token is \(B, T\)$"):
        run.train(cfg)


def test_should_keep_the_builtins_as_they_were_when_no_module_function_is_named():
    cfg = grpo()
    core_algos.check_algorithms(cfg)
    assert dataclasses.replace(cfg, use_leave_one_out_baseline=True).advantage_estimator == "leave_one_out"
    assert core_algos.get_policy_loss("clipped") is core_algos.clipped_policy_loss
