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
about 140 GFLOP per matmul (:func:`tile_elements`). A tile's working set is about 12 bytes per element at
its peak (the logits in the model's dtype, their float32 copy, reused for the softmax and its gradient,
and the gradient in the model's dtype: :data:`TILE_BYTES`). A vocabulary block is at least
:data:`MIN_BLOCK` wide, so a matmul never shrinks to a sliver of the weight; positions beyond what one
tile holds are split into several row chunks.

Entropy has no gradient (a metric), as in today's pass. Logits that are -inf everywhere in a row (never
produced by a finite matmul) are not supported.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

MIN_BLOCK = 256  # vocabulary entries per tile, at least: below this the matmuls stop paying for themselves
TILE_BYTES = 12  # per tile element at the peak (trainer.tools.plan counts it)
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


class _LinearLogprobs(torch.autograd.Function):
    """(N, H) hidden, (V, H) weight, (V,) bias or None, (N,) labels -> (N,) logprobs, (N,) or (0,) entropy."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, scale: float,
                transform: Transform, with_entropy: bool, budget: int, shape: torch.Size):  # fmt: skip
        n, vocab = hidden.shape[0], weight.shape[0]
        dtype = torch.promote_types(hidden.dtype, torch.float32)  # float64 stays float64
        step, block = tiles(n, vocab, budget)
        # Returned in the labels' shape, not as views of (N,) tensors (FSDP hooks a module's outputs, and
        # an in-place op on a view would drop its hook).
        result = torch.empty(shape, dtype=dtype, device=hidden.device)
        out = result.view(-1)
        lse = torch.empty(n, dtype=dtype, device=hidden.device)
        entropy_result = torch.empty_like(result) if with_entropy else result.new_empty(0)
        entropy = entropy_result.view(-1)
        for r0 in range(0, n, step):
            rows = slice(r0, r0 + step)
            h, y = hidden[rows], labels[rows]
            m = torch.full((h.shape[0],), float("-inf"), dtype=dtype, device=h.device)  # running max
            s = torch.zeros_like(m)  # running sum of exp(x - m)
            t = torch.zeros_like(m) if with_entropy else None  # running sum of exp(x - m) * x
            picked = torch.zeros_like(m)  # the label's logit
            for v0 in range(0, vocab, block):
                w = weight[v0 : v0 + block]
                z = F.linear(h, w, None if bias is None else bias[v0 : v0 + block])
                x = _transformed(z, transform)[0]
                x = x.to(dtype)  # a new tensor unless the model computes in float32 (then the matmul's own)
                if scale != 1.0:
                    x = x * scale
                m_new = torch.maximum(m, x.amax(-1))
                e = torch.sub(x, m_new[:, None]).exp_()  # (n, b)
                alpha = torch.exp(m - m_new)  # 0 on the first block (m = -inf)
                s = s * alpha + e.sum(-1)
                if t is not None:  # e == 0 where x == -inf, and 0 * -inf is NaN: the limit is 0
                    t = t * alpha + torch.where(e > 0, e * x, 0.0).sum(-1)
                inside = (y >= v0) & (y < v0 + w.shape[0])
                at = (y - v0).clamp(0, w.shape[0] - 1)
                picked = torch.where(inside, x.gather(-1, at[:, None]).squeeze(-1), picked)
                m = m_new
            lse[rows] = m + torch.log(s)
            out[rows] = picked - lse[rows]
            if t is not None:  # H = lse - sum p x, p = exp(x - m) / s
                entropy[rows] = lse[rows] - t / s
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.scale, ctx.transform, ctx.budget = scale, transform, budget
        ctx.mark_non_differentiable(entropy_result)
        return result, entropy_result

    @staticmethod
    def backward(ctx, grad_out: Tensor, _grad_entropy: Tensor):
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        n, vocab = hidden.shape[0], weight.shape[0]
        if n == 0:  # no position (a window of one token has nothing after its first): nothing flows back
            return (
                torch.zeros_like(hidden) if want_h else None,
                None,
                None,
                None,
                None,
                None,
                None,
                None,
                None,
            )
        step, block = tiles(n, vocab, ctx.budget)
        g_all = (
            grad_out.reshape(-1).to(lse.dtype) * ctx.scale
        )  # (N,): d(s x[y] - lse(s x))/dx = s (onehot(y) - softmax(s x))
        grad_h = torch.zeros(hidden.shape, dtype=lse.dtype, device=hidden.device) if want_h else None
        grad_w = torch.empty_like(weight) if want_w else None
        grad_b = torch.empty_like(bias) if want_b else None
        one_chunk = step >= n
        for v0 in range(0, vocab, block):
            w = weight[v0 : v0 + block]
            b = None if bias is None else bias[v0 : v0 + block]
            acc_w: Tensor | None = None  # float32 sums over row chunks, where there are several
            acc_b: Tensor | None = None
            for r0 in range(0, n, step):
                rows = slice(r0, r0 + step)
                h, y, g = hidden[rows], labels[rows], g_all[rows]
                z = F.linear(h, w, b)  # (n, b) in the model's dtype, as the plain head computed it
                logits, saved = _transformed(z, ctx.transform)
                x = logits.to(lse.dtype)
                if ctx.scale != 1.0:
                    x = x * ctx.scale
                # -g p, in x's buffer: x is a new tensor, or the float32 logits that are not needed again
                grad = x.sub_(lse[rows, None]).exp_().mul_(-g[:, None])
                inside = (y >= v0) & (y < v0 + w.shape[0])
                at = (y - v0).clamp(0, w.shape[0] - 1)
                grad.scatter_add_(-1, at[:, None], torch.where(inside, g, 0.0)[:, None])
                grad = grad.to(z.dtype)  # the logits' gradient in their dtype, as autograd's would be
                if ctx.transform:
                    grad = _transform_backward(grad, ctx.transform, saved)
                if grad_h is not None:
                    grad_h[rows] += (grad @ w).to(grad_h.dtype)
                if grad_w is not None:
                    part_w = grad.t() @ h  # (b, H)
                    if one_chunk:
                        grad_w[v0 : v0 + block] = part_w
                    else:
                        acc_w = part_w.to(lse.dtype) if acc_w is None else acc_w.add_(part_w)
                if grad_b is not None:
                    part_b = grad.sum(0)  # (b,)
                    if one_chunk:
                        grad_b[v0 : v0 + block] = part_b
                    else:
                        acc_b = part_b.to(lse.dtype) if acc_b is None else acc_b.add_(part_b)
            # the sums over several row chunks (one chunk wrote its block above)
            if grad_w is not None and acc_w is not None:
                grad_w[v0 : v0 + block] = acc_w
            if grad_b is not None and acc_b is not None:
                grad_b[v0 : v0 + block] = acc_b
        grad_h = grad_h.to(hidden.dtype) if grad_h is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


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
) -> tuple[Tensor, Tensor | None]:
    """Logprobs of ``labels`` (...,) under ``transform(hidden @ weight.T + bias) / temperature``, hidden (..., H),
    weight (V, H), bias (V,) or None; with ``with_entropy`` also the (...,) entropies (no gradient). Both in
    float32 (float64 kept), with gradients to the hidden states, the weight and the bias. ``transform``: the
    model's ops after its head (:data:`OPS`), ``softcap`` a last ``("softcap", softcap)`` among them.
    ``budget``: float32 elements per tile (default :func:`tile_elements` for the device)."""
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
    )
    return out, entropy if with_entropy else None
