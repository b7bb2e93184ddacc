"""Config composition for every experiment, and one-line errors for bad values."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from trainer.config import ConfigError, experiments, load

from .conftest import REPO


@pytest.mark.parametrize("name", experiments())
def test_should_compose_and_validate_when_experiment_is_shipped(name):
    cfg = load([f"experiment={name}"])
    assert cfg.experiment_name == name
    assert cfg.train_world_size >= 1
    assert cfg.grpo.batch_size % (cfg.train_world_size * cfg.grpo.num_minibatches) == 0


def test_should_match_runbook_shapes_when_gpu_experiments_compose():
    g27 = load(["experiment=gemma3-27b-gsm8k"])
    assert (g27.cluster.num_nodes, g27.cluster.gpus_per_node) == (3, 8)
    assert g27.disaggregated and g27.generation.tensor_parallel_size == 8
    assert g27.train_world_size == 16 and g27.num_generation_workers == 1
    assert (g27.grpo.num_prompts_per_step, g27.grpo.num_generations_per_prompt) == (16, 64)
    g1 = load(["experiment=gemma3-1b-math"])
    assert g1.generation.vllm_kwargs == {"block_size": 32} and not g1.disaggregated
    assert g1.train_world_size == 8 and g1.model.name == "google/gemma-3-1b-it"
    q = load(["experiment=qwen2.5-coder-7b-code"])
    assert (q.grpo.num_prompts_per_step, q.grpo.num_generations_per_prompt, q.grpo.max_num_steps) == (32, 16, 1000)
    qt = load(["experiment=qwen2.5-coder-1.5b-code-test"])
    assert qt.train_world_size == 2 and qt.grpo.max_num_steps == 100


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["grpo.num_generations_per_prompt=1"], "grpo.num_generations_per_prompt"),
        (["data.name=nope"], "data.name"),
        (["env.reward_functions=[{name: nope}]"], "env.reward_functions[0].name"),
        (["experiment=gemma3-27b-gsm8k", "generation.tensor_parallel_size=3"], "generation.tensor_parallel_size"),
        (["experiment=gemma3-27b-gsm8k", "generation.resources.num_nodes=3"], "generation.resources.num_nodes"),
        (["generation.placement=sideways"], "generation.placement"),
        (["grpo.loss.aggregation=median"], "grpo.loss.aggregation"),
        (["grpo.loss.ratio_clip_c=0.5"], "grpo.loss.ratio_clip_c"),
        (["grpo.max_num_steps=abc"], "grpo.max_num_steps"),
        (["grpo.bogus=1"], "grpo.bogus"),
        (["experiment=nope"], "experiment"),
        (["generation.backend=vllm", "generation.tensor_parallel_size=2"], "generation.tensor_parallel_size"),
        (["generation.refit_bucket_mb=0"], "generation.refit_bucket_mb"),
        (["grpo.num_prompts_per_step=1", "grpo.num_generations_per_prompt=3"], "grpo.num_prompts_per_step"),
    ],
)
def test_should_name_the_key_when_a_value_is_bad(overrides, key):
    with pytest.raises(ConfigError) as err:
        load(overrides)
    message = str(err.value)
    assert key in message and "\n" not in message


def test_should_accept_user_reward_when_given_as_module_function():
    cfg = load(["env.reward_functions=[{name: 'trainer.rewards.math_rewards:exact_alnum_reward', weight: 0.5}]"])
    assert cfg.env.reward_functions[0].weight == 0.5


def test_should_fail_in_seconds_with_one_line_when_cli_value_is_bad():
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", "experiment=tiny", "grpo.num_generations_per_prompt=1"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "grpo.num_generations_per_prompt" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert elapsed < 60


def test_should_warn_with_the_fix_when_bf16_is_asked_for_on_a_cpu_without_it():
    from trainer.run import precision_warning

    demo = load(["experiment=cpu-demo"])
    line = precision_warning(demo, native_bf16=False)
    assert line and "policy.param_dtype=null generation.dtype=null" in line and "\n" not in line
    assert precision_warning(demo, native_bf16=True) is None
    assert precision_warning(load(["experiment=tiny"]), native_bf16=False) is None  # float32 throughout
    assert precision_warning(load(["experiment=gemma3-1b-math"]), native_bf16=False) is None  # GPUs


def test_should_accept_vllm_on_cpu_and_say_in_one_line_when_it_is_not_installed(monkeypatch):
    from trainer import run
    from trainer.generation import vllm_engine

    cfg = load(["experiment=tiny", "generation.backend=vllm"])
    assert not cfg.cluster.use_gpus
    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: False)
    with pytest.raises(run.SetupError) as err:
        run.check_backend(cfg)
    message = str(err.value)
    assert message.startswith("generation.backend=vllm") and "\n" not in message


def test_should_name_the_model_in_one_line_when_its_head_dim_is_too_small_for_vllm_on_cpu():
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", "experiment=tiny", "generation.backend=vllm", "model.name='builtin:tiny?num_heads=4'"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("kuberl: warning")]
    assert proc.returncode == 3 and len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    from trainer.generation.vllm_engine import vllm_available

    # head_dim 64/4 = 16; without vLLM installed the line names the backend instead.
    assert ("model.name=builtin:tiny?num_heads=4" in lines[0] and "16" in lines[0]) if vllm_available() else (
        "generation.backend" in lines[0]
    )
