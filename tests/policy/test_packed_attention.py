"""The policy's attention over packed rows (trainer.policy.packed_attention) against plain references.

Per-sample sdpa must equal a dense block-diagonal causal mask over the row (the sliding window and
grouped-query attention included); a model with the function installed must give each packed sample
the logits of that sample run alone, and a padded batch the logits of transformers' own sdpa. The
flash branch (GPUs) runs here against a stand-in for transformers' function that checks every keyword
against the real signature.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from trainer.policy import packed_attention
from trainer.policy.batch import Sample, pack_batch, pad_batch
from trainer.policy.packed_attention import Row, _attend


def _dense(q, k, v, row: Row, window: int | None, scale: float) -> torch.Tensor:
    """The reference: one sdpa over the whole row with a block-diagonal causal (windowed) mask."""
    n = q.shape[2]
    segment = torch.zeros(n, dtype=torch.long)
    for s, (a, b) in enumerate(row.bounds):
        segment[a:b] = s
    i = torch.arange(n)
    mask = (segment[:, None] == segment[None, :]) & (i[None, :] <= i[:, None])
    if window is not None:
        mask &= (i[:, None] - i[None, :]) < window
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                           enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_should_equal_a_dense_block_diagonal_mask_when_each_sample_attends_alone(window, kv_heads):
    row = Row(torch.tensor([0, 5, 6, 13, 20], dtype=torch.int32), 7)  # samples of 5, 1, 7 and 7 tokens
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 20, 16, generator=g)
    k, v = (torch.randn(1, kv_heads, 20, 16, generator=g) for _ in range(2))
    module = torch.nn.Linear(2, 2).eval()
    got = _attend(module, q, k, v, row, "sdpa", 0.0, 0.25, window, None)
    torch.testing.assert_close(got, _dense(q, k, v, row, window, 0.25))


@pytest.fixture
def tiny(tiny_model_path):
    from trainer.models import load_model

    plain = load_model(tiny_model_path, "float32", False).eval()
    packed = load_model(tiny_model_path, "float32", False).eval()
    packed_attention.install(packed)
    try:
        yield plain, packed
    finally:
        packed_attention.set_row(None)


def test_should_give_each_sample_its_own_logits_when_a_packed_row_runs_through_the_installed_attention(tiny):
    plain, packed = tiny
    samples = [Sample([5, 6, 7], [8, 9]), Sample([5, 6], [7]), Sample([9, 8, 7, 6], [5, 4, 3, 2])]
    batch = pack_batch(samples, pad_id=0)
    packed_attention.set_row(Row(batch.cu_seqlens, batch.max_seqlen))
    with torch.no_grad():
        row = packed(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
        for a, b in Row(batch.cu_seqlens, batch.max_seqlen).bounds:
            alone = plain(input_ids=batch.input_ids[:, a:b], use_cache=False).logits
            torch.testing.assert_close(row[:, a:b], alone, rtol=1e-5, atol=1e-5)


def test_should_be_transformers_sdpa_when_the_batch_is_padded(tiny):
    plain, packed = tiny
    batch = pad_batch([Sample([5, 6, 7], [8, 9]), Sample([5, 6], [7])], pad_id=0)
    packed_attention.set_row(None)
    with torch.no_grad():
        kwargs = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        torch.testing.assert_close(packed(**kwargs).logits, plain(**kwargs).logits)


def test_should_call_flash_attentions_varlen_path_with_the_rows_boundaries_when_the_inner_attention_is_flash(monkeypatch):
    import transformers.modeling_flash_attention_utils as fa

    real, seen = inspect.signature(fa._flash_attention_forward), {}

    def varlen(q, k, v, mask, **kw):  # q/k/v (1, N, h, D)
        real.bind(q, k, v, mask, **kw)
        seen.update(kw, mask=mask)
        cu = kw["cu_seq_lens_q"].tolist()
        parts = [torch.nn.functional.scaled_dot_product_attention(
            *(t[:, a:b].transpose(1, 2) for t in (q, k, v)), is_causal=True, scale=kw["softmax_scale"]
        ).transpose(1, 2) for a, b in zip(cu, cu[1:])]  # fmt: skip
        return torch.cat(parts, dim=1)

    monkeypatch.setattr(fa, "_flash_attention_forward", varlen)
    batch = pack_batch([Sample([1, 2, 3], [4, 5]), Sample([1, 2], [3, 4, 5, 6])], pad_id=0)  # 5 + 6 tokens
    row = Row(batch.cu_seqlens, batch.max_seqlen)
    q, k, v = torch.randn(3, 1, 2, 11, 32).unbind(0)
    module = torch.nn.Linear(2, 2)  # an attention module's stand-in: its weights' dtype is flash's target
    module.config = SimpleNamespace()
    flash = _attend(module, q, k, v, row, "flash_attention_2", 0.0, 0.2, None, None)
    torch.testing.assert_close(flash, _attend(module, q, k, v, row, "sdpa", 0.0, 0.2, None, None))
    assert seen["attn_implementation"] == "flash_attention_2" and seen["mask"] is None
    assert seen["cu_seq_lens_q"].tolist() == [0, 5, 11] and seen["max_length_q"] == 6
