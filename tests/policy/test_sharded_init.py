"""A policy rank built on the meta device and loaded shard by shard equals one that loaded the whole model.

Two gloo ranks run the real ``PolicyWorker.setup`` (meta device, ``fully_shard``, ``to_empty``, rank 0's
weights broadcast one tensor at a time: :mod:`trainer.policy.sharded_init`) and, beside it in the same
process group, the way a rank loaded before: the whole model read, moved to the device, then sharded.
Every local shard, every buffer (the rotary ``inv_freq`` is non-persistent: in no state dict), the
random state after set-up and the logprobs of the policy and of the reference must be equal, bit for bit:
float32 with a KL reference, and a bfloat16 base with LoRA adapters (lora-gemma3-27b-gsm8k's shape).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.leftovers import wait_all
from tests.policy.helpers import skewed_samples
from trainer.ports import free_port

REPO = Path(__file__).resolve().parents[2]

CASES = {
    "float32-reference": ["grpo.loss.reference_policy_kl_penalty=0.1"],
    "bfloat16-lora": [
        "model.dtype=bfloat16",
        "policy.lora.rank=4",
        "grpo.loss.reference_policy_kl_penalty=0.1",
    ],
}


def _whole_then_sharded(w, attn: str | None = None) -> torch.nn.Module:
    """How a rank built its model before: loaded whole (adapters drawn right after the seed), then sharded."""
    from trainer.models import load_model
    from trainer.policy import packed_attention
    from trainer.policy.worker import shard_model

    cfg = w.cfg
    model = load_model(w.model_path, cfg.model.dtype, False, attn)
    if attn is None and w.lora is not None:
        from trainer.models import lora

        lora.apply(model, w.lora)
    if attn is None and cfg.model.attn_implementation:
        model.set_attn_implementation(cfg.model.attn_implementation)
    if w.attention is not None:
        packed_attention.install(model, cfg.model.attn_implementation or "sdpa", w.sp)
    model.config.use_cache = False
    model.to(w.device)
    shard_model(model, cfg.policy.reshard_after_forward if attn is None else True, None)
    return model


def compare(w) -> dict:
    """``w`` (a set-up PolicyWorker) against the whole-model path, in the same process group: what
    differs, as booleans and lists (empty: nothing). Collective (every rank calls it)."""
    rng_after_setup = torch.get_rng_state()
    torch.manual_seed(
        w.cfg.seed
    )  # as set-up seeded: then the policy's load, its adapters, the reference's load
    old = _whole_then_sharded(w)
    old_ref = (
        _whole_then_sharded(w, w.cfg.model.attn_implementation or "sdpa") if w.ref_model is not None else None
    )
    rng_old = torch.get_rng_state()
    mismatched = [
        n
        for (n, p), (_, q) in zip(w.model.named_parameters(), old.named_parameters())
        if p.to_local().dtype != q.to_local().dtype or not torch.equal(p.to_local(), q.to_local())
    ]
    names = [n for n, _ in w.model.named_parameters()] == [n for n, _ in old.named_parameters()]
    buffers = {n: torch.equal(b, dict(old.named_buffers())[n]) for n, b in w.model.named_buffers()}
    if w.ref_model is not None:
        mismatched += [
            f"ref:{n}"
            for (n, p), (_, q) in zip(w.ref_model.named_parameters(), old_ref.named_parameters())
            if not torch.equal(p.to_local(), q.to_local())
        ]
    samples = skewed_samples()
    new_lp, new_ref = w.compute_logprobs(samples), w.compute_logprobs(samples, reference=True)
    w.model, w.ref_model = old, (old_ref if old_ref is not None else w.ref_model)
    old_lp, old_ref_lp = w.compute_logprobs(samples), w.compute_logprobs(samples, reference=True)
    return {
        "names": names,
        "mismatched": mismatched,
        "buffers": buffers,
        "rng": torch.equal(rng_after_setup, rng_old),
        "logprobs": new_lp == old_lp,
        "ref_logprobs": new_ref == old_ref_lp,
        "adapters": sum(1 for n, _ in w.model.named_parameters() if ".lora_" in n),
    }


def check(result: dict, what: str, lora: bool) -> None:
    assert result["names"], f"{what}: another module tree"
    assert result["mismatched"] == [], f"{what}: shards differ"
    assert result["buffers"] and all(result["buffers"].values()), (
        f"{what}: buffers differ: {result['buffers']}"
    )
    assert result["logprobs"] and result["ref_logprobs"], f"{what}: logprobs differ"
    assert result["rng"], f"{what}: the random state after set-up differs"
    assert (result["adapters"] > 0) == lora


def _rank_main(rank: int, port: int, model_path: str, case: str, out: str) -> None:
    from trainer.config import load
    from trainer.policy.worker import PolicyWorker

    cfg = load(
        ["experiment=tiny", f"model.name={model_path}", "cluster.cpu_workers_per_node=2", *CASES[case]]
    )
    w = PolicyWorker(cfg, model_path, rank=rank, world_size=2, colocated_engine=False)
    w.setup("127.0.0.1", port)
    torch.save(compare(w), f"{out}.{rank}")
    w.shutdown()


@pytest.fixture(scope="module")
def results(tiny_model_path, tmp_path_factory) -> dict[str, list[dict]]:
    """Each case's two ranks' results; one case's two processes at a time."""
    tmp = tmp_path_factory.mktemp("sharded_init")
    found = {}
    for case in CASES:
        port, out = free_port("127.0.0.1"), tmp / case
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    f"from tests.policy.test_sharded_init import _rank_main; "
                    f"_rank_main({rank}, {port}, {tiny_model_path!r}, {case!r}, {str(out)!r})",
                ],
                cwd=REPO,
            )
            for rank in range(2)
        ]
        assert wait_all(procs, timeout=300) == [0, 0], f"{case}: a rank failed (its output is above)"
        found[case] = [torch.load(f"{out}.{rank}") for rank in range(2)]
    return found


@pytest.mark.parametrize("case", list(CASES))
def test_should_hold_the_whole_models_shards_logprobs_and_random_state_when_ranks_are_built_on_the_meta_device(
    results, case
):
    for rank, result in enumerate(results[case]):
        check(result, f"rank {rank}", lora="lora" in case)
