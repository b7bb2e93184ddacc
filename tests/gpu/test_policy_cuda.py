"""FSDP2 training and the hf engine on CUDA, through the real PolicyWorker (no Ray: plain processes).

With torch alone: a plain-torch model sharded as a rank shards the policy takes an optimizer step equal to
the unsharded model's, and the refit's gather (one FSDP unit at a time, over NCCL) yields its full weights.
With transformers: one rank in this process: NCCL world of 1, the policy sharded with FSDP2 on the GPU, a colocated hf engine
on the same GPU. It generates, computes logprobs (checked against a plain transformers forward on the
GPU), trains a step, refits the engine (the real ``torch.cuda.empty_cache`` and gather one FSDP unit at a
time) and the engine then holds exactly the trained weights. Two ranks, when there are two GPUs: each a
process with its own GPU (``CUDA_VISIBLE_DEVICES``, as Ray gives each actor one), and the data-parallel
step must match the single rank's loss and gradient norm.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.leftovers import wait_all

from .conftest import REPO, free_port, need, needs_gpus
from .torch_lm import TorchLM

pytestmark = pytest.mark.gpu

# The same config in this process and in the two-rank subprocesses (no Hydra: a GPU image may lack it).
CONFIG = """
from trainer.config import from_dictconfig

def gpu_config(model_path, world):
    return from_dictconfig({
        "model": {"name": model_path},
        "cluster": {"num_nodes": 1, "gpus_per_node": world},
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 4, "max_num_steps": 1},
        "policy": {"learning_rate": 1e-2, "warmup_steps": 0, "micro_batch_size": 8, "max_total_sequence_length": 96},
        "generation": {"backend": "hf", "max_new_tokens": 4},
    })
"""

SAMPLES = """
import torch
from trainer.policy.batch import Sample

def samples():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 50, (5 + i,), generator=g).tolist() for i in range(2)]
    return [Sample(prompts[i // 4], torch.randint(4, 50, (2 + i % 4,), generator=g).tolist(),
                   advantage=float(i % 4) - 1.5) for i in range(8)]

def counts(samples):
    return [{"tokens": float(sum(len(s.response_ids) for s in samples)), "seqs": float(len(samples))}]
"""

RANK = """
import json, sys, torch
from trainer.policy.worker import PolicyWorker

rank, world, port, model_path, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
w = PolicyWorker(gpu_config(model_path, world), model_path, rank=rank, world_size=world, colocated_engine=False)
try:
    w.setup("127.0.0.1", int(port))
    batch = samples()
    metrics = w.train([batch[rank::world]], counts(batch))
    with open(out, "w") as f:
        json.dump({"loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "device": str(w.device)}, f)
finally:
    w.shutdown()
"""


def _namespace() -> dict:
    scope: dict = {}
    exec(textwrap.dedent(CONFIG) + textwrap.dedent(SAMPLES), scope)
    return scope


@pytest.fixture
def tiny(request) -> str:
    need("transformers", "the policy is a transformers model")
    return request.getfixturevalue("tiny_model_path")  # after the check: building it needs transformers


@needs_gpus(1)
def test_should_step_as_the_unsharded_model_and_gather_unit_by_unit_when_fsdp2_shards_a_torch_model_on_a_gpu():
    """Torch alone: the rank's sharding (``shard_model``), fused AdamW and the refit's gather
    (``iter_full_weights``, one unit at a time over NCCL) on CUDA, against the same model unsharded."""
    import copy

    import torch.distributed as dist

    from trainer.config import Config
    from trainer.policy.worker import PolicyWorker, adamw, shard_model

    if dist.is_initialized():
        pytest.skip("this process already has a torch.distributed world")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        reference = TorchLM().cuda()
        model = copy.deepcopy(reference)
        shard_model(model, reshard_after_forward=True, mp_dtype=None)
        ids = torch.randint(0, 64, (4, 16), device="cuda")
        for m in (reference, model):
            optimizer = adamw(m.parameters(), lr=1e-2)
            logits = m(ids[:, :-1])
            torch.nn.functional.cross_entropy(logits.reshape(-1, 64), ids[:, 1:].reshape(-1)).backward()
            optimizer.step()
        # The refit's gather, from the real method, over this model (a rank without its set-up).
        rank = PolicyWorker.__new__(PolicyWorker)
        rank.cfg, rank.model = Config(), model
        kept = list(rank.iter_full_weights())  # every tensor held to the end, as a bucketing sender may
        expected = dict(reference.named_parameters())
        assert sorted(n for n, _ in kept) == sorted(expected)
        for name, tensor in kept:
            assert tensor.device.type == "cuda" and not hasattr(tensor, "full_tensor")
            assert torch.allclose(tensor, expected[name], atol=1e-6), name
    finally:
        dist.destroy_process_group()


def _logprobs_of(model, samples) -> list[torch.Tensor]:
    out = []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids], device="cuda")
        with torch.no_grad():
            logits = model(ids).logits[0, :-1].float()
        out.append(
            torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0][len(s.prompt_ids) - 1 :].cpu()
        )
    return out


@needs_gpus(1)
def test_should_train_score_and_refit_the_hf_engine_on_one_gpu_when_the_rank_runs_fsdp2_over_nccl(tiny):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from trainer.generation.base import SamplingParams
    from trainer.policy.worker import PolicyWorker

    if dist.is_initialized():
        pytest.skip("this process already has a torch.distributed world")
    ns = _namespace()
    w = PolicyWorker(ns["gpu_config"](tiny, 1), tiny, rank=0, world_size=1, colocated_engine=True)
    try:
        w.setup("127.0.0.1", free_port())
        assert dist.get_backend() == "nccl" and w.engine.device.type == "cuda"
        out = w.generate([[2, 5, 6], [2, 7]], 2, SamplingParams(max_new_tokens=4, seed=0))
        assert [len(group) for group in out] == [2, 2] and all(
            1 <= len(c.token_ids) <= 4 for g in out for c in g
        )

        samples = ns["samples"]()
        reference = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).cuda().eval()
        for got, expected in zip(w.compute_logprobs(samples), _logprobs_of(reference, samples)):
            assert torch.allclose(torch.tensor(got), expected, atol=1e-4)

        before = w.full_state_dict()
        metrics = w.train([samples], ns["counts"](samples))
        assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["grad_norm"] > 0
        after = w.full_state_dict()
        assert any(not torch.equal(before[k], after[k]) for k in after)  # the step moved the weights

        w.refresh_engine()
        engine = w.engine_state_dict()
        for name, tensor in after.items():
            assert torch.equal(engine[name], tensor.to(w.engine_dtype)), name
        w.generate(
            [[2, 5, 6]], 2, SamplingParams(max_new_tokens=4, seed=0)
        )  # the refit engine still generates
    finally:
        w.shutdown()


@needs_gpus(2)
def test_should_match_one_rank_when_two_gpus_split_the_batch_over_fsdp2(tiny, tmp_path):
    script = textwrap.dedent(CONFIG) + textwrap.dedent(SAMPLES) + textwrap.dedent(RANK)

    def run(world: int) -> list[dict]:
        port, outs = free_port(), [tmp_path / f"world{world}-rank{r}.json" for r in range(world)]
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", script, str(r), str(world), str(port), tiny, str(outs[r])],
                cwd=REPO,
                env={**os.environ, "CUDA_VISIBLE_DEVICES": str(r)},
            )
            for r in range(world)
        ]
        codes = wait_all(procs, timeout=300)
        assert codes == [0] * world, "a rank failed (its output is above)"
        return [json.loads(o.read_text()) for o in outs]

    (one,) = run(1)
    two = run(2)
    assert one["device"] == "cuda:0"
    for rank in two:
        assert rank["loss"] == pytest.approx(one["loss"], rel=1e-4, abs=1e-6)
        assert rank["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)


# Ulysses: both ranks get the whole batch and each holds half of every packed row (one GPU each, NCCL).
SP_RANK = """
import json, sys
from trainer.policy.worker import PolicyWorker

rank, world, port, model_path, out, attn = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4],
                                            sys.argv[5], sys.argv[6])
cfg = gpu_config(model_path, world)
cfg.policy.sequence_parallel_size, cfg.model.attn_implementation = world, attn
w = PolicyWorker(cfg, model_path, rank=rank, world_size=world, colocated_engine=False)
try:
    w.setup("127.0.0.1", int(port))
    batch = samples()
    logprobs = w.compute_logprobs(batch)
    metrics = w.train([batch], counts(batch))
    with open(out, "w") as f:
        json.dump({"loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "logprobs": logprobs}, f)
finally:
    w.shutdown()
"""


@needs_gpus(2)
@pytest.mark.parametrize("attn", ["sdpa", "flash_attention_2"])
def test_should_match_one_gpu_when_two_gpus_split_every_row_with_sequence_parallelism(tiny, tmp_path, attn):
    if attn.startswith("flash"):
        need("flash_attn", "flash attention's varlen kernel")
    script = textwrap.dedent(CONFIG) + textwrap.dedent(SAMPLES) + textwrap.dedent(SP_RANK)

    def run(world: int) -> dict:
        port, outs = free_port(), [tmp_path / f"sp-{attn}-world{world}-rank{r}.json" for r in range(world)]
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", script, str(r), str(world), str(port), tiny, str(outs[r]), attn],
                cwd=REPO,
                env={**os.environ, "CUDA_VISIBLE_DEVICES": str(r)},
            )
            for r in range(world)
        ]
        codes = wait_all(procs, timeout=300)
        assert codes == [0] * world, "a rank failed (its output is above)"
        return json.loads(outs[0].read_text())

    one, two = run(1), run(2)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-4, abs=1e-6)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
    for a, b in zip(one["logprobs"], two["logprobs"]):
        assert torch.allclose(torch.tensor(b), torch.tensor(a), atol=1e-4)
