"""Ulysses sequence parallelism against one rank, through the real PolicyWorker.

Two float32 ranks with ``policy.sequence_parallel_size=2`` (gloo, two processes, one group: each holds
half of every packed row) and one rank without it see the same length-skewed batch (the packing test's:
GRPO groups, an environment turn masked out, old, reference and engine logprobs away from the policy's,
so clipping, the KL and the importance weights all act). With the learning rate at 0 every call sees
the same weights and leaves its gradient in ``param.grad``. Logprobs (policy and reference), the loss,
every metric and every parameter's gradient must agree, for several aggregations, GSPO's sequence
ratio, activation checkpointing and token budgets; a row of odd length checks the padding.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.leftovers import wait_all
from tests.policy.helpers import skewed_samples  # the same length-skewed batch as the packing equality tests
from trainer.policy.batch import pack_batch
from trainer.policy.ulysses import slice_row
from trainer.ports import free_port

REPO = Path(__file__).resolve().parents[2]
RTOL, ATOL = 1e-5, 1e-6  # float32: the same terms summed in another order (attention, matmul shapes)

# (case name, policy.* overrides, grpo.loss.* overrides): each one training step.
CASES = [
    ("token-mean", {}, {"aggregation": "token-mean"}),
    ("seq-mean-token-mean", {}, {"aggregation": "seq-mean-token-mean"}),
    ("gspo", {}, {"ratio_level": "sequence"}),
    ("tis", {}, {"importance_sampling": "tis"}),
    ("budget", {"max_tokens_per_microbatch": 48}, {}),  # per rank: rows of up to 48 x ranks tokens
    ("checkpointing", {"activation_checkpointing": True}, {}),
]


def _rank_main(rank: int, world: int, port: int, model_path: str, out: str) -> None:
    """One policy rank: logprobs, then one step per case; rank 0 saves what it saw."""
    from trainer.config import load
    from trainer.policy.worker import PolicyWorker

    cfg = load(
        [
            "experiment=tiny",
            f"model.name={model_path}",
            f"cluster.cpu_workers_per_node={world}",
            f"policy.sequence_parallel_size={world}",
            "policy.max_grad_norm=null",
            "policy.micro_batch_size=5",
            "policy.logprob_micro_batch_size=5",
            "grpo.loss.reference_policy_kl_penalty=0.1",
            "grpo.loss.ratio_clip_min=0.2",
            "grpo.loss.ratio_clip_max=0.2",
        ]
    )
    w = PolicyWorker(cfg, model_path, rank=rank, world_size=world, colocated_engine=False)
    w.setup("127.0.0.1", port)
    w.scheduler.base_lrs = [0.0] * len(w.scheduler.base_lrs)  # the weights stay; param.grad keeps each step's
    for group in w.optimizer.param_groups:
        group["lr"] = 0.0
    samples = skewed_samples()
    tokens = float(sum(sum(s.response_mask) for s in samples))
    saved: dict = {
        "logprobs": w.compute_logprobs(samples),
        "ref": w.compute_logprobs(samples, reference=True),
    }
    for name, policy, loss in CASES:
        before = {k: getattr(w.cfg.policy, k) for k in policy} | {
            k: getattr(w.cfg.grpo.loss, k) for k in loss
        }
        for k, v in policy.items():
            setattr(w.cfg.policy, k, v)
        for k, v in loss.items():
            setattr(w.cfg.grpo.loss, k, v)
        if policy.get("activation_checkpointing"):
            w.model.gradient_checkpointing_enable()
        metrics = w.train([samples], [{"tokens": tokens, "seqs": float(len(samples))}])
        grads = {n: p.grad.full_tensor().clone() for n, p in w.model.named_parameters()}  # collective
        if policy.get("activation_checkpointing"):
            w.model.gradient_checkpointing_disable()
        for k, v in before.items():
            setattr(w.cfg.policy if k in policy else w.cfg.grpo.loss, k, v)
        saved[name] = (metrics, grads)
    if rank == 0:
        torch.save(saved, out)
    w.shutdown()


@pytest.fixture(scope="module")
def runs(tiny_model_path, tmp_path_factory) -> dict[int, dict]:
    """{1: one rank's results, 2: rank 0's of two sequence-parallel ranks}; all three processes at once."""
    tmp = tmp_path_factory.mktemp("ulysses")
    procs, outs = [], {}
    for world in (1, 2):
        port, outs[world] = free_port("127.0.0.1"), tmp / f"world{world}.pt"
        for rank in range(world):
            code = (
                f"from tests.policy.test_ulysses import _rank_main; _rank_main({rank}, {world}, {port}, "
                f"{tiny_model_path!r}, {str(outs[world])!r})"
            )
            procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=REPO))
    codes = wait_all(procs, timeout=400)
    assert codes == [0] * len(procs), "a rank failed (its output is above)"
    return {world: torch.load(out) for world, out in outs.items()}


def test_should_give_one_ranks_logprobs_when_two_ranks_split_each_row(runs):
    for key in ("logprobs", "ref"):
        one, two = runs[1][key], runs[2][key]
        assert [len(x) for x in one] == [len(x) for x in two]
        for a, b in zip(one, two):
            torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=RTOL, atol=ATOL, msg=key)


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_should_give_one_ranks_loss_and_gradients_when_two_ranks_split_each_row(runs, case):
    (m1, g1), (m2, g2) = runs[1][case], runs[2][case]
    assert m1.keys() == m2.keys()
    for key in m1:
        assert m2[key] == pytest.approx(m1[key], rel=RTOL, abs=ATOL), key
    assert m1["grad_norm"] > 0 and m1["kl"] > 0
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], rtol=RTOL, atol=ATOL, msg=name)


def test_should_pad_the_row_to_the_ranks_and_keep_every_predicted_position_once_when_sliced():
    batch = pack_batch(
        skewed_samples()[:3], pad_id=0
    )  # 3 samples of 4 + (1, 23, 6) tokens = 42: 2 pad at 4 ranks
    total = batch.input_ids.shape[1]
    slices = [slice_row(batch, 4, r) for r in range(4)]
    row = slices[0][0]
    assert row.cu_seqlens.tolist() == [*batch.cu_seqlens.tolist(), 44] and row.bounds[-1] == (42, 44)
    assert torch.cat([s[1][0] for s in slices])[:total].tolist() == batch.input_ids[0].tolist()
    assert torch.cat([s[2][0] for s in slices])[:total].tolist() == batch.position_ids[0].tolist()
    # each rank's predicted positions, shifted back to the row, are the row's, in order, once
    again = torch.cat([s[3] + r * 11 for r, s in enumerate(slices)])
    assert again.tolist() == batch.predict.tolist()
    assert all(s[4] == [len(x[3]) for x in slices] for s in slices)
