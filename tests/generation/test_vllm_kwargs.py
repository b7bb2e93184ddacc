"""generation.vllm_kwargs: checked against vLLM's arguments at start, passed to the engine's vllm.LLM last."""

from __future__ import annotations

import json

import pytest

from trainer.config import ConfigError, GenerationConfig, load
from trainer.generation.vllm_engine import check_vllm_kwargs, llm_kwargs


def test_should_pass_vllm_kwargs_to_the_engine_last_when_they_are_set():
    gen = GenerationConfig(
        backend="vllm",
        gpu_memory_utilization=0.6,
        vllm_kwargs={"block_size": 32, "gpu_memory_utilization": 0.9},
    )
    kwargs = llm_kwargs("some/model", gen, "float32", 0, 256, on_cpu=True, weight_transfer=False)
    assert kwargs["block_size"] == 32 and kwargs["gpu_memory_utilization"] == 0.9  # the user's word wins
    assert kwargs["model"] == "some/model" and kwargs["max_model_len"] == 256


@pytest.mark.vllm
def test_should_name_the_argument_and_the_close_one_when_vllm_has_no_such_argument():
    with pytest.raises(ConfigError) as err:
        check_vllm_kwargs({"block_size": 32, "gpu_memory_utilisation": 0.9})
    assert str(err.value) == (
        "generation.vllm_kwargs.gpu_memory_utilisation: vllm.EngineArgs has no such argument "
        "(did you mean gpu_memory_utilization?)"
    )


@pytest.mark.vllm
def test_should_accept_vllm_kwargs_when_vllm_knows_them_including_those_the_engine_sets():
    check_vllm_kwargs({"block_size": 32, "gpu_memory_utilization": 0.9})
    gen = GenerationConfig(backend="vllm", tensor_parallel_size=2)
    check_vllm_kwargs(llm_kwargs("some/model", gen, "bfloat16", 0, 256, on_cpu=False, weight_transfer=True))


@pytest.mark.vllm
def test_should_refuse_an_unknown_vllm_argument_in_one_line_when_a_vllm_run_starts():
    from trainer import prestart

    cfg = load(["experiment=tiny", "generation=vllm", "generation.vllm_kwargs={gpu_memory_utilisation: 0.9}"])
    with pytest.raises(ConfigError, match=r"^generation.vllm_kwargs.gpu_memory_utilisation: .*\?\)$"):
        prestart.check_backend(cfg)


@pytest.mark.vllm
def test_should_give_an_engine_vllms_nccl_backend_on_gpus_and_its_twin_on_cpu():
    gen = GenerationConfig(backend="vllm")
    on = {
        cpu: llm_kwargs("m", gen, "float32", 0, 256, on_cpu=cpu, weight_transfer=True)[
            "weight_transfer_config"
        ]
        for cpu in (True, False)
    }
    assert on[False].backend == "nccl" and on[True].backend == "kuberl_gloo"


@pytest.mark.vllm
def test_should_send_with_vllms_own_sender_only_to_vllm_engines_on_gpus(monkeypatch):
    import torch

    from trainer.generation.refit import senders, vllm_nccl

    made = []
    monkeypatch.setattr(vllm_nccl, "NcclSender", lambda info: made.append("vllm nccl"))
    monkeypatch.setattr(senders, "GroupSender", lambda info, device: made.append(f"group {device.type}"))
    for backend, device in (("vllm", "cuda"), ("vllm", "cpu"), ("hf", "cuda"), ("hf", "cpu")):
        senders.open_sender(backend, {}, torch.device(device))
    assert made == ["vllm nccl", "group cpu", "group cuda", "group cpu"]


@pytest.mark.vllm
def test_should_register_the_twin_backend_through_vllms_plugin_entry_point():
    from importlib.metadata import entry_points

    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from trainer.generation.refit.vllm_nccl import GlooWeightTransferEngine
    from trainer.generation.vllm_engine import check_transfer_backend

    (plugin,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "kuberl"]
    assert plugin.value == "trainer.generation.refit.vllm_nccl:register"
    check_transfer_backend("kuberl_gloo")  # loads vLLM's plugins, as each of its processes does
    assert WeightTransferEngineFactory._registry["kuberl_gloo"]() is GlooWeightTransferEngine
    with pytest.raises(RuntimeError, match="no weight-transfer backend 'nope'"):
        check_transfer_backend("nope")


# ----- placement: sleep mode and the memory share -------------------------------------------------------


def _kwargs(gen: GenerationConfig, *, on_cpu: bool, colocated: bool) -> dict:
    return llm_kwargs(
        "some/model", gen, "bfloat16", 0, 256, on_cpu=on_cpu, weight_transfer=False, colocated=colocated
    )


def test_should_run_in_sleep_mode_with_the_colocated_share_when_the_engine_shares_a_gpu_with_a_policy_rank():
    kwargs = _kwargs(GenerationConfig(backend="vllm"), on_cpu=False, colocated=True)
    assert kwargs["enable_sleep_mode"] is True
    assert kwargs["gpu_memory_utilization"] == 0.6


def test_should_start_without_sleep_mode_and_take_most_of_the_gpu_when_the_engine_has_it_alone():
    kwargs = _kwargs(GenerationConfig(backend="vllm"), on_cpu=False, colocated=False)
    assert (
        "enable_sleep_mode" not in kwargs
    )  # vLLM's default (off): no cumem allocator for an engine that never sleeps
    assert kwargs["gpu_memory_utilization"] == 0.9


@pytest.mark.parametrize("colocated", [True, False])
def test_should_start_without_sleep_mode_when_the_engine_runs_on_cpu(colocated):
    assert "enable_sleep_mode" not in _kwargs(
        GenerationConfig(backend="vllm"), on_cpu=True, colocated=colocated
    )


@pytest.mark.parametrize("colocated", [True, False])
def test_should_take_the_users_memory_share_when_one_is_set_whatever_the_placement(colocated):
    assert (
        _kwargs(GenerationConfig(gpu_memory_utilization=0.75), on_cpu=False, colocated=colocated)[
            "gpu_memory_utilization"
        ]
        == 0.75
    )
    gen = GenerationConfig(gpu_memory_utilization=0.75, vllm_kwargs={"gpu_memory_utilization": 0.5})
    assert (
        _kwargs(gen, on_cpu=False, colocated=colocated)["gpu_memory_utilization"] == 0.5
    )  # vllm_kwargs last


def test_should_sleep_only_when_colocated_on_a_gpu_when_asked_which_engines_sleep():
    from trainer.generation.vllm_engine import sleep_mode

    assert [sleep_mode(on_cpu, colocated) for on_cpu in (False, True) for colocated in (True, False)] == [
        True,
        False,
        False,
        False,
    ]


def test_should_leave_the_memory_share_null_in_the_config_when_composed_for_either_backend():
    for backend in ("hf", "vllm"):
        assert load([f"generation={backend}"]).generation.gpu_memory_utilization is None
    assert load(["generation.gpu_memory_utilization=0.8"]).generation.gpu_memory_utilization == 0.8


@pytest.mark.parametrize("value", ["0", "1.5", "-0.1"])
def test_should_refuse_a_memory_share_outside_zero_to_one_in_one_line_when_configured(value):
    with pytest.raises(
        ConfigError, match=r"^generation.gpu_memory_utilization=.* must be in \(0, 1\] or null"
    ):
        load([f"generation.gpu_memory_utilization={value}"])


def test_should_size_a_cpu_engines_kv_cache_in_bytes_which_vllm_kwargs_or_vllms_own_variable_override(
    monkeypatch,
):
    """1 GiB by default, as ``kv_cache_memory_bytes`` so that a run can ask for less than vLLM's
    ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB) allows: two Gemma 3 270M ranks on 24 GiB need the room."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    cpu = llm_kwargs(
        "m", GenerationConfig(backend="vllm"), "float32", 0, 256, on_cpu=True, weight_transfer=False
    )
    assert cpu["kv_cache_memory_bytes"] == 2**30
    gen = GenerationConfig(backend="vllm", vllm_kwargs={"kv_cache_memory_bytes": 2**28})
    assert (
        llm_kwargs("m", gen, "float32", 0, 256, on_cpu=True, weight_transfer=False)["kv_cache_memory_bytes"]
        == 2**28
    )
    gpu = llm_kwargs(
        "m", GenerationConfig(backend="vllm"), "bfloat16", 0, 256, on_cpu=False, weight_transfer=False
    )
    assert "kv_cache_memory_bytes" not in gpu  # the GPU's share (gpu_memory_utilization) sizes it there
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")  # vLLM's platform reads it, in GiB
    assert "kv_cache_memory_bytes" not in llm_kwargs(
        "m", GenerationConfig(backend="vllm"), "float32", 0, 256, on_cpu=True, weight_transfer=False
    )


def test_should_give_the_engine_the_models_own_chat_template_from_its_files(tmp_path):
    from trainer.generation.vllm_engine import own_chat_template

    assert own_chat_template("org/hub-model") is None  # not a local directory: vLLM finds it itself
    assert own_chat_template(str(tmp_path)) is None  # no template anywhere
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert own_chat_template(str(tmp_path)) == "{{ messages }}"
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}")  # transformers' own file wins
    assert own_chat_template(str(tmp_path)) == "{{ bos_token }}"
    (tmp_path / "chat_template.jinja").unlink()
    named = [{"name": "default", "template": "{{ messages }}"}]  # named templates: left to vLLM to pick
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert own_chat_template(str(tmp_path)) is None


def test_should_size_a_cpu_engines_kv_cache_to_the_sequences_one_call_holds():
    from transformers import Gemma3TextConfig, LlamaConfig

    from trainer.generation.vllm_cpu import (
        CPU_KV_CACHE_GIB,
        kv_bytes_per_token,
        kv_cache_kwargs,
        step_kv_bytes,
    )

    gemma = Gemma3TextConfig(num_hidden_layers=18, num_key_value_heads=1, head_dim=256)
    assert kv_bytes_per_token(gemma, "bfloat16") == 2 * 18 * 256 * 2  # K and V, 18 layers, one KV head of 256
    per_token = kv_bytes_per_token(gemma, "float32")
    assert per_token == 2 * 18 * 256 * 4
    assert step_kv_bytes(per_token, 96, 96) == 96 * 128 * per_token  # each sequence in one block of 128
    assert step_kv_bytes(per_token, 96, 200) == 96 * 256 * per_token  # two blocks each
    assert step_kv_bytes(per_token, 96, 200, block=32) == 96 * 224 * per_token
    llama = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    assert kv_bytes_per_token(llama, "float32") == 2 * 2 * 2 * 16 * 4  # head_dim from the width
    assert step_kv_bytes(per_token, None, 128) is None and step_kv_bytes(per_token, 8, None) is None
    assert kv_cache_kwargs(None) == {"kv_cache_memory_bytes": CPU_KV_CACHE_GIB * 2**30}
    assert kv_cache_kwargs(10**6) == {"kv_cache_memory_bytes": 10**6}
    assert kv_cache_kwargs(10**12) == {"kv_cache_memory_bytes": CPU_KV_CACHE_GIB * 2**30}  # capped
    gen = GenerationConfig()
    assert (
        llm_kwargs("m", gen, "float32", 0, 256, on_cpu=True, weight_transfer=False, kv_bytes=10**6)[
            "kv_cache_memory_bytes"
        ]
        == 10**6
    )
    gen = GenerationConfig(vllm_kwargs={"kv_cache_memory_bytes": 5 * 10**6})  # the user's word is last
    assert (
        llm_kwargs("m", gen, "float32", 0, 256, on_cpu=True, weight_transfer=False, kv_bytes=10**6)[
            "kv_cache_memory_bytes"
        ]
        == 5 * 10**6
    )


def test_should_leave_a_latent_kv_cache_at_the_default_size():
    from transformers import DeepseekV3Config

    from trainer.generation.vllm_cpu import kv_bytes_per_token, step_kv_bytes

    per_token = kv_bytes_per_token(DeepseekV3Config(num_hidden_layers=2), "bfloat16")
    assert per_token is None and step_kv_bytes(per_token, 8, 128) is None
