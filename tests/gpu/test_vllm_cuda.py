"""vLLM on CUDA, colocated and disaggregated: the engine alone, then the trainer end to end.

Engine tests run each engine in a fresh process (a clean CUDA context, so free memory measures the engine):

- colocated: sleep mode on, 0.6 of the GPU. Asleep, the GPU is free again; the refit's order (weights
  woken, new weights loaded, KV cache still asleep, then woken) leaves the memory where it was and the
  engine samples from the new weights.
- alone on its GPU (disaggregated, evaluation): sleep mode off (no cumem allocator), 0.9 of the GPU.

The end-to-end runs go through ``python -m trainer`` (Ray actors with GPUs, FSDP2 over NCCL, vLLM with CUDA
graphs) for a few steps of the tiny experiment: colocated on one GPU, and disaggregated on two (policy on
one, the engine on the other, the weights over the disaggregated weight transfer). The engine-vs-policy
logprob gap after each refit must stay small: a refit that lost or garbled weights shows there first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from .conftest import REPO, need, needs_gpus

pytestmark = pytest.mark.gpu

BF16_TOL = 0.05  # max |bf16 engine logprob - float32 transformers logprob| on the tiny model (not yet measured on a GPU)

ENGINE = """
import json, sys, torch
from transformers import AutoModelForCausalLM
from trainer.config import GenerationConfig
from trainer.generation.base import SamplingParams
from trainer.generation.vllm_engine import VLLMGenerationEngine

model_path, colocated, out = sys.argv[1], sys.argv[2] == "colocated", sys.argv[3]
prompt = [2, 5, 6, 7, 8, 9, 10]
reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).cuda().eval()

def gap(engine):
    (c,), = engine.generate([prompt], 1, SamplingParams(max_new_tokens=8, temperature=1.0, seed=3))
    ids = torch.tensor([prompt + c.token_ids], device="cuda")
    with torch.no_grad():
        logits = reference(ids).logits[0, len(prompt) - 1 : -1].float()
    expected = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt):, None])[:, 0].cpu()
    return (expected - torch.tensor(c.logprobs)).abs().max().item()

def free():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]

total = torch.cuda.mem_get_info()[1]
result = {}
engine = VLLMGenerationEngine(model_path, GenerationConfig(enforce_eager=True), "bfloat16", seed=0,
                              max_model_len=256, colocated=colocated)
try:
    vllm_config = engine._llm.llm_engine.vllm_config
    result["sleep_mode"] = bool(vllm_config.model_config.enable_sleep_mode)
    result["utilization"] = vllm_config.cache_config.gpu_memory_utilization
    result["gap"] = gap(engine)
    if colocated:
        awake = free()
        engine.sleep()
        asleep = free()
        engine.wake_up(tags=["weights"])
        torch.manual_seed(0)
        new = {n: p.detach() + (0.1 if "embed" in n else 0.02) * torch.randn_like(p) for n, p in reference.named_parameters()}
        with torch.no_grad():
            for n, p in reference.named_parameters():
                p.copy_(new[n])
        engine.update_weights(iter(new.items()))
        loaded = free()
        engine.wake_up(tags=["kv_cache"])
        woken = free()
        result.update(freed=(asleep - awake) / total, loaded=(asleep - loaded) / total,
                      woken=(woken - awake) / total, gap_after_refit=gap(engine))
finally:
    engine.shutdown()
with open(out, "w") as f:
    json.dump(result, f)
"""


@pytest.fixture
def tiny(request) -> str:
    need("transformers", "the tests' model and reference are transformers models")
    need("vllm", "the job image's [vllm] extra")
    return request.getfixturevalue("tiny_model_path")  # after the checks: building it needs transformers


def _engine(tiny: str, placement: str, tmp_path) -> dict:
    out = tmp_path / f"{placement}.json"
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(ENGINE), tiny, placement, str(out)],
        cwd=REPO,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"},
        timeout=600,
    )
    assert proc.returncode == 0, "the engine process failed (its output is above)"
    return json.loads(out.read_text())


@needs_gpus(1)
def test_should_free_the_gpu_asleep_and_refit_with_the_kv_cache_asleep_when_the_engine_is_colocated(
    tiny, tmp_path
):
    got = _engine(tiny, "colocated", tmp_path)
    assert got["sleep_mode"] and got["utilization"] == 0.6
    assert got["gap"] < BF16_TOL
    assert (
        got["freed"] > 0.3
    )  # the engine held 0.6 of the GPU, nearly all of it KV cache; asleep, next to none
    assert got["loaded"] < 0.05  # weights woken and new ones loaded: the KV cache is still asleep
    assert abs(got["woken"]) < 0.05  # all woken: where it was before sleeping
    assert got["gap_after_refit"] < BF16_TOL  # samples from the new weights


@needs_gpus(1)
def test_should_start_without_sleep_mode_and_take_most_of_the_gpu_when_the_engine_has_it_alone(
    tiny, tmp_path
):
    got = _engine(tiny, "disaggregated", tmp_path)
    assert not got["sleep_mode"] and got["utilization"] == 0.9
    assert got["gap"] < BF16_TOL


# ----- end to end: python -m trainer ----------------------------------------------------------------------


def _train(tmp_path, gpus: int, *overrides: str) -> dict[str, list[float]]:
    need("ray", "the trainer's actors")
    need("hydra", "the trainer's config")
    need("tensorboard", "reading the run's scalars")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logs = tmp_path / "logs"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer",
            "experiment=tiny",
            "generation=vllm",
            "generation.dtype=bfloat16",
            "grpo.max_num_steps=4",
            "checkpointing.enabled=false",
            f"logger.log_dir={logs}",
            *overrides,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,
        # A private Ray instance on this machine, never the cluster a KubeRay pod's RAY_ADDRESS names.
        env={
            **{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
            "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(gpus))),
        },
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = list((logs / "tiny").iterdir())
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@needs_gpus(1)
def test_should_train_with_a_small_engine_policy_gap_after_every_refit_when_colocated_on_one_gpu(
    tiny, tmp_path
):
    scalars = _train(tmp_path, 1, "cluster.gpus_per_node=1", "cluster.cpu_workers_per_node=0")
    gaps = scalars["train/gen_logprob_abs_diff"]
    assert len(gaps) == 4 and max(gaps) < BF16_TOL, gaps


@needs_gpus(2)
def test_should_train_with_a_small_engine_policy_gap_after_every_refit_when_disaggregated_on_two_gpus(
    tiny, tmp_path
):
    # Two one-GPU "nodes" on this machine: the policy's and the engine's (Ray packs both bundles here).
    scalars = _train(
        tmp_path,
        2,
        "cluster.num_nodes=2",
        "cluster.gpus_per_node=1",
        "cluster.cpu_workers_per_node=0",
        "generation.placement=disaggregated",
        "generation.resources.num_nodes=1",
        "generation.resources.gpus_per_node=1",
    )
    gaps = scalars["train/gen_logprob_abs_diff"]
    assert len(gaps) == 4 and max(gaps) < BF16_TOL, gaps
