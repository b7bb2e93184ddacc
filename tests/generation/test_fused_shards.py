"""The bookkeeping behind :func:`trainer.generation.vllm_engine.check_fused_shards`, without an engine.

vLLM's ``load_weights`` reports a fused parameter (``qkv_proj``, ``gate_up_proj``, an MoE's ``w13``) loaded
once any shard of it came, so a refit that sent ``q_proj`` and ``k_proj`` but not ``v_proj`` passed every
other check with v's slice stale. The tables here are vLLM 0.32's own, written out: Llama's
``hf_to_vllm_mapper.orig_to_new_stacked`` (model_executor/models/llama.py) and a routed-expert layer's
``get_expert_mapping(include_fused=True)`` for two experts (one test checks that table against vLLM's builder).
The real engines, dense (in place) and MoE (layerwise), are refitted with such streams in
tests/generation/test_vllm_refit_processing.py; the last test here sends one to a vLLM engine in another
process, the disaggregated path.

Models that stack in their own ``load_weights`` (no mapper rules) take their rules from their
``packed_modules_mapping``, kept to the fusions the built model holds (:func:`packed_stacking`): tiny torch
modules stand in for them here, and one test builds vLLM's own DeepSeek-V2/V3 and GPT-OSS classes tiny on CPU
and checks them against the names transformers gives the same configs.
"""

from __future__ import annotations

import json
import logging
import pickle
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from trainer.generation.vllm_engine import (
    FusedShards,
    build_fused_layout,
    check_fused_shards,
    fused_layout,
    packed_stacking,
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


def test_should_check_nothing_for_a_model_without_either_table():
    """No mapper rules and no packed_modules_mapping: no table to read; the check passes rather than guess."""
    fused = FusedShards(fused_layout(torch.nn.Linear(2, 2)))
    fused.record("model.layers.0.self_attn.q_proj.weight")
    check_fused_shards(fused)


# ----- models that stack in their own load_weights: rules from packed_modules_mapping ------------------------


class Fused(torch.nn.Linear):
    """A vLLM merged or QKV linear as the layout sees one: an ``output_sizes`` of several."""

    def __init__(self, parts: int = 2) -> None:
        super().__init__(2, 2 * parts, bias=False)
        self.output_sizes = [2] * parts


def fake_model(cls: type[torch.nn.Module], modules: dict[str, torch.nn.Module]) -> torch.nn.Module:
    """An instance of ``cls`` holding ``modules`` under their dotted names, as vLLM's model tree holds them."""
    model = cls()
    for dotted, module in modules.items():
        parent = model
        *path, leaf = dotted.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.add_module(leaf, module)
    return model


def llama_modules(layers: int = 2) -> dict[str, torch.nn.Module]:
    """A dense model's fused modules as vLLM builds them (MiniCPM's, Llama's)."""
    modules: dict[str, torch.nn.Module] = {"model.embed_tokens": torch.nn.Embedding(4, 2)}
    for i in range(layers):
        p = f"model.layers.{i}"
        modules |= {f"{p}.self_attn.qkv_proj": Fused(3), f"{p}.self_attn.o_proj": torch.nn.Linear(2, 2)}
        modules |= {f"{p}.mlp.gate_up_proj": Fused(2), f"{p}.mlp.down_proj": torch.nn.Linear(2, 2)}
    return modules


class Mapper:
    """A WeightsMapper that renames but stacks nothing (GPT-OSS's, Step-3.5's)."""

    orig_to_new_stacked: dict = {}


class OwnStacking(torch.nn.Module):
    """Stacks in its own load_weights; its table lists one fusion it never builds (DeepSeek-V3's, for V2-Lite)."""

    hf_to_vllm_mapper = Mapper()
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
        "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"],
        "conv1d": ["conv1d"],  # loaded whole (GraniteMoeHybrid's): no fusion
    }


def own_check(model: torch.nn.Module, names: list[str]) -> None:
    fused = FusedShards(fused_layout(model))
    for name in names:
        fused.record(name)
    check_fused_shards(fused)


def test_should_take_the_rules_of_a_model_without_mapper_rules_from_its_packed_modules_mapping(caplog):
    caplog.set_level(logging.WARNING, logger="trainer.generation.vllm_engine")
    layout = fused_layout(fake_model(OwnStacking, llama_modules()))
    assert [(r.source, r.target, r.shards) for r in layout.stacked] == [
        (".q_proj.", ".qkv_proj.", {"q_proj"}),
        (".k_proj.", ".qkv_proj.", {"k_proj"}),
        (".v_proj.", ".qkv_proj.", {"v_proj"}),
        (".gate_proj.", ".gate_up_proj.", {"gate_proj"}),
        (".up_proj.", ".gate_up_proj.", {"up_proj"}),
    ]
    assert layout.full == {
        ".qkv_proj.": {"q_proj", "k_proj", "v_proj"},
        ".gate_up_proj.": {"gate_proj", "up_proj"},
    }
    assert not caplog.records  # every fused module it holds is checked


def test_should_refuse_a_refit_of_such_a_model_without_v_proj_and_pass_a_complete_one():
    model = fake_model(OwnStacking, llama_modules())
    own_check(model, dense_names())
    with pytest.raises(RuntimeError) as err:
        own_check(model, [n for n in dense_names() if n != "model.layers.1.self_attn.v_proj.weight"])
    assert str(err.value).startswith(
        "refit sent part of 1 fused weight(s) of the engine (model.layers.1.self_attn.qkv_proj.weight lacks "
        "model.layers.1.self_attn.v_proj.weight): "
    )
    with pytest.raises(
        RuntimeError, match=r"\(model.layers.0.mlp.gate_up_proj.weight lacks model.layers.0.mlp.up_proj"
    ):
        own_check(model, [n for n in dense_names() if n != "model.layers.0.mlp.up_proj.weight"])


def test_should_not_require_a_fusion_the_table_names_but_the_model_does_not_hold():
    """DeepSeek-V2-Lite: no q_lora_rank, so no q_a_proj and no fused_qkv_a_proj; a q_proj and a
    kv_a_proj_with_mqa of their own, which vLLM's DeepSeek table (shared by V3, which fuses them) lists."""
    modules: dict[str, torch.nn.Module] = {}
    for i in range(2):
        p = f"model.layers.{i}"
        modules |= {
            f"{p}.self_attn.{m}": torch.nn.Linear(2, 2) for m in ("q_proj", "kv_a_proj_with_mqa", "o_proj")
        }
        modules |= {f"{p}.mlp.gate_up_proj": Fused(2), f"{p}.mlp.down_proj": torch.nn.Linear(2, 2)}
    model = fake_model(OwnStacking, modules)
    assert packed_stacking(model) == {
        ".gate_proj.": (".gate_up_proj.", "gate_proj"),
        ".up_proj.": (".gate_up_proj.", "up_proj"),
    }
    names = [
        f"model.layers.{i}.self_attn.{m}.weight" for i in range(2) for m in ("q_proj", "kv_a_proj_with_mqa")
    ]
    own_check(model, names)
    own_check(model, names[1:2])


def test_should_not_guess_which_fusion_a_name_fills_and_say_so_once(caplog):
    """A q_proj that is a module of its own next to a qkv_proj (an MLA text model beside a vision tower that
    fuses), or two fusions that share q_proj (K2-Horizon's qkv_proj and qk_proj): no rule for them, since a
    name would not say where it loads; the model's class is named once, with the modules left unchecked."""
    caplog.set_level(logging.WARNING, logger="trainer.generation.vllm_engine")

    class SharedSources(torch.nn.Module):
        packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "qk_proj": ["q_proj", "k_proj"]}

    def shared() -> torch.nn.Module:
        return fake_model(
            SharedSources,
            {"model.layers.0.self_attn.qkv_proj": Fused(3), "model.layers.1.self_attn.qk_proj": Fused(2)},
        )

    class OwnSource(torch.nn.Module):
        packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    own = fake_model(
        OwnSource,
        {"vision.layers.0.qkv_proj": Fused(3), "model.layers.0.self_attn.q_proj": torch.nn.Linear(2, 2)},
    )
    for model in (shared(), shared(), own):
        assert fused_layout(model).stacked == ()
        own_check(model, ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"])
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    assert said[0].startswith(
        "test_should_not_guess_which_fusion_a_name_fills_and_say_so_once.<locals>.SharedSources: a refit that "
        "sends part of a fused weight is not refused for 2 fused module(s) (model.layers.0.self_attn.qkv_proj, "
        "model.layers.1.self_attn.qk_proj): "
    )
    assert "OwnSource: " in said[1] and "(vision.layers.0.qkv_proj)" in said[1]


def test_should_say_once_which_fused_modules_a_model_without_either_table_leaves_unchecked(caplog):
    caplog.set_level(logging.WARNING, logger="trainer.generation.vllm_engine")

    class NoTable(torch.nn.Module):
        """IQuest-LoopCoder's, Step-3-text's: no mapper rules, no packed_modules_mapping."""

    for _ in range(2):
        layout = fused_layout(fake_model(NoTable, llama_modules(layers=3)))
        assert layout.stacked == ()
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "test_should_say_once_which_fused_modules_a_model_without_either_table_leaves_unchecked.<locals>.NoTable: "
        "a refit that sends part of a fused weight is not refused for 6 fused module(s) (model.layers.0.mlp.gate_up_proj, "
        "model.layers.0.self_attn.qkv_proj, model.layers.1.mlp.gate_up_proj and 3 more): no hf_to_vllm_mapper stacks "
        "them and no fusion of its packed_modules_mapping fills them (vllm_engine.packed_stacking); a refit must send "
        "every part of each itself"
    ]


def test_should_leave_a_model_whose_mapper_stacks_to_the_mapper(caplog):
    """Qwen3-MoE's mapper qualifies gate_proj (.mlp., .shared_expert.) so that the experts' stay theirs; its table's
    plain gate_up_proj would not, so the table is not read, and nothing is said of what the mapper leaves out."""
    caplog.set_level(logging.WARNING, logger="trainer.generation.vllm_engine")

    class QwenMapper:
        orig_to_new_stacked = QWEN3_MOE_STACKED

    class MapperStacks(torch.nn.Module):
        hf_to_vllm_mapper = QwenMapper()
        packed_modules_mapping = {
            "qkv_proj": ["q_proj", "k_proj", "v_proj"],
            "gate_up_proj": ["gate_proj", "up_proj"],
        }

    modules = llama_modules() | {"model.layers.0.self_attn.extra_proj": Fused(2)}
    layout = fused_layout(fake_model(MapperStacks, modules))
    assert [rule.source for rule in layout.stacked] == list(QWEN3_MOE_STACKED)
    assert not caplog.records


def test_should_take_a_routed_experts_gate_proj_as_its_shard_of_w13_not_of_a_gate_up_proj():
    """packed_stacking's plain .gate_proj. matches an expert's name too; vLLM's load_weights skips its stacked
    list for mlp.experts. names, and so does the layout: the expert's rules first."""
    model = fake_model(OwnStacking, {"model.layers.0.mlp.shared_experts.gate_up_proj": Fused(2)})
    stacked = (packed_stacking(model),)
    check(per_expert_names(), stacked=stacked)
    names = [n for n in per_expert_names() if n != "model.layers.0.mlp.experts.1.up_proj.weight"]
    assert (
        "(model.layers.0.mlp.experts.w13_weight lacks model.layers.0.mlp.experts.1.up_proj.weight)"
        in refused(names, stacked=stacked)
    )


# vLLM's own classes built tiny on CPU (no engine: a model under a config, a process group of one), each
# config's names from transformers' model on the meta device; the layouts come back pickled.
BUILD_REAL_MODELS = """
    import json, pickle, sys, tempfile
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.utils import initialize_model
    from trainer.generation.vllm_engine import fused_layout

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(1, 0, sys.argv[1], 0, "gloo")
        initialize_model_parallel(1, 1)
    built = {}
    for key, (model_type, arch, fields) in json.loads(sys.argv[3]).items():
        config = AutoConfig.for_model(model_type, **fields)
        config.architectures = [arch]
        path = tempfile.mkdtemp()
        config.save_pretrained(path)
        with torch.device("meta"):
            names = [n for n, _ in AutoModelForCausalLM.from_config(config).named_parameters()]
        model_config = ModelConfig(model=path, skip_tokenizer_init=True, dtype="float32", enforce_eager=True)
        vllm_config = VllmConfig(
            model_config=model_config, device_config=DeviceConfig("cpu"), load_config=LoadConfig(load_format="dummy")
        )
        with set_current_vllm_config(vllm_config), torch.device("cpu"):
            model = initialize_model(vllm_config=vllm_config)
        assert type(model).__name__ == arch, type(model).__name__
        built[key] = (fused_layout(model), names)
    with open(sys.argv[2], "wb") as f:
        pickle.dump(built, f)
"""
TINY = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
TINY |= {"num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 64}
DEEPSEEK = TINY | {"kv_lora_rank": 32, "qk_rope_head_dim": 32, "qk_nope_head_dim": 32, "v_head_dim": 32}
DEEPSEEK |= {
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "n_shared_experts": 1,
}
DEEPSEEK |= {"first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": False}
REAL_MODELS = {  # V3 first: its __init__ adds fused_qkv_a_proj to the table V2's class shares, as in one process
    "deepseek_v3": ("deepseek_v3", "DeepseekV3ForCausalLM", DEEPSEEK | {"q_lora_rank": 16}),
    "deepseek_v2_lite": ("deepseek_v2", "DeepseekV2ForCausalLM", DEEPSEEK | {"q_lora_rank": None}),
    "gpt_oss": ("gpt_oss", "GptOssForCausalLM", TINY | {"num_local_experts": 4, "num_experts_per_tok": 2}),
}


@pytest.mark.vllm
@pytest.mark.integration  # a Python interpreter of its own
def test_should_check_vllms_own_deepseek_and_gpt_oss_which_stack_in_their_load_weights(tmp_path):
    """DeepSeek-V2/V3 and GPT-OSS have no mapper rules (GPT-OSS's mapper only renames); their layouts come from
    packed_modules_mapping. A complete refit of transformers' names passes; one without a shard is refused,
    routed experts' per-expert names (transformers 4 checkpoints) included; V2-Lite is not held to V3's
    fused_qkv_a_proj."""
    out = tmp_path / "layouts.pkl"
    args = [f"file://{tmp_path / 'store'}", str(out), json.dumps(REAL_MODELS)]
    subprocess.run([sys.executable, "-c", textwrap.dedent(BUILD_REAL_MODELS), *args], check=True, timeout=300)
    built = pickle.loads(out.read_bytes())

    def said(key: str, names: list[str]) -> str | None:
        fused = FusedShards(built[key][0])
        for name in names:
            fused.record(name)
        try:
            check_fused_shards(fused)
        except RuntimeError as err:
            return str(err).partition(": the parts")[0]
        return None

    for key, (layout, names) in built.items():
        assert layout.experts, key  # one expert count: the routed experts are checked too
        assert said(key, names) is None, key
    assert set(built["deepseek_v3"][0].full) >= {".fused_qkv_a_proj.", ".gate_up_proj."}
    assert {r.target for r in built["deepseek_v2_lite"][0].stacked} == {".gate_up_proj."}
    assert {r.target for r in built["gpt_oss"][0].stacked} == {".qkv_proj."}
    v3 = built["deepseek_v3"][1]
    assert said(
        "deepseek_v3", [n for n in v3 if n != "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"]
    ) == (
        "refit sent part of 1 fused weight(s) of the engine (model.layers.1.self_attn.fused_qkv_a_proj.weight lacks "
        "model.layers.1.self_attn.kv_a_proj_with_mqa.weight)"
    )
    lite = built["deepseek_v2_lite"][1]
    assert "model.layers.1.self_attn.q_proj.weight" in lite
    assert said("deepseek_v2_lite", [n for n in lite if "shared_experts.up_proj" not in n]) == (
        "refit sent part of 1 fused weight(s) of the engine (model.layers.1.mlp.shared_experts.gate_up_proj.weight "
        "lacks model.layers.1.mlp.shared_experts.up_proj.weight)"
    )
    per_expert = [n for n in lite if ".mlp.experts." not in n]
    per_expert += [
        f"model.layers.1.mlp.experts.{e}.{m}.weight"
        for e in range(4)
        for m in ("gate_proj", "up_proj", "down_proj")
    ]
    assert said("deepseek_v2_lite", per_expert) is None
    assert said(
        "deepseek_v2_lite", [n for n in per_expert if n != "model.layers.1.mlp.experts.2.up_proj.weight"]
    ) == (
        "refit sent part of 1 fused weight(s) of the engine (model.layers.1.mlp.experts.w13_weight lacks "
        "model.layers.1.mlp.experts.2.up_proj.weight)"
    )
    oss = built["gpt_oss"][1]
    assert said("gpt_oss", [n for n in oss if n != "model.layers.0.self_attn.v_proj.bias"]) == (
        "refit sent part of 1 fused weight(s) of the engine (model.layers.0.self_attn.qkv_proj.bias lacks "
        "model.layers.0.self_attn.v_proj.bias)"
    )


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
