"""Prepacked bf16 linears for CPU decoding: same logits as the plain model, and fresh after updates."""

from __future__ import annotations

import copy

import pytest
import torch

from trainer.generation import packed
from trainer.generation.hf import HFGenerationEngine
from trainer.policy.worker import load_model, load_tokenizer


@pytest.fixture
def bf16_model(tiny_model_path):
    model = load_model(tiny_model_path, "bfloat16").eval()
    if not packed.available(model):
        pytest.skip("this torch build has no oneDNN linear ops")
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def test_should_give_the_plain_logits_when_linears_are_packed(bf16_model):
    ids = torch.randint(4, 50, (3, 7), generator=torch.Generator().manual_seed(0))
    plain = _logits(bf16_model, ids)
    fast = copy.deepcopy(bf16_model)
    assert packed.pack(fast, rows_hint=3) == sum(isinstance(m, torch.nn.Linear) for m in fast.modules())
    assert torch.allclose(_logits(fast, ids), plain, atol=1e-2)


def test_should_follow_new_weights_when_engine_weights_are_updated(bf16_model, tiny_model_path):
    engine = HFGenerationEngine(copy.deepcopy(bf16_model), load_tokenizer(tiny_model_path), batch_size=4)
    assert engine._packed
    new = {n: p.detach() + 0.05 * torch.randn_like(p, dtype=torch.float32).to(p.dtype) for n, p in bf16_model.named_parameters()}
    engine.update_weights(new.items())
    reference = copy.deepcopy(bf16_model)
    reference.load_state_dict(new, strict=False)
    ids = torch.randint(4, 50, (2, 5), generator=torch.Generator().manual_seed(1))
    # stale packed weights would give the old model's logits
    assert not torch.allclose(_logits(bf16_model, ids), _logits(reference, ids), atol=1e-2)
    assert torch.allclose(_logits(engine.model, ids), _logits(reference, ids), atol=1e-2)


def test_should_keep_the_plain_forward_when_weights_are_float32(tiny_model_path):
    model = load_model(tiny_model_path, "float32")
    assert not packed.available(model)
    engine = HFGenerationEngine(model, load_tokenizer(tiny_model_path), batch_size=4)
    assert not engine._packed
