"""Packed rows' attention on CUDA: torch's varlen kernel (trainer.policy.packed_attention._varlen, one call
over the whole row) against the per-sample sdpa loop it replaces, forward and backward, in bf16 and fp16,
with grouped-query heads (fewer key/value heads, as SmolLM2, Qwen and Gemma have) and a sliding window.
CPU tests check the call against a stand-in with the installed torch's signature; this runs the kernel.
"""

from __future__ import annotations

import pytest
import torch

from .conftest import needs_gpus

pytestmark = [pytest.mark.gpu, needs_gpus(1)]

LENGTHS = [37, 1, 300, 128, 64, 511, 9, 250]  # ragged, one of a single token


def _row_and_qkv(dtype, heads=9, kv_heads=3, head_dim=64):
    from trainer.policy.packed_attention import Row

    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    n = int(cu[-1])
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, heads, n, head_dim, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(1, kv_heads, n, head_dim, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    return Row(cu, max(LENGTHS)), q, k, v


def _run(fn, q, k, v, grad):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_should_match_sdpa_per_sample_forward_and_backward_when_torchs_varlen_kernel_runs_the_row(
    dtype, window
):
    from trainer.policy import packed_attention as pa

    if pa._varlen_attn() is None:
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn")
    if not pa._flash_device(torch.device("cuda")):
        pytest.skip("this GPU or torch build has no flash attention (sm80+)")
    # and a rank here takes packed rows over the shared-prompt layout (PolicyWorker._prefix_layouts)
    assert pa.fused_rows(torch.device("cuda"), dtype, "sdpa")
    params = pa._parameters(pa._varlen_attn())
    row, q, k, v = _row_and_qkv(dtype)
    scale = 0.1 if "scale" in params else None  # torch 2.10's varlen_attn has only the default scale
    if window is not None and "window_size" not in params:  # can't say a window: the loop runs it
        assert pa._varlen(q, k, v, row, 0.0, scale, window) is None
        return
    grad = torch.randn(1, q.shape[2], q.shape[1], q.shape[3], device="cuda", dtype=dtype)
    row.attention.refused.clear()
    refused = row.attention.refused
    assert pa._varlen(q, k, v, row, 0.0, scale, window) is not None, refused  # the kernel takes it
    fused = _run(lambda a, b, c: pa._varlen(a, b, c, row, 0.0, scale, window), q, k, v, grad)
    loop = _run(lambda a, b, c: pa._per_sample(a, b, c, row, 0.0, scale, window), q, k, v, grad)
    # the whole _attend takes the kernel too
    torch.testing.assert_close(pa._attend(None, q, k, v, row, "sdpa", 0.0, scale, window, None), fused[0])
    for name, a, b in zip(("out", "dq", "dk", "dv"), fused, loop):  # both round once from float32 sums
        assert a.shape == b.shape and a.dtype == b.dtype == dtype, name
        scale_of = b.float().abs().max().item()
        diff = (a.float() - b.float()).abs().max().item()
        assert diff <= 2e-2 * scale_of, f"{name}: max abs diff {diff} against a largest value of {scale_of}"
