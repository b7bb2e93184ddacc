"""The policy's attention over packed rows (trainer.policy.packed_attention) against plain references.

Per-sample sdpa must equal a dense block-diagonal causal mask over the row (the sliding window and
grouped-query attention included); a model with the function installed must give each packed sample
the logits of that sample run alone, and a padded batch the logits of transformers' own sdpa. The
flash branch (GPUs) runs here against a stand-in for transformers' function that checks every keyword
against the real signature, and torch's varlen kernel (CUDA) against a stand-in with the installed
torch's ``varlen_attn`` signature (and older ones) that computes flash attention's result from the
arguments it is given; on this CPU the loop runs.
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
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )
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


@pytest.fixture(params=["sdpa", "eager"])
def tiny(tiny_model_path, request):
    """The tiny model twice: as transformers runs it with ``request.param`` attention, and with the packed
    attention installed over that (cpu-demo trains with eager); and the installed attention."""
    from trainer.models import load_model

    plain = load_model(tiny_model_path, "float32", False).eval()
    plain.set_attn_implementation(request.param)
    packed = load_model(tiny_model_path, "float32", False).eval()
    packed.set_attn_implementation(request.param)
    assert packed_attention.takes(request.param, packed.config)
    yield plain, packed, packed_attention.install(packed, request.param)


def test_should_give_each_sample_its_own_logits_when_a_packed_row_runs_through_the_installed_attention(
    tiny, monkeypatch
):
    plain, packed, attention = tiny
    samples = [Sample([5, 6, 7], [8, 9]), Sample([5, 6], [7]), Sample([9, 8, 7, 6], [5, 4, 3, 2])]
    batch = pack_batch(samples, pad_id=0)
    row = attention.row(batch.cu_seqlens, batch.max_seqlen)

    def dense(module):  # eager over a row would compute its dense block-diagonal mask: every pair of the row
        raise AssertionError("a packed row ran the model's eager attention")

    monkeypatch.setattr(packed_attention, "_eager", dense)
    with torch.no_grad():
        logits = packed(
            input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False, packed_row=row
        ).logits
        for a, b in row.bounds:
            alone = plain(input_ids=batch.input_ids[:, a:b], use_cache=False).logits
            torch.testing.assert_close(logits[:, a:b], alone, rtol=1e-5, atol=1e-5)


def test_should_be_the_models_own_attention_when_the_batch_is_padded(tiny, monkeypatch):
    plain, packed, _ = tiny
    batch = pad_batch([Sample([5, 6, 7], [8, 9]), Sample([5, 6], [7])], pad_id=0)
    calls = []
    eager = packed_attention._eager
    monkeypatch.setattr(packed_attention, "_eager", lambda module: calls.append(module) or eager(module))
    with torch.no_grad():
        kwargs = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        torch.testing.assert_close(packed(**kwargs).logits, plain(**kwargs).logits)
    # eager stays eager off a row (its backward beats sdpa's masked one on CPU), with eager's additive mask
    assert bool(calls) == (plain.config._attn_implementation == "eager")


def test_should_leave_eager_attention_alone_when_the_model_caps_attention_logits():
    from types import SimpleNamespace as Config

    assert packed_attention.takes("eager", Config(attn_logit_softcapping=None))
    assert not packed_attention.takes("eager", Config(attn_logit_softcapping=50.0))  # sdpa cannot cap logits
    assert packed_attention.takes("sdpa", Config()) and not packed_attention.takes("flex_attention", Config())


def test_should_call_flash_attentions_varlen_path_with_the_rows_boundaries_when_the_inner_attention_is_flash(
    monkeypatch,
):
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


# torch's varlen kernel (packed_attention._varlen): CUDA only, so here it runs against a stand-in that
# has the installed torch's varlen_attn signature (or an older torch's), checks every call against it,
# and computes what flash attention's kernel would from the arguments it was given (cu_seqlens,
# window_size or is_causal, scale, grouped heads), independently of the per-sample loop.
def _real_varlen_signature() -> inspect.Signature:
    from torch.nn.attention.varlen import varlen_attn

    return inspect.signature(varlen_attn)


_T = inspect.Parameter
_OLD = {  # torch 2.10's signature (is_causal, no scale), and torch 2.11's (window_size and scale, no enable_gqa)
    "torch_2_10": inspect.Signature(
        [_T(n, _T.POSITIONAL_OR_KEYWORD) for n in ("query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k")]
        + [_T("is_causal", _T.POSITIONAL_OR_KEYWORD, default=False),
           _T("return_aux", _T.POSITIONAL_OR_KEYWORD, default=None)]),
    "torch_2_11": inspect.Signature(
        [_T(n, _T.POSITIONAL_OR_KEYWORD) for n in ("query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k")]
        + [_T(n, _T.KEYWORD_ONLY, default=d) for n, d in (("return_aux", None), ("scale", None),
                                                           ("window_size", (-1, -1)))]),
}  # fmt: skip


def _stand_in(signature: inspect.Signature, calls: list):
    def varlen_attn(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        q, k, v, cu = a["query"], a["key"], a["value"], a["cu_seq_q"]
        assert q.dim() == 3 and k.shape[0] == q.shape[0] and cu.dtype == torch.int32
        assert torch.equal(cu, a["cu_seq_k"]) and a["max_q"] == a["max_k"]
        if "enable_gqa" in a and not a["enable_gqa"] and k.shape[1] != q.shape[1]:
            raise ValueError(
                "Expect query and key/value to have the same number of heads"
            )  # torch 2.13's check
        window = a.get("window_size", (-1, 0) if a.get("is_causal") else (-1, -1))
        assert isinstance(window, tuple)  # varlen_attn tests `window_size == (-1, 0)`: a list is never causal
        left, right = window
        scale = a.get("scale") or q.shape[-1] ** -0.5
        kf, vf = (t.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        out = torch.zeros(q.shape, dtype=torch.float32)
        bounds = cu.tolist()
        for s, e in zip(bounds, bounds[1:]):
            i = torch.arange(e - s)
            seen = torch.ones(e - s, e - s, dtype=torch.bool)  # [query, key]: flash's window rule
            if right >= 0:
                seen &= i[None, :] <= i[:, None] + right
            if left >= 0:
                seen &= i[None, :] >= i[:, None] - left
            scores = torch.einsum("qhd,khd->hqk", q[s:e].float(), kf[s:e]) * scale
            out[s:e] = torch.einsum(
                "hqk,khd->qhd", scores.masked_fill(~seen, float("-inf")).softmax(-1), vf[s:e]
            )
        calls.append(
            {n: x for n, x in a.items() if n not in ("query", "key", "value", "cu_seq_q", "cu_seq_k")}
        )
        return out.to(q.dtype)

    varlen_attn.__signature__ = signature  # what packed_attention reads its keywords from
    return varlen_attn


@pytest.fixture
def varlen_on(monkeypatch):
    """Makes packed_attention take this CPU for a flash-capable GPU and call ``fn`` as torch's varlen_attn."""

    def use(fn):
        monkeypatch.setattr(packed_attention, "_varlen_attn", lambda: fn)
        monkeypatch.setattr(packed_attention, "_flash_device", lambda device: True)

    return use


def _qkv(kv_heads: int, dtype=torch.bfloat16, n: int = 20):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, n, 16, generator=g).to(dtype)
    k, v = (torch.randn(1, kv_heads, n, 16, generator=g).to(dtype) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("window", [None, 3, 7])  # 7: no sample is longer, so plain causal
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("scale", [0.25, None])
def test_should_call_torchs_varlen_kernel_once_per_row_with_the_installed_signature_when_on_a_flash_gpu(
    varlen_on, window, kv_heads, scale
):
    signature, calls = _real_varlen_signature(), []
    varlen_on(_stand_in(signature, calls))
    row = Row(torch.tensor([0, 5, 6, 13, 20], dtype=torch.int32), 7)  # samples of 5, 1, 7 and 7 tokens
    q, k, v = _qkv(kv_heads)
    got = _attend(torch.nn.Linear(2, 2).eval(), q, k, v, row, "sdpa", 0.0, scale, window, None)
    assert len(calls) == 1 and row.attention.refused == {}  # one kernel call for the whole row
    want = _dense(q.float(), k.float(), v.float(), row, window, scale if scale is not None else 16**-0.5)
    assert got.shape == want.shape == (1, 20, 4, 16) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    call = calls[0]
    assert call["max_q"] == 7
    if "window_size" in signature.parameters:
        assert call["window_size"] == ((-1, 0) if window in (None, 7) else (window - 1, 0))
    else:
        assert window in (None, 7) and call["is_causal"] is True
    if "scale" in signature.parameters:
        assert call["scale"] == scale
    if "enable_gqa" in signature.parameters:
        assert call["enable_gqa"] == (kv_heads != 4)


@pytest.mark.parametrize("old", sorted(_OLD))
@pytest.mark.parametrize("window", [None, 3])
def test_should_use_an_older_torchs_varlen_signature_or_fall_back_to_the_loop_when_it_cannot_say_the_call(
    varlen_on, old, window
):
    calls = []
    varlen_on(_stand_in(_OLD[old], calls))
    row = Row(torch.tensor([0, 5, 6, 13, 20], dtype=torch.int32), 7)
    q, k, v = _qkv(2)
    for scale in (16**-0.5, 0.25):  # the kernel's default scale, and one only a `scale` keyword can say
        calls.clear()
        got = _attend(torch.nn.Linear(2, 2).eval(), q, k, v, row, "sdpa", 0.0, scale, window, None)
        torch.testing.assert_close(
            got.float(), _dense(q.float(), k.float(), v.float(), row, window, scale), rtol=2e-2, atol=2e-2
        )
        expressible = old == "torch_2_11" or (window is None and scale == 16**-0.5)
        assert len(calls) == (1 if expressible else 0), (old, window, scale)
        if calls:
            assert "enable_gqa" not in calls[0]  # that torch hands grouped heads to the kernel as they are


def test_should_run_sdpa_per_sample_when_on_a_cpu_or_in_float32_or_with_dropout(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("varlen_attn called")

    monkeypatch.setattr(packed_attention, "_varlen_attn", lambda: refuse)
    row = Row(torch.tensor([0, 5, 6, 13, 20], dtype=torch.int32), 7)
    q, k, v = _qkv(2)
    # the real device check: this machine's CPU tensors never reach the kernel
    assert packed_attention._flash_device(q.device) is False
    module = torch.nn.Linear(2, 2).eval()
    got = _attend(module, q, k, v, row, "sdpa", 0.0, 0.25, None, None)
    torch.testing.assert_close(got, packed_attention._batched(q, k, v, row, 0.0, 0.25, None))  # CPU bf16
    q32, k32, v32 = (t.float() for t in (q, k, v))
    torch.testing.assert_close(
        _attend(module, q32, k32, v32, row, "sdpa", 0.0, 0.25, None, None),
        packed_attention._per_sample(q32, k32, v32, row, 0.0, 0.25, None),
    )
    # a flash-capable GPU still keeps float32 and dropout on the loop (the kernel has neither)
    monkeypatch.setattr(packed_attention, "_flash_device", lambda device: True)
    q32, k32, v32 = (t.float() for t in (q, k, v))
    torch.testing.assert_close(
        _attend(module, q32, k32, v32, row, "sdpa", 0.0, 0.25, None, None),
        _dense(q32, k32, v32, row, None, 0.25),
    )
    torch.manual_seed(0)
    dropped = _attend(module, q, k, v, row, "sdpa", 0.5, 0.25, None, None)
    assert dropped.shape == (1, 20, 4, 16)


def test_should_fall_back_to_the_loop_and_not_ask_again_when_the_kernel_refuses_a_shape(varlen_on, caplog):
    calls = []

    def refusing(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")

    refusing.__signature__ = _real_varlen_signature()
    varlen_on(refusing)
    row = Row(torch.tensor([0, 5, 6, 13, 20], dtype=torch.int32), 7)
    q, k, v = _qkv(2)
    module = torch.nn.Linear(2, 2).eval()
    with caplog.at_level("WARNING", logger=packed_attention.__name__):
        for _ in range(3):  # three layers
            got = _attend(module, q, k, v, row, "sdpa", 0.0, 0.25, None, None)
            # the tensors are on this CPU: its half-precision path (a GPU's would run sdpa per sample)
            torch.testing.assert_close(got, packed_attention._batched(q, k, v, row, 0.0, 0.25, None))
    assert len(calls) == 1 and len(row.attention.refused) == 1
    assert sum("refused" in r.getMessage() for r in caplog.records) == 1


def test_should_copy_the_rows_boundaries_to_the_device_once_when_every_layer_asks():
    row = Row(torch.tensor([0, 5, 11], dtype=torch.int64), 6)
    first = row.cu_on(torch.device("cpu"))
    assert first.dtype == torch.int32 and first.tolist() == [0, 5, 11]
    assert row.cu_on(torch.device("cpu")) is first


def test_should_call_rows_fused_only_where_one_varlen_call_runs_them(monkeypatch):
    cpu = torch.device("cpu")
    # this machine: CPU rows run sdpa per sample, whatever the dtype; a flash implementation is always fused
    assert not packed_attention.fused_rows(cpu, torch.bfloat16, "sdpa")
    assert packed_attention.fused_rows(cpu, torch.bfloat16, "flash_attention_2")
    monkeypatch.setattr(packed_attention, "_flash_device", lambda device: True)  # a GPU with flash attention
    assert packed_attention.fused_rows(cpu, torch.bfloat16, "sdpa")
    assert packed_attention.fused_rows(cpu, torch.float16, "sdpa")
    assert not packed_attention.fused_rows(cpu, torch.float32, "sdpa")  # the kernel has no float32
    assert not packed_attention.fused_rows(cpu, torch.bfloat16, "eager")
    monkeypatch.setattr(packed_attention, "_varlen_attn", lambda: None)  # a torch without varlen_attn
    assert not packed_attention.fused_rows(cpu, torch.bfloat16, "sdpa")


def test_should_pack_every_micro_batch_when_rows_are_fused_and_choose_by_positions_when_not():
    from trainer.config import load
    from trainer.policy.worker import PolicyWorker

    worker = PolicyWorker.__new__(PolicyWorker)  # the choice alone: no process group, no model
    worker.cfg, worker.sp, worker.device = load(["experiment=tiny"]), None, torch.device("cpu")
    group = [
        Sample(list(range(1, 21)), [30 + i] * 5, advantage=1.0) for i in range(4)
    ]  # 40 positions vs 100 packed
    ragged = [Sample([1, 2], list(range(3, 3 + n)), advantage=1.0) for n in (60, 2, 3, 4)]
    worker._fused_rows = False  # CPU: sdpa per sample, the position count decides
    assert worker._prefix_layouts([group, ragged]) == [True, False]
    worker._fused_rows = (
        True  # a GPU's varlen kernel: packed rows beat the shared-prompt layout everywhere measured
    )
    assert worker._prefix_layouts([group, ragged]) == [False, False]


# Samples of 5, 1, 7, 7 and 60 tokens: the short ones share a batch, the long one is alone.
SKEWED = [0, 5, 6, 13, 20, 80]


@pytest.mark.parametrize("max_len", [256, 20])  # 20: the 60-token sample runs sdpa alone
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_should_equal_a_dense_block_diagonal_mask_forward_and_backward_when_samples_attend_in_batches(
    window, kv_heads, max_len, monkeypatch
):
    monkeypatch.setattr(packed_attention, "BATCH_MAX_LEN", max_len)
    row = Row(torch.tensor(SKEWED, dtype=torch.int32), 60)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 80, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, 80, 16, generator=g, requires_grad=True) for _ in range(2))
    got = packed_attention._batched(q, k, v, row, 0.0, 0.25, window)  # float32: exact up to summation order
    want = _dense(q, k, v, row, window, 0.25)
    torch.testing.assert_close(got, want)
    grad = torch.randn(want.shape, generator=g)
    # the pad slots' queries see no key under a window: a NaN there would reach the real keys' gradients
    for a, b in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(a, b)
    batches = row._batches[(q.device, 4, window)]
    assert (len(batches.index), len(batches.alone)) == ((2, 0) if max_len == 256 else (1, 1))


def test_should_not_pad_a_short_sample_to_a_long_ones_length_or_let_one_batchs_scores_grow_past_the_cap(
    monkeypatch,
):
    row = Row(torch.tensor([0, 4, 9, 15, 75], dtype=torch.int32), 60)  # 4, 5, 6 and 60 tokens
    batches = packed_attention.Batches(row, 4, None, torch.device("cpu"))
    assert [tuple(i.shape) for i in batches.index] == [(3, 6), (1, 60)]
    assert len(set(batches.where.tolist())) == 75  # every token once
    monkeypatch.setattr(packed_attention, "SCORE_BYTES", 2 * 4 * 6 * 6 * 4)  # two 6-token samples' scores
    assert [tuple(i.shape) for i in packed_attention.Batches(row, 4, None, torch.device("cpu")).index] == [
        (2, 5),
        (1, 6),
        (1, 60),
    ]


def test_should_give_each_sample_its_logits_in_bfloat16_when_a_cpu_row_runs_as_batches(tiny_model_path):
    from trainer.models import load_model

    model = load_model(tiny_model_path, "bfloat16", False).eval()
    model.set_attn_implementation("eager")
    attention = packed_attention.install(model, "eager")
    samples = [Sample([5, 6, 7], [8, 9]), Sample([5, 6], [7]), Sample([9, 8, 7, 6], [5, 4, 3, 2])]
    batch = pack_batch(samples, pad_id=0)
    row = attention.row(batch.cu_seqlens, batch.max_seqlen)
    with torch.no_grad():
        logits = model(
            input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False, packed_row=row
        ).logits.float()
        assert row._batches, "a CPU bfloat16 row did not run as batches"
        for a, b in row.bounds:  # each sample alone, through the model's own eager attention
            ids = batch.input_ids[:, a:b]
            alone = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits.float()
            torch.testing.assert_close(logits[:, a:b], alone, rtol=0.02, atol=0.05)


@pytest.mark.integration  # writes each family's model
@pytest.mark.parametrize(
    "family", ["llama3", "qwen2.5", "qwen3", "qwen3-moe", "gemma3", "mistral", "granite", "smollm2"]
)
def test_should_give_each_sample_its_own_logits_through_batches_on_each_familys_attention(
    family, tmp_path, monkeypatch
):
    """The batched rows against each family's own attention: Gemma 3's sliding window (4 tokens, shorter than
    the samples) beside a global layer and its query_pre_attn_scalar, Granite's attention_multiplier as the
    scale, Qwen3's q/k norms, grouped-query heads everywhere (tests/families/models.py). In float32, made to
    take the batches, so that a wrong window or scale shows beyond rounding (bf16 rounds these wide logits
    by up to 0.09 either way)."""
    from tests.families.models import build_family_model
    from trainer.models import load_model

    monkeypatch.setattr(packed_attention, "HALF", (torch.float32,))
    path = build_family_model(family, str(tmp_path / family))
    model = load_model(path, "float32", False).eval()
    model.set_attn_implementation("eager")
    attention = packed_attention.install(model, "eager")
    samples = [Sample([5, 6, 7, 8], [9, 10]), Sample([5, 6], [7]), Sample([9, 8, 7, 6, 5], [4, 3, 2, 11])]
    batch = pack_batch(samples, pad_id=0)
    row = attention.row(batch.cu_seqlens, batch.max_seqlen)
    with torch.no_grad():
        logits = model(
            input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False, packed_row=row
        ).logits.float()
        assert row._batches, "the row did not run as batches"
        for a, b in row.bounds:
            ids = batch.input_ids[:, a:b]
            alone = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits.float()
            torch.testing.assert_close(logits[:, a:b], alone, rtol=1e-4, atol=1e-4)
