"""Precision follows the hardware: cpu-demo's engine and policy on a CPU without native bfloat16.

The probes of :mod:`trainer.hardware` are replaced in the driver, where ``auto`` is resolved, so
these tests take the AVX2-only path on any machine; with explicit bfloat16 the workers then run it
emulated, and on an AVX2-only CPU their engines meet the real oneDNN refusal and keep the plain forward.
"""

from __future__ import annotations

import math

import pytest
import ray

from trainer import hardware
from trainer.config import load
from trainer.generation.base import SamplingParams
from trainer.policy.batch import Sample

pytestmark = pytest.mark.slow


def test_should_describe_the_cpu_in_one_phrase():
    line = hardware.describe()
    assert hardware.cpu_model() in line and "bfloat16" in line and "\n" not in line


@pytest.mark.parametrize("precision", ["auto", "bfloat16"])
def test_should_generate_and_train_when_cpu_demo_runs_on_a_cpu_without_native_bf16(
    ray_local, monkeypatch, precision
):
    from trainer.generation.placement import ColocatedGenerator
    from trainer.models import load_tokenizer, resolve_model
    from trainer.policy.group import PolicyGroup

    monkeypatch.setattr(hardware, "native_bf16", lambda: False)
    explicit = ["policy.param_dtype=bfloat16", "generation.dtype=bfloat16"] if precision == "bfloat16" else []
    cfg = load(
        [
            "experiment=cpu-demo",
            "cluster.cpu_workers_per_node=1",
            "grpo.num_prompts_per_step=2",
            "grpo.num_generations_per_prompt=2",
            "policy.micro_batch_size=4",
            "policy.logprob_micro_batch_size=4",
            "generation.max_new_tokens=6",
            *explicit,
        ]
    )
    expected = ("bfloat16", "bfloat16") if explicit else (None, "float32")
    assert (cfg.policy.param_dtype, cfg.engine_dtype) == expected
    model_path = resolve_model(cfg.model.name)
    tokenizer = load_tokenizer(model_path)
    prompts = [tokenizer(q).input_ids for q in ("What is 2+3?", "What is 7+1?")]
    group = PolicyGroup(cfg, model_path, colocated_engine=True)
    try:
        generator = ColocatedGenerator(group)
        params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=0)
        samples = []
        for ref, idx in generator.submit(prompts, 2, params):
            for i, completions in zip(idx, ray.get(ref)):
                for j, c in enumerate(completions):
                    assert len(c.token_ids) == len(c.logprobs) >= 1
                    samples.append(Sample(prompts[i], c.token_ids, advantage=1.0 if j == 0 else -1.0))
        metrics = group.train(samples)
        assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
        generator.update_weights()  # the engine takes the new weights (repacking where it packed)
    finally:
        group.shutdown()
