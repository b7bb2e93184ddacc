"""A GPU rank built on the meta device (:mod:`trainer.policy.sharded_init`): ``to_empty`` on CUDA, rank 0's
tensors, buffers and random state broadcast over NCCL. One rank in this process (NCCL world of 1), against
the whole model moved to the GPU and then sharded: shards, buffers, random state and the logprobs of the
policy and the reference equal bit for bit (the CPU test, ``tests/policy/test_sharded_init.py``, runs two
ranks over gloo)."""

from __future__ import annotations

import pytest

from .conftest import free_port, need, needs_gpus

pytestmark = pytest.mark.gpu

CASES = {
    "float32-reference": {},
    "bfloat16-lora": {"model": {"dtype": "bfloat16"}, "policy": {"lora": {"rank": 4}}},
}


@needs_gpus(1)
@pytest.mark.parametrize("case", list(CASES))
def test_should_hold_the_whole_models_shards_and_logprobs_when_a_gpu_rank_is_built_on_the_meta_device(
    request, case
):
    need("transformers", "the policy is a transformers model")
    if "lora" in case:
        need("peft", "LoRA adapters")
    import torch.distributed as dist

    from tests.policy.sharded_checks import check, compare
    from trainer.config import from_dictconfig
    from trainer.policy.worker import PolicyWorker

    if dist.is_initialized():
        pytest.skip("this process already has a torch.distributed world")
    tiny = request.getfixturevalue("tiny_model_path")
    extra = CASES[case]
    cfg = from_dictconfig({
        "model": {"name": tiny, **extra.get("model", {})},
        "cluster": {"num_nodes": 1, "gpus_per_node": 1},
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 4, "max_num_steps": 1,
                 "loss": {"reference_policy_kl_penalty": 0.1}},
        "policy": {"micro_batch_size": 8, "max_total_sequence_length": 96, **extra.get("policy", {})},
        "generation": {"backend": "hf", "max_new_tokens": 4},
    })  # fmt: skip
    w = PolicyWorker(cfg, tiny, rank=0, world_size=1, colocated_engine=False)
    try:
        w.setup("127.0.0.1", free_port())
        assert dist.get_backend() == "nccl" and next(w.model.parameters()).device.type == "cuda"
        check(compare(w), case, lora="lora" in case)
    finally:
        w.shutdown()
