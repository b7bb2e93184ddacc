"""Token logprobs (and entropy) straight from the last hidden states, the LM head's matmul inside the loop,
so no (tokens x vocabulary) tensor is ever held whole: not the logits, not their float32 copy, not their
gradient.

``linear_logprobs(hidden, weight, bias, labels)`` equals ``logprobs_and_entropy(F.linear(hidden, weight,
bias), labels)`` (:mod:`trainer.algorithms.core_algos`) to float32 rounding, with the head's own
post-processing and the sampling temperature (``x / T`` in float32) applied as the model and today's pass
apply them. The post-processing is a ``transform``: the ops a model's forward runs on its logits after the
head, in its order and in the logits' dtype (:data:`OPS`: Granite divides by ``logits_scaling``, Cohere
multiplies by ``logit_scale``, Gemma caps, ``cap * tanh(z / cap)``; :func:`trainer.policy.forward.head_transform`
reads them off the model). The backward runs the same ops in reverse, each as autograd differentiates it.

It works on tiles of (positions x vocabulary block). Forward: the tile's logits ``h @ W_b.T (+ b_b)``
in the model's dtype, then float32; an online log-sum-exp over the vocabulary blocks (flash attention's
rescaling) gives each position's log-normaliser, its label's logit and, for the entropy, the running
``sum exp(x - m) x``. Only the hidden states, the weight (a reference to the module's own), the labels
and the (N,) log-normalisers are saved. Backward recomputes each tile's logits, its softmax from the
saved log-normaliser, and the logits' gradient ``s g (onehot(y) - p)`` (s = 1 / T), then
``grad_hidden += G @ W_b`` (float32, (N, H)) and ``grad_W[b] = G.T @ h``, ``grad_b[b] = G.sum(0)``: one
matmul per vocabulary block over all positions when they fit in a tile, so the weight's gradient is
rounded once, as the plain head's is. This recomputes the head's matmul once more than autograd
(Liger's fused linear cross-entropy pays the same; it can fold the backward into the forward because its
loss is the last op, while here the per-token gradient comes from the GRPO objective afterwards).

The tile size bounds the float32 working set: about 2 MiB on a CPU, so a tile is still in cache when
it is read again, and 64 MiB on an accelerator, where a (4096 x 4096) tile of a 4096-wide model is still
about 140 GFLOP per matmul (:func:`tile_elements`). A vocabulary block is at least :data:`MIN_BLOCK` wide,
so a matmul never shrinks to a sliver of the weight; positions beyond what one tile holds are split into
several row chunks.

A tile's math is two functions, :func:`forward_tile` and :func:`backward_tile`, run as they are (eager: about
ten kernels a tile, each reading and writing the whole tile, 8-24 bytes per tile element at the peak by what
the run does, :func:`tile_bytes`) or compiled (``fused``, ``policy.fused_head``): inductor makes the matmul
and one pass over the tile of everything after it, 16-bit roundings where eager has them, so the logprobs and
gradients are the eager tile's to float32 rounding, in 2-8 bytes per element. The sizes are symbolic, so the
row count and the last block's width do not recompile (a size of 1 compiles once more). The eager tile is
the default on every device for now (:func:`fused_default`: on a CPU the fused tile wins on the head alone,
bench/bench_head.py, but not yet on a whole step once its compile is paid; a GPU's waits for ``make
bench-gpu``). The hidden states' gradient is summed in float32 in place
(``addmm_`` for a float32 model; for a 16-bit one each block's product is rounded to its dtype first, as
before: torch 2.13 has a 16-bit matmul into float32 on CUDA alone).

Entropy has no gradient (a metric), as in today's pass. Logits that are -inf everywhere in a row (never
produced by a finite matmul) are not supported.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

MIN_BLOCK = 256  # vocabulary entries per tile, at least: below this the matmuls stop paying for themselves
BLOCK_ALIGN = 128  # a block is a multiple of this many vocabulary entries (MIN_BLOCK is one)


def tile_elements(device: torch.device) -> int:
    """Float32 elements per (positions x vocabulary) tile: cache-sized on a CPU, few launches on an accelerator."""
    return 2**19 if device.type == "cpu" else 2**24


def tiles(rows: int, vocab: int, budget: int) -> tuple[int, int]:
    """(positions per row chunk, vocabulary entries per block) for ``rows`` positions within ``budget``
    elements: every position in one chunk where a block of at least MIN_BLOCK allows it. A block is a
    multiple of BLOCK_ALIGN entries, so every tile's rows start on an aligned address: with an odd
    width, cuBLAS falls back to its unaligned kernels (``..._align1``), far slower on a GPU
    (bench/README.md, "The LM head a tile at a time")."""
    block = min(vocab, max(MIN_BLOCK, budget // max(rows, 1) // BLOCK_ALIGN * BLOCK_ALIGN))
    return min(rows, max(1, budget // block)) or 1, block


def tile_bytes(dtype_bytes: int, transform: Transform = (), scaled: bool = False, with_entropy: bool = False,
               fused: bool = False) -> tuple[int, int]:  # fmt: skip
    """Bytes per tile element at the forward's peak and at the backward's, for logits of ``dtype_bytes``
    (the model's dtype), the model's ``transform``, a temperature other than 1 (``scaled``) and entropy: what
    the tile functions hold at once, counted tensor by tensor (held to torch's measured peaks in
    tests/test_plan.py; :mod:`trainer.tools.plan` plans from it).

    Eager, forward: the logits (d), their float32 copy where it is a tensor of its own (16-bit logits, a
    transform or a temperature make one), ``exp(x - m)`` (f), and for the entropy ``e > 0``, ``e x`` and its
    masked copy (1 + 2f). Backward: the logits, the transform's output and each softcap's saved tanh (d each),
    then either the float32 softmax gradient beside its cast to the model's dtype, or the transform's
    backward (one op's temporaries beside the gradient). Fused, the pass after the matmul keeps little of the
    tile's size: in float32 the logits, and in backward the transform's output; in 16 bits the logits and,
    where emulating eager's roundings makes one, a rounded copy (measured: a softcap's forward and every
    backward hold three tiles of the model's dtype)."""
    d, f = dtype_bytes, max(dtype_bytes, 4)  # the model's dtype; float32 (float64 kept)
    own = d < f or scaled  # the float32 logits (and their gradient) are a tensor of their own
    softcap = any(op == "softcap" for op, _ in transform)
    if fused:  # as measured: in 16 bits inductor keeps a tile where it rounds as eager does
        if d < 4:
            return (3 * d if softcap else d + d // 2), 3 * d
        return d, d + d * bool(transform)
    # the logits, the op's input and its output (a softcap's tanh too), while the transform runs
    transforming = d * (1 + min(len(transform), 2) + softcap) if transform else 0
    forward = d + f * (own or bool(transform)) + f + (1 + 2 * f) * with_entropy
    held = d + d * bool(transform) + d * sum(op == "softcap" for op, _ in transform)
    # float32 logits, scaled beside themselves, then the gradient cast beside them; or in the logits' buffer
    softmax = held + (f + max(f * scaled, d) if d < f else f * scaled)
    through = held + d * own + (2 * d if softcap else d)
    return max(forward, transforming), max(softmax, through if transform else 0)


# What a model may do to its logits after the head, each with its constant c: ``z * c``, ``z / c``, and
# ``c * tanh(z / c)`` (the three ops of Gemma's forward, in its order).
OPS = ("mul", "div", "softcap")
Transform = tuple[tuple[str, float], ...]  # the ops in the order the model's forward runs them


def _transformed(z: Tensor, transform: Transform) -> tuple[Tensor, list[Tensor]]:
    """The head's post-processing as the model runs it, in the logits' dtype; also each softcap's tanh
    output, for the backward."""
    saved = []
    for op, c in transform:
        if op == "mul":
            z = z * c
        elif op == "div":
            z = z / c
        else:
            t = torch.tanh(z / c)
            saved.append(t)
            z = t * c
    return z, saved


def _transform_backward(grad: Tensor, transform: Transform, saved: list[Tensor]) -> Tensor:
    """The gradient of the transformed logits -> that of the head's output, op by op in reverse as autograd
    differentiates each, in the logits' dtype."""
    for op, c in reversed(transform):
        if op == "mul":
            grad = grad * c
        elif op == "div":
            grad = grad / c
        else:  # through c * tanh(z / c)
            grad = torch.ops.aten.tanh_backward(grad * c, saved.pop()) / c
    return grad


# ----- one tile: the math, run as it is (eager) or compiled into a few fused kernels --------------------


def forward_tile(h: Tensor, w: Tensor, b: Tensor | None, y: Tensor, m: Tensor, s: Tensor, t: Tensor | None,
                 picked: Tensor, transform: Transform, scale: float):  # fmt: skip
    """One (n, b) tile of the forward's online log-sum-exp: h (n, H), w (b, H), b (b,) or None, y (n,) the
    labels less the block's first entry; m, s, t, picked (n,) the running max, sum of ``exp(x - m)``, sum of
    ``exp(x - m) x`` (None: no entropy) and the label's logit, in float32 (float64 kept) -> their new values.
    Nothing of the tile's size outlives the call, so the next tile's logits never sit beside this one's."""
    z = F.linear(h, w, b)  # (n, b) in the model's dtype, as the plain head computes it
    x = _transformed(z, transform)[0].to(m.dtype)  # a new tensor unless the model computes in float32
    if scale != 1.0:
        x = x * scale
    m_new = torch.maximum(m, x.amax(-1))
    e = torch.sub(x, m_new[:, None]).exp_()  # (n, b)
    alpha = torch.exp(m - m_new)  # 0 on the first block (m = -inf)
    s = s * alpha + e.sum(-1)
    if t is not None:  # e == 0 where x == -inf, and 0 * -inf is NaN: the limit is 0
        t = t * alpha + torch.where(e > 0, e * x, 0.0).sum(-1)
    width = x.shape[1]
    inside = (y >= 0) & (y < width)
    picked = torch.where(inside, x.gather(-1, y.clamp(0, width - 1)[:, None]).squeeze(-1), picked)
    return m_new, s, t, picked


def backward_tile(h: Tensor, w: Tensor, b: Tensor | None, y: Tensor, lse: Tensor, g: Tensor,
                  transform: Transform, scale: float) -> Tensor:  # fmt: skip
    """The gradient of one tile's head output, (n, b) in the model's dtype: the logits recomputed, their
    softmax from the saved log-normaliser ``lse`` (n,), ``s g (onehot(y) - p)`` with ``g`` (n,) the upstream
    gradient already times s, then back through the model's transform. y as in :func:`forward_tile`."""
    z = F.linear(h, w, b)  # (n, b) in the model's dtype, as the plain head computed it
    logits, saved = _transformed(z, transform)
    grad = logits.to(lse.dtype)  # a new tensor, or the float32 logits, not needed again
    if scale != 1.0:
        grad = grad * scale
    grad = grad.sub_(lse[:, None]).exp_().mul_(-g[:, None])  # -g p, in place
    width = grad.shape[1]
    inside = (y >= 0) & (y < width)
    grad.scatter_add_(-1, y.clamp(0, width - 1)[:, None], torch.where(inside, g, 0.0)[:, None])
    grad = grad.to(z.dtype)  # the logits' gradient in their dtype, as autograd's would be
    if transform:
        grad = _transform_backward(grad, transform, saved)
    return grad


# The tile functions compiled, by what shapes their graph (:func:`_fused`); each made on first use.
_FUSED: dict[tuple, Callable] = {}


def _fused(fn: Callable, key: tuple) -> Callable:
    """``fn`` compiled by inductor into the matmul and one fused pass over the tile, with every size
    symbolic: the row count and the last block's width change between calls, and a graph per shape would
    recompile every step. One compiled copy per ``key`` (what the graph depends on: the transform, whether
    the logits are scaled, entropy, dtype, bias), each of its own code object: dynamo counts recompiles per
    code object, and a process that meets several (the logprob pass without entropy, the training pass with
    it; tests) would otherwise reach its limit. Its tensors come detached: a view would have dynamo guard on
    its base's layout and a parameter on its requires_grad (the policy's weight and the reference's), each
    change a recompile. 16-bit intermediates are rounded where eager rounds them
    (``emulate_precision_casts``), so the fused tile gives the eager tile's numbers."""
    if (fn.__name__, key) not in _FUSED:
        clone = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__)
        _FUSED[fn.__name__, key] = torch.compile(
            clone, dynamic=True, fullgraph=True, options={"emulate_precision_casts": True}
        )
    return _FUSED[fn.__name__, key]


def _compilable() -> bool:
    """Whether a compiled tile can run here: not under a TorchDispatchMode (a memory tracker, a test counting
    ops), which torch.compile refuses; those see the eager tile's ops, the same math."""
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode

    return not is_in_torch_dispatch_mode(include_infra_modes=False)


def fused_default(device: torch.device) -> bool:
    """Whether a tile runs compiled when the run does not say (``policy.fused_head: null``): not yet, on any
    device. On a CPU the head alone measured 1.05-1.25x (float32) and 1.5-2x (bfloat16) faster
    (bench/bench_head.py), but each variant compiles for 20-30 s in every rank's process and needs a C++
    compiler, and a whole training step at the demo's size did not gain (``make bench-train``: 0.90x, loaded
    machine); an accelerator's default waits for ``make bench-gpu``."""
    del device
    return False


def _accumulate(grad_h: Tensor, grad: Tensor, w: Tensor) -> None:
    """``grad_h += grad @ w``, grad_h (n, H) float32, grad (n, b) and w (b, H) in the model's dtype: in
    place, without a float32 copy of the product. A 16-bit block's product is rounded to its dtype before the
    float32 sum (torch 2.13 has a 16-bit matmul into float32, ``out_dtype``, on CUDA alone)."""
    if grad.dtype == grad_h.dtype:
        grad_h.addmm_(grad, w)
    else:
        grad_h.add_(torch.mm(grad, w))


class _LinearLogprobs(torch.autograd.Function):
    """(N, H) hidden, (V, H) weight, (V,) bias or None, (N,) labels -> (N,) logprobs, (N,) or (0,) entropy."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, scale: float,
                transform: Transform, with_entropy: bool, budget: int, shape: torch.Size, fused: bool):  # fmt: skip
        n, vocab = hidden.shape[0], weight.shape[0]
        dtype = torch.promote_types(hidden.dtype, torch.float32)  # float64 stays float64
        step, block = tiles(n, vocab, budget)
        fused = fused and _compilable()
        key = (transform, scale != 1.0, with_entropy, hidden.dtype, bias is None)
        tile = _fused(forward_tile, key) if fused else forward_tile
        # Returned in the labels' shape, not as views of (N,) tensors (FSDP hooks a module's outputs, and
        # an in-place op on a view would drop its hook).
        result = torch.empty(shape, dtype=dtype, device=hidden.device)
        out = result.view(-1)
        lse = torch.empty(n, dtype=dtype, device=hidden.device)
        entropy_result = torch.empty_like(result) if with_entropy else result.new_empty(0)
        entropy = entropy_result.view(-1)
        for r0 in range(0, n, step):
            rows = slice(r0, r0 + step)
            h, y = hidden[rows].detach(), labels[rows]
            m = torch.full((h.shape[0],), float("-inf"), dtype=dtype, device=h.device)  # running max
            s = torch.zeros_like(m)  # running sum of exp(x - m)
            t = torch.zeros_like(m) if with_entropy else None  # running sum of exp(x - m) * x
            picked = torch.zeros_like(m)  # the label's logit
            for v0 in range(0, vocab, block):
                b = None if bias is None else bias[v0 : v0 + block].detach()
                w = weight[v0 : v0 + block].detach()  # a tensor of its own: see _fused
                m, s, t, picked = tile(h, w, b, y - v0, m, s, t, picked, transform, scale)
            lse[rows] = m + torch.log(s)
            out[rows] = picked - lse[rows]
            if t is not None:  # H = lse - sum p x, p = exp(x - m) / s
                entropy[rows] = lse[rows] - t / s
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.scale, ctx.transform, ctx.budget, ctx.fused = scale, transform, budget, fused
        ctx.mark_non_differentiable(entropy_result)
        return result, entropy_result

    @staticmethod
    def backward(ctx, grad_out: Tensor, _grad_entropy: Tensor):
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        n, vocab = hidden.shape[0], weight.shape[0]
        none = (None,) * 7  # labels, scale, transform, with_entropy, budget, shape, fused
        if n == 0:  # no position (a window of one token has nothing after its first): nothing flows back
            return (torch.zeros_like(hidden) if want_h else None, None, None, *none)
        step, block = tiles(n, vocab, ctx.budget)
        key = (ctx.transform, ctx.scale != 1.0, hidden.dtype, bias is None)
        tile = _fused(backward_tile, key) if ctx.fused and _compilable() else backward_tile
        # (N,): d(s x[y] - lse(s x))/dx = s (onehot(y) - softmax(s x))
        g_all = grad_out.reshape(-1).to(lse.dtype) * ctx.scale
        grad_h = torch.zeros(hidden.shape, dtype=lse.dtype, device=hidden.device) if want_h else None
        grad_w = torch.empty_like(weight) if want_w else None
        grad_b = torch.empty_like(bias) if want_b else None
        one_chunk = step >= n
        for v0 in range(0, vocab, block):
            w = weight[v0 : v0 + block].detach()  # tensors of their own: see _fused
            b = None if bias is None else bias[v0 : v0 + block].detach()
            acc_w: Tensor | None = None  # float32 sums over row chunks, where there are several
            acc_b: Tensor | None = None
            for r0 in range(0, n, step):
                rows = slice(r0, r0 + step)
                h = hidden[rows].detach()
                g = g_all[rows].detach()
                grad = tile(h, w, b, labels[rows] - v0, lse[rows].detach(), g, ctx.transform, ctx.scale)
                if grad_h is not None:
                    _accumulate(grad_h[rows], grad, w)
                if grad_w is not None:
                    if one_chunk:  # straight into the block's rows of the gradient
                        torch.mm(grad.t(), h, out=grad_w[v0 : v0 + block])
                    else:
                        part_w = grad.t() @ h  # (b, H)
                        acc_w = part_w.to(lse.dtype) if acc_w is None else acc_w.add_(part_w)
                if grad_b is not None:
                    part_b = grad.sum(0)  # (b,)
                    if one_chunk:
                        grad_b[v0 : v0 + block] = part_b
                    else:
                        acc_b = part_b.to(lse.dtype) if acc_b is None else acc_b.add_(part_b)
                del grad  # before the next tile's logits are made
            # the sums over several row chunks (one chunk wrote its block above)
            if grad_w is not None and acc_w is not None:
                grad_w[v0 : v0 + block] = acc_w
            if grad_b is not None and acc_b is not None:
                grad_b[v0 : v0 + block] = acc_b
        grad_h = grad_h.to(hidden.dtype) if grad_h is not None else None
        return grad_h, grad_w, grad_b, *none


def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    transform: Transform = (),
    softcap: float | None = None,
    with_entropy: bool = False,
    budget: int | None = None,
    fused: bool | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Logprobs of ``labels`` (...,) under ``transform(hidden @ weight.T + bias) / temperature``, hidden (..., H),
    weight (V, H), bias (V,) or None; with ``with_entropy`` also the (...,) entropies (no gradient). Both in
    float32 (float64 kept), with gradients to the hidden states, the weight and the bias. ``transform``: the
    model's ops after its head (:data:`OPS`), ``softcap`` a last ``("softcap", softcap)`` among them.
    ``budget``: float32 elements per tile (default :func:`tile_elements` for the device); ``fused``: the tiles
    compiled (None: :func:`fused_default` for the device)."""
    ops: Transform = tuple((op, float(c)) for op, c in transform) + (
        (("softcap", float(softcap)),) if softcap is not None else ()
    )
    for op, _ in ops:
        if op not in OPS:
            raise ValueError(f"linear_logprobs: unknown transform op {op!r}; the ops are {', '.join(OPS)}")
    flat = hidden.reshape(-1, hidden.shape[-1])
    if budget is None:
        budget = tile_elements(hidden.device)
    out, entropy = _LinearLogprobs.apply(
        flat,
        weight,
        bias,
        labels.long().reshape(-1),
        1.0 / temperature,
        ops,
        with_entropy,
        budget,
        labels.shape,
        fused_default(hidden.device) if fused is None else fused,
    )
    return out, entropy if with_entropy else None
