"""Prepacked bf16 linears for CPU decoding: the plain logits on every CPU, packed where oneDNN can.

On a CPU with AVX512BW/VL/DQ (or AVX-NE-CONVERT) the linears are packed; on one with AVX2 only the
reorder raises and the plain forward stays. Each test holds on both kinds, and the probes and the
reorder are replaced to take the other kind's path too.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from trainer import hardware
from trainer.generation import onednn_linear
from trainer.generation.base import SamplingParams
from trainer.generation.hf import HFGenerationEngine
from trainer.models import load_model, load_tokenizer


@pytest.fixture
def bf16_model(tiny_model_path):
    model = load_model(tiny_model_path, "bfloat16").eval()
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _is_packed(model) -> bool:
    return any(getattr(m, onednn_linear._PACKED, None) is not None for m in model.modules())


def test_should_give_the_plain_logits_whether_or_not_the_cpu_can_pack(bf16_model):
    ids = torch.randint(4, 50, (3, 7), generator=torch.Generator().manual_seed(0))
    plain = _logits(bf16_model, ids)
    fast = copy.deepcopy(bf16_model)
    count = onednn_linear.pack(
        fast, rows_hint=3
    )  # on an AVX2-only CPU the reorder raises: 0, plain forward kept
    linears = sum(isinstance(m, torch.nn.Linear) for m in fast.modules())
    assert count in (0, linears) and _is_packed(fast) == (count > 0)
    assert torch.allclose(_logits(fast, ids), plain, atol=1e-2)


def test_should_keep_the_plain_forward_and_say_so_when_the_reorder_raises(bf16_model, monkeypatch, caplog):
    def refuse(weight, rows_hint):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")

    monkeypatch.setattr(onednn_linear, "reorder", refuse)
    monkeypatch.setattr(hardware, "onednn_bf16", lambda: True)  # the probe says yes, the op says no
    ids = torch.randint(4, 50, (2, 5), generator=torch.Generator().manual_seed(3))
    plain = _logits(bf16_model, ids)
    model = copy.deepcopy(bf16_model)
    with caplog.at_level(logging.WARNING, logger=onednn_linear.__name__):
        assert onednn_linear.pack(model, rows_hint=2) == 0
    assert [r for r in caplog.records if "plain forward" in r.getMessage()]
    assert not _is_packed(model) and all("forward" not in vars(m) for m in model.modules())
    assert torch.equal(_logits(model, ids), plain)


def test_should_not_pack_when_the_cpu_has_no_onednn_bf16(bf16_model, tiny_model_path, monkeypatch):
    monkeypatch.setattr(hardware, "onednn_bf16", lambda: False)
    assert not onednn_linear.available(bf16_model)
    engine = HFGenerationEngine(copy.deepcopy(bf16_model), load_tokenizer(tiny_model_path), batch_size=4)
    assert not engine._packed and not _is_packed(engine.model)
    out = engine.generate([[5, 6, 7]], 2, SamplingParams(max_new_tokens=3, seed=0))
    assert len(out[0]) == 2 and all(len(c.token_ids) >= 1 for c in out[0])


def test_should_follow_new_weights_when_engine_weights_are_updated(bf16_model, tiny_model_path):
    engine = HFGenerationEngine(copy.deepcopy(bf16_model), load_tokenizer(tiny_model_path), batch_size=4)
    assert engine._packed == hardware.onednn_bf16()  # packed exactly where this CPU can
    new = {
        n: p.detach() + 0.05 * torch.randn_like(p, dtype=torch.float32).to(p.dtype)
        for n, p in bf16_model.named_parameters()
    }
    engine.update_weights(new.items())
    reference = copy.deepcopy(bf16_model)
    reference.load_state_dict(new, strict=False)
    ids = torch.randint(4, 50, (2, 5), generator=torch.Generator().manual_seed(1))
    # stale packed weights would give the old model's logits
    assert not torch.allclose(_logits(bf16_model, ids), _logits(reference, ids), atol=1e-2)
    assert torch.allclose(_logits(engine.model, ids), _logits(reference, ids), atol=1e-2)


def test_should_keep_the_plain_forward_when_weights_are_float32(tiny_model_path):
    model = load_model(tiny_model_path, "float32")
    assert not onednn_linear.available(model)
    engine = HFGenerationEngine(model, load_tokenizer(tiny_model_path), batch_size=4)
    assert not engine._packed
