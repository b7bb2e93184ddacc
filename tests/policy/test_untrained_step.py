"""A step that trained on no token reports no mean over tokens, through the real PolicyWorker and the step report.

Every group flat and skipped (``policy.skip_zero_advantage``: the rank gets an empty mini-batch while the
driver's counts still hold the skipped samples) or every sample's loss mask empty: nothing was measured, so the
engine's gap (``train/gen_logprob_abs_diff``, ``train/gen_train_kl``), the correction's flags, the clip fraction,
PPO's KL, the penalised KL and the entropy are absent, not 0.0 (a perfect match on a dashboard) and not NaN (a
broken line in a tracker). One float32 rank (gloo, in this process) with a reference model and engine logprobs,
so that every one of those metrics is reported on a step that does train (the control).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from tests.policy.helpers import one_rank_worker
from trainer.policy.batch import Sample
from trainer.step_report import step_metrics

MEANS = {"ppo_kl", "pg_clipfrac", "kl", "entropy", "gen_logprob_abs_diff", "gen_train_kl", "is_flagged"}
REPORTED = {
    "train/ppo_kl",
    "train/pg_clipfrac",
    "train/kl",
    "train/entropy",
    "train/gen_logprob_abs_diff",
    "train/gen_train_kl",
    "train/is_flagged_frac",
}


@pytest.fixture(scope="module")
def worker(tiny_model_path):
    overrides = [
        "grpo.loss.reference_policy_kl_penalty=0.1",
        "grpo.loss.importance_sampling=tis",
        "policy.compute_entropy=true",
    ]
    with one_rank_worker(tiny_model_path, overrides) as w:
        yield w


def _samples(masked: bool) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    return [
        Sample(
            torch.randint(4, 30, (4,), generator=g).tolist(),
            [5, 6, 7],
            advantage=float(i % 2) - 0.5,
            ref_logprobs=[-3.0, -3.0, -3.0],
            gen_logprobs=[-3.0, -3.0, -3.0],
            response_mask=[0, 0, 0] if masked else [1, 1, 1],
        )
        for i in range(4)
    ]


def _report(cfg, train_metrics: dict[str, float]) -> dict[str, float]:
    """The step's scalars as the loop reports them, for 4 rollouts that all scored 0.5."""
    rollouts = [
        SimpleNamespace(
            model_tokens=3,
            turns=1,
            reward=SimpleNamespace(correct=False, scores={"math": 0.5}),
            completion=SimpleNamespace(finish_reason="stop"),
        )
        for _ in range(4)
    ]
    reward = torch.full((4,), 0.5)
    return step_metrics(
        cfg, rollouts, reward, torch.zeros(4), None, train_metrics, {"generation_s": 1.0}, {}, {}
    )


@pytest.mark.parametrize(
    ("case", "minibatch", "counts"),
    [
        ("every group flat and skipped", [], {"tokens": 12.0, "seqs": 4.0}),
        ("every loss mask empty", _samples(masked=True), {"tokens": 0.0, "seqs": 4.0}),
    ],
)
def test_should_report_no_mean_over_tokens_when_a_step_trained_on_no_token(worker, case, minibatch, counts):
    trained = worker.train([_samples(masked=False)], [{"tokens": 12.0, "seqs": 4.0}])  # the control
    assert MEANS <= trained.keys() and REPORTED <= _report(worker.cfg, trained).keys()

    metrics = worker.train([minibatch], [counts])
    assert not MEANS & metrics.keys(), (case, metrics)
    # The loss and the zero gradient applied are measured; an empty mask's 0/0 once made both NaN, and the
    # optimizer wrote NaN into every weight.
    assert metrics["loss"] == 0.0 and metrics["grad_norm"] == 0.0, (case, metrics)
    assert all(bool(torch.isfinite(p.full_tensor()).all()) for p in worker.model.parameters())
    report = _report(worker.cfg, metrics)
    assert not REPORTED & report.keys(), (case, sorted(REPORTED & report.keys()))
    assert not [k for k, v in report.items() if not math.isfinite(v)]
