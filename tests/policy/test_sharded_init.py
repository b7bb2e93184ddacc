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
from tests.policy.sharded_checks import check, compare
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
