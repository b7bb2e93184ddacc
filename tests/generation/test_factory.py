"""The engine factory: one place that builds every engine, with one-line errors for bad names."""

from __future__ import annotations

import pytest
import torch

from trainer.config import ConfigError, GenerationConfig
from trainer.generation.base import SamplingParams
from trainer.generation.factory import EngineSpec, build_engine
from trainer.models import load_model


def test_should_build_the_hf_engine_from_files_when_no_model_is_given(tiny_model_path):
    engine = build_engine(
        GenerationConfig(backend="hf", batch_size=4), EngineSpec(tiny_model_path, "float32")
    )
    try:
        out = engine.generate([[5, 6, 7]], 2, SamplingParams(max_new_tokens=3, seed=0))
        assert len(out) == 1 and len(out[0]) == 2
    finally:
        engine.shutdown()


def test_should_copy_the_given_weights_in_the_engine_dtype_when_colocated(tiny_model_path):
    base = load_model(tiny_model_path, "float32")
    spec = EngineSpec(tiny_model_path, "bfloat16", colocated=True, base_model=base)
    engine = build_engine(GenerationConfig(backend="hf"), spec)
    name, param = next(iter(engine.model.named_parameters()))
    assert (
        param.dtype == torch.bfloat16 and param.data_ptr() != dict(base.named_parameters())[name].data_ptr()
    )
    assert torch.equal(param, dict(base.named_parameters())[name].to(torch.bfloat16))


def test_should_name_the_key_when_the_backend_is_unknown(tiny_model_path):
    with pytest.raises(
        ConfigError, match=r"generation.backend='sglang' is not an engine; choose one of: hf, vllm"
    ):
        build_engine(GenerationConfig(backend="sglang"), EngineSpec(tiny_model_path, "float32"))


@pytest.mark.parametrize(
    ("enforce_eager", "on_cpu", "expected"),
    [(None, True, True), (None, False, False), (False, True, False), (True, False, True)],
)
def test_should_run_vllm_eager_on_cpu_and_with_cuda_graphs_on_gpus_unless_told(
    enforce_eager, on_cpu, expected
):
    from trainer.generation.vllm_engine import resolve_enforce_eager

    assert resolve_enforce_eager(GenerationConfig(enforce_eager=enforce_eager), on_cpu) is expected
