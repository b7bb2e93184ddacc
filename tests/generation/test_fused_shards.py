"""The bookkeeping behind :func:`trainer.generation.vllm_engine.check_fused_shards`, without an engine.

vLLM's ``load_weights`` reports a fused parameter (``qkv_proj``, ``gate_up_proj``, an MoE's ``w13``) loaded
once any shard of it came, so a refit that sent ``q_proj`` and ``k_proj`` but not ``v_proj`` passed every
other check with v's slice stale. The tables here are vLLM 0.32's own, written out: Llama's
``hf_to_vllm_mapper.orig_to_new_stacked`` (model_executor/models/llama.py) and a routed-expert layer's
``get_expert_mapping(include_fused=True)`` for two experts (one test checks that table against vLLM's builder).
The real engines, dense (in place) and MoE (layerwise), are refitted with such streams in
tests/generation/test_vllm_refit_processing.py; the last test here sends one to a vLLM engine in another
process, the disaggregated path.
"""

from __future__ import annotations

import re

import pytest
import torch

from trainer.generation.vllm_engine import (
    FusedShards,
    build_fused_layout,
    check_fused_shards,
    fused_layout,
)

LLAMA_STACKED = {
    ".q_proj": (".qkv_proj", "q"),
    ".k_proj": (".qkv_proj", "k"),
    ".v_proj": (".qkv_proj", "v"),
    ".gate_proj": (".gate_up_proj", 0),
    ".up_proj": (".gate_up_proj", 1),
}
# Qwen3-MoE's (model_executor/models/qwen3_moe.py): its dense MLPs' gate/up only, the experts' left to theirs.
QWEN3_MOE_STACKED = {
    ".q_proj": (".qkv_proj", "q"),
    ".k_proj": (".qkv_proj", "k"),
    ".v_proj": (".qkv_proj", "v"),
    ".mlp.gate_proj": (".mlp.gate_up_proj", 0),
    ".mlp.up_proj": (".mlp.gate_up_proj", 1),
    ".shared_expert.gate_proj": (".shared_expert.gate_up_proj", 0),
    ".shared_expert.up_proj": (".shared_expert.gate_up_proj", 1),
}
# RoutedExperts.build_expert_params_mapping("gate_proj", "down_proj", "up_proj", 2, include_fused=True,
# routed_experts_prefix=""): (param, checkpoint name, expert or chunk, shard)
TWO_EXPERTS = [
    ("experts.w13_weight", "experts.gate_up_proj", 0, "w1"),
    ("experts.w13_weight", "experts.gate_up_proj", 1, "w3"),
    ("experts.w2_weight", "experts.down_proj", 0, "w2"),
    ("experts.w13_", "experts.0.gate_up_proj.", 0, "w1"),
    ("experts.w13_", "experts.0.gate_up_proj.", 0, "w3"),
    ("experts.w13_", "experts.1.gate_up_proj.", 1, "w1"),
    ("experts.w13_", "experts.1.gate_up_proj.", 1, "w3"),
    ("experts.w13_", "experts.0.gate_proj.", 0, "w1"),
    ("experts.w2_", "experts.0.down_proj.", 0, "w2"),
    ("experts.w13_", "experts.0.up_proj.", 0, "w3"),
    ("experts.w13_", "experts.1.gate_proj.", 1, "w1"),
    ("experts.w2_", "experts.1.down_proj.", 1, "w2"),
    ("experts.w13_", "experts.1.up_proj.", 1, "w3"),
]


def dense_names(layers: int = 2) -> list[str]:
    """What a policy rank sends for a Llama: transformers' parameter names."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(layers):
        p = f"model.layers.{i}"
        names += [f"{p}.self_attn.{m}.weight" for m in ("q_proj", "k_proj", "v_proj", "o_proj")]
        names += [f"{p}.mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]
        names += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
    return names


def per_expert_names(layer: int = 0) -> list[str]:
    """A checkpoint that names each expert's projections (transformers 4's Qwen3-MoE, Mixtral-style)."""
    p = f"model.layers.{layer}.mlp"
    return [f"{p}.experts.{e}.{m}.weight" for e in (0, 1) for m in ("gate_proj", "up_proj", "down_proj")]


def fused_expert_names(layer: int = 0) -> list[str]:
    """transformers 5's fused experts: every expert's gate and up in one tensor, their down in another."""
    return [f"model.layers.{layer}.mlp.experts.gate_up_proj", f"model.layers.{layer}.mlp.experts.down_proj"]


def check(names: list[str], stacked=(LLAMA_STACKED,), experts=TWO_EXPERTS) -> None:
    fused = FusedShards(build_fused_layout(stacked, experts))
    for name in names:
        fused.record(name)
    check_fused_shards(fused)


def refused(names: list[str], **kwargs) -> str:
    with pytest.raises(RuntimeError) as err:
        check(names, **kwargs)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_should_pass_when_every_shard_of_every_fused_weight_is_sent():
    check(dense_names())
    check(dense_names() + per_expert_names(0) + fused_expert_names(1), stacked=(QWEN3_MOE_STACKED,))


def test_should_name_the_fused_weight_and_its_missing_shard_when_a_layer_lacks_v_proj():
    message = refused([n for n in dense_names() if n != "model.layers.1.self_attn.v_proj.weight"])
    assert message == (
        "refit sent part of 1 fused weight(s) of the engine (model.layers.1.self_attn.qkv_proj.weight lacks "
        "model.layers.1.self_attn.v_proj.weight): the parts not sent would keep stale or undefined values; "
        "send every part of each fused weight (a policy.freeze pattern must cover q/k/v, gate/up and each "
        "expert's gate/up together on vLLM)"
    )


def test_should_name_gate_up_proj_when_a_layer_lacks_up_proj():
    message = refused([n for n in dense_names() if n != "model.layers.0.mlp.up_proj.weight"])
    assert "(model.layers.0.mlp.gate_up_proj.weight lacks model.layers.0.mlp.up_proj.weight)" in message


def test_should_count_every_partial_weight_and_list_the_missing_shards():
    left_out = {f"model.layers.{i}.self_attn.{m}.weight" for i in (0, 1) for m in ("k_proj", "v_proj")}
    left_out.add("model.layers.0.mlp.gate_proj.weight")
    message = refused([n for n in dense_names() if n not in left_out])
    assert message.startswith(
        "refit sent part of 3 fused weight(s) of the engine (model.layers.0.mlp.gate_up_proj.weight lacks "
        "model.layers.0.mlp.gate_proj.weight; model.layers.0.self_attn.qkv_proj.weight lacks "
        "model.layers.0.self_attn.k_proj.weight, model.layers.0.self_attn.v_proj.weight; and 1 more): "
    )


def test_should_leave_whole_weights_to_the_other_checks_when_no_shard_of_one_is_sent():
    """A fused weight with no shard sent is a weight left out: check_every_weight_loaded's and
    check_whole_layers' to judge (a frozen layer in place keeps its values)."""
    attention = {f"model.layers.1.self_attn.{m}.weight" for m in ("q_proj", "k_proj", "v_proj")}
    check([n for n in dense_names() if n not in attention])
    check([n for n in dense_names() if not n.startswith("model.layers.1.")])


def test_should_name_the_expert_shard_when_one_expert_lacks_its_up_proj():
    names = [n for n in per_expert_names() if n != "model.layers.0.mlp.experts.1.up_proj.weight"]
    message = refused(dense_names() + names, stacked=(QWEN3_MOE_STACKED,))
    assert (
        "(model.layers.0.mlp.experts.w13_weight lacks model.layers.0.mlp.experts.1.up_proj.weight)" in message
    )


def test_should_name_every_missing_expert_when_an_expert_is_not_sent():
    names = [n for n in per_expert_names() if ".experts.1." not in n]
    message = refused(names, stacked=(QWEN3_MOE_STACKED,))
    assert message.startswith(
        "refit sent part of 2 fused weight(s) of the engine (model.layers.0.mlp.experts.w13_weight lacks "
        "model.layers.0.mlp.experts.1.gate_proj.weight, model.layers.0.mlp.experts.1.up_proj.weight; "
        "model.layers.0.mlp.experts.w2_weight lacks model.layers.0.mlp.experts.1.down_proj.weight): "
    )


def test_should_take_a_tensor_of_every_expert_as_all_their_shards():
    for names in (
        fused_expert_names(),
        fused_expert_names()[:1],  # w13 whole; w2 not sent at all: the other checks' to judge
        fused_expert_names() + per_expert_names(),  # sent twice over: complete
    ):
        check(names, stacked=(QWEN3_MOE_STACKED,))


def test_should_not_take_shared_experts_for_routed_ones():
    shared = [f"model.layers.0.mlp.shared_experts.{m}.weight" for m in ("gate_proj", "down_proj")]
    shared.append("model.layers.0.mlp.shared_experts.down_proj")
    check(shared, stacked=(QWEN3_MOE_STACKED,))


def test_should_fill_every_shard_a_list_of_shard_ids_names():
    stacked = ({".q_proj": (".qkv_proj", "q"), ".kv_proj": (".qkv_proj", ["k", "v"])},)
    check(["a.q_proj.weight", "a.kv_proj.weight"], stacked=stacked)
    assert "(a.qkv_proj.weight lacks a.kv_proj.weight)" in refused(["a.q_proj.weight"], stacked=stacked)


def test_should_read_the_stacked_mapping_from_the_models_modules_once():
    class Mapper:
        orig_to_new_stacked = LLAMA_STACKED

    class Inner(torch.nn.Module):
        hf_to_vllm_mapper = Mapper()

    class Outer(torch.nn.Module):
        hf_to_vllm_mapper = Inner.hf_to_vllm_mapper  # vLLM's CausalLM shares its model's mapper

        def __init__(self) -> None:
            super().__init__()
            self.model = Inner()

    model = Outer()
    layout = fused_layout(model)
    assert fused_layout(model) is layout
    assert [rule.source for rule in layout.stacked] == list(LLAMA_STACKED)
    assert layout.full == {".qkv_proj": {"q", "k", "v"}, ".gate_up_proj": {0, 1}}
    assert layout.experts == {}
    fused = FusedShards(layout)
    for name in fused.watch((n, torch.empty(0)) for n in dense_names()):
        assert re.match(r"^(model|lm_head)\.", name[0])
    check_fused_shards(fused)


def test_should_check_nothing_for_a_model_without_a_stacked_mapping():
    """A model that stacks in its own load_weights gives no table to read; the check passes rather than guess."""
    fused = FusedShards(fused_layout(torch.nn.Linear(2, 2)))
    fused.record("model.layers.0.self_attn.q_proj.weight")
    check_fused_shards(fused)


@pytest.mark.vllm
def test_should_hold_vllms_own_expert_mapping():
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    built = RoutedExperts.build_expert_params_mapping(
        "gate_proj", "down_proj", "up_proj", num_experts=2, routed_experts_prefix="", include_fused=True
    )
    assert built == TWO_EXPERTS


@pytest.mark.vllm
def test_should_refuse_a_received_refit_that_carried_part_of_a_fused_weight(tiny_model_path, tmp_path):
    """The disaggregated path: a vLLM engine in another process receives over the gloo twin (vLLM's NCCL
    engine on GPUs) a refit without one layer's v_proj; the transfer completes, the sender is released, and
    the engine's receive_weights says what was missing in one line."""
    import json

    from transformers import AutoModelForCausalLM

    from tests.generation.test_weight_transport import (
        FAILING_VLLM_RECEIVER,
        _free_port,
        _join,
        _meta,
        _start_receiver,
    )
    from trainer.generation.refit.group import WeightSyncGroup
    from trainer.generation.refit.transport import init_info, send_packed

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    left_out = "model.layers.0.self_attn.v_proj.weight"
    named = [(n, p) for n, p in model.named_parameters() if n != left_out]
    port, out = _free_port(), tmp_path / "said.txt"
    meta = _meta(named)
    info = init_info("127.0.0.1", port, rank_offset=1, world_size=2, buffer_bytes=16 * 1024)
    proc = _start_receiver(
        FAILING_VLLM_RECEIVER, port, str(out), json.dumps(info), json.dumps(meta.update_info())
    )
    try:
        group = WeightSyncGroup("127.0.0.1", port, rank=0, world_size=2, device=torch.device("cpu"))
        send_packed(group, iter(named), meta, 16 * 1024)
        assert group.close(), "the engine's receiver did not meet the sender at close"
    finally:
        _join(proc, timeout=300)
    said = out.read_text()
    assert said.startswith(
        "RuntimeError: refit sent part of 1 fused weight(s) of the engine (model.layers.0.self_attn.qkv_proj.weight "
        "lacks model.layers.0.self_attn.v_proj.weight): "
    ), said
