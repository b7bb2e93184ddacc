"""An MoE engine's routes from vLLM (trainer.generation.vllm_engine): asked of vLLM on GPUs
(``enable_return_routed_experts``, checked against vLLM's own arguments), read off its outputs, refused on its
CPU build (whose V2 model runner, the one that returns routes, needs Triton) in one line at config time."""

from __future__ import annotations

import types

import numpy as np
import pytest

from tests.families.models import build_family_model
from trainer.config import ConfigError, GenerationConfig, load
from trainer.generation.vllm_engine import VLLMGenerationEngine, check_vllm_kwargs, llm_kwargs, returns_routes


def test_should_ask_vllm_for_routes_only_when_the_engine_returns_them_and_let_the_user_turn_them_off():
    gen = GenerationConfig(backend="vllm")
    assert "enable_return_routed_experts" not in llm_kwargs(
        "m", gen, "bfloat16", 0, 256, on_cpu=False, weight_transfer=True
    )
    kwargs = llm_kwargs("m", gen, "bfloat16", 0, 256, on_cpu=False, weight_transfer=True, routes=True)
    assert kwargs["enable_return_routed_experts"] is True
    check_vllm_kwargs(kwargs)  # an argument vLLM knows
    gen = GenerationConfig(backend="vllm", vllm_kwargs={"enable_return_routed_experts": False})
    assert not llm_kwargs("m", gen, "bfloat16", 0, 256, on_cpu=False, weight_transfer=True, routes=True)[
        "enable_return_routed_experts"
    ]


@pytest.mark.integration  # writes a model
def test_should_return_routes_from_an_moe_model_on_gpus_and_never_from_a_dense_one_or_on_cpu(tmp_path):
    moe_dir = build_family_model("qwen3-moe", str(tmp_path / "moe"))
    dense = build_family_model("qwen3", str(tmp_path / "dense"))
    assert returns_routes(moe_dir, on_cpu=False)
    assert not returns_routes(dense, on_cpu=False)
    assert not returns_routes(moe_dir, on_cpu=True)


def test_should_carry_vllms_routed_experts_on_each_completion():
    engine = VLLMGenerationEngine.__new__(VLLMGenerationEngine)
    engine.tokenizer = types.SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "x" * len(ids))
    routes = np.arange(5 * 2 * 2, dtype=np.uint8).reshape(5, 2, 2)  # 3 prompt tokens + 3 sampled - 1
    out = types.SimpleNamespace(
        token_ids=[4, 5, 6],
        logprobs=[
            {4: types.SimpleNamespace(logprob=-1.0)},
            {5: types.SimpleNamespace(logprob=-2.0)},
            {6: types.SimpleNamespace(logprob=-0.5)},
        ],  # fmt: skip
        finish_reason="length",
        stop_reason=None,
        routed_experts=routes,
    )
    import trainer.generation.vllm_engine as ve

    c = ve.VLLMGenerationEngine._completion(engine, out)
    assert c.routes is routes and c.logprobs == [-1.0, -2.0, -0.5]


def test_should_refuse_router_replay_with_vllm_on_cpu_in_one_line():
    with pytest.raises(ConfigError, match="vLLM's CPU build returns none.*generation.backend=hf"):
        load(["experiment=tiny", "generation.backend=vllm", "policy.moe.router_replay=true"])
    load(["experiment=tiny", "policy.moe.router_replay=true"])  # the hf engine returns routes anywhere
    with pytest.raises(ConfigError, match="policy.moe.z_loss_coef=-1"):
        load(["experiment=tiny", "policy.moe.z_loss_coef=-1"])
