"""Logprobs from the hidden states a tile at a time (trainer.algorithms.linear_logprobs, through
trainer.policy.forward) against today's path (the whole window's logits, then the chunked float32 pass).

- the op alone against ``F.linear`` + ``logprobs_and_entropy``: bias, Gemma's final softcapping, a
  temperature, one tile or many in both directions, gradients to the hidden states, the weight and the bias;
- a Gemma 3 model with ``final_logit_softcapping`` set: the model's own logits against the tiled pass;
- the real PolicyWorker (one float32 FSDP2 rank, parameters resharded after forward, the tiny model's
  tied embeddings) in each layout, packed, padded and shared-prompt: policy and reference logprobs, the
  loss, every metric (entropy among them) and every parameter's gradient, tiled against today's path;
- two Ulysses ranks, each half of every packed row: the same, tiled against today's path on each rank;
- no tensor of (positions x vocabulary) elements is ever made, forward or backward.
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tests.leftovers import wait_all
from tests.policy.helpers import one_rank_worker, skewed_samples
from trainer.algorithms import core_algos
from trainer.algorithms import linear_logprobs as ll
from trainer.config import load
from trainer.policy import forward
from trainer.ports import free_port

REPO = Path(__file__).resolve().parents[2]
RTOL, ATOL = 1e-5, 1e-6  # float32: the same terms, summed in another order (tiles, an online log-sum-exp)


def _small_tiles(monkeypatch) -> None:
    """Tiles of 16 vocabulary entries and a few positions: every loop of the op runs more than once (and
    the policy's forward tiles the tiny model's head, whose logits are far below the size it tiles from)."""
    monkeypatch.setattr(forward, "TILE_ABOVE_BYTES", 0)
    monkeypatch.setattr(ll, "MIN_BLOCK", 16)
    monkeypatch.setattr(ll, "tile_elements", lambda device: 16 * 5)


# ----- the op --------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [2**19, 1000], ids=["one-tile", "tiles"])
@pytest.mark.parametrize("softcap", [None, 4.0])
@pytest.mark.parametrize("bias", [False, True])
def test_should_equal_the_logits_pass_when_logprobs_come_from_hidden_states_a_tile_at_a_time(
    budget, softcap, bias
):
    g = torch.Generator().manual_seed(0)
    n, h, v = (
        37,
        16,
        700,
    )  # 1000 elements: blocks of 256 entries (the last one short) and chunks of 3 positions
    hidden = torch.randn(2, n, h, generator=g, requires_grad=True)
    weight = (torch.randn(v, h, generator=g) * 0.5).requires_grad_()
    b = torch.randn(v, generator=g, requires_grad=True) if bias else None
    labels = torch.randint(0, v, (2, n), generator=g)
    upstream = torch.randn(2, n, generator=g)
    leaves = [hidden, weight] + ([b] if bias else [])

    logits = F.linear(hidden, weight, b)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    want, want_entropy = core_algos.logprobs_and_entropy(logits, labels, chunk_size=7, temperature=0.7,
                                                         with_entropy=True)  # fmt: skip
    want_grads = torch.autograd.grad((want * upstream).sum(), leaves)
    got, got_entropy = ll.linear_logprobs(hidden, weight, b, labels, temperature=0.7, softcap=softcap,
                                          with_entropy=True, budget=budget, fused=False)  # fmt: skip
    got_grads = torch.autograd.grad((got * upstream).sum(), leaves)

    assert got.shape == labels.shape and got.dtype == torch.float32 and not got_entropy.requires_grad
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    # H = lse - sum p x: the two terms' rounding is relative to the logits' scale, not to H
    torch.testing.assert_close(
        got_entropy, want_entropy, rtol=RTOL, atol=ATOL * float(logits.detach().abs().max())
    )
    for name, a, e in zip(("hidden", "weight", "bias"), got_grads, want_grads):
        # sums over hundreds of vocabulary entries in another order: rounding is relative to their scale
        torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL * float(e.abs().max()))
        assert a.abs().max() > 0, name


# (dtype, bias, transform, temperature, entropy): each its own compiled graph, so a few, each op among them
FUSED_CASES = [
    (torch.float32, False, (), 1.0, False),
    (torch.float32, True, (("softcap", 4.0),), 0.7, True),
    (torch.float32, True, (("mul", 1.5), ("div", 2.0)), 0.7, True),
    (torch.bfloat16, True, (("softcap", 4.0),), 0.7, True),
    (torch.bfloat16, False, (("div", 2.0),), 1.0, True),
    (torch.bfloat16, False, (), 0.7, False),
]


@pytest.mark.integration  # compiling starts a C++ compiler
@pytest.mark.parametrize(
    ("dtype", "bias", "transform", "temperature", "entropy"),
    FUSED_CASES,
    ids=[f"{str(c[0])[6:]}-{'bias-' if c[1] else ''}{'+'.join(op for op, _ in c[2]) or 'plain'}-T{c[3]}"
         f"{'-entropy' if c[4] else ''}" for c in FUSED_CASES],
)  # fmt: skip
def test_should_give_the_eager_tiles_logprobs_and_gradients_when_the_tiles_run_fused(
    dtype, bias, transform, temperature, entropy
):
    """The compiled tiles against the eager ones (to float32 rounding: the same ops, 16-bit roundings where
    eager rounds), and both against the plain head (``F.linear``, the transform as the model runs it, then
    the chunked float32 log-softmax): 37 positions in chunks of 3 (the last of 1) and blocks of 256 vocabulary
    entries (the last of 188)."""
    g = torch.Generator().manual_seed(0)
    n, h, v = 37, 16, 700
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.5).to(dtype).requires_grad_()
    b = torch.randn(v, generator=g).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, v, (n,), generator=g)
    upstream = torch.randn(n, generator=g)
    leaves = [hidden, weight] + ([b] if bias else [])

    logits = F.linear(hidden, weight, b)
    for op, c in transform:  # the model's forward, in the logits' dtype
        logits = logits * c if op == "mul" else logits / c if op == "div" else torch.tanh(logits / c) * c
    want, want_entropy = core_algos.logprobs_and_entropy(logits, labels, chunk_size=7, temperature=temperature,
                                                         with_entropy=True)  # fmt: skip
    want_grads = torch.autograd.grad((want * upstream).sum(), leaves)
    runs = {}
    for fused in (False, True):
        lp, ent = ll.linear_logprobs(hidden, weight, b, labels, temperature=temperature, transform=transform,
                                     with_entropy=entropy, budget=1000, fused=fused)  # fmt: skip
        runs[fused] = (lp, ent, torch.autograd.grad((lp * upstream).sum(), leaves))
    (lp, ent, grads), (eager_lp, eager_ent, eager_grads) = runs[True], runs[False]

    assert lp.dtype == torch.float32 and (ent is None) == (not entropy)
    torch.testing.assert_close(lp, eager_lp, rtol=RTOL, atol=ATOL)
    if entropy:
        torch.testing.assert_close(ent, eager_ent, rtol=RTOL, atol=ATOL * float(logits.detach().abs().max()))
    # a 16-bit gradient may round the other way where its float32 value lies on a rounding boundary
    rtol = RTOL if dtype == torch.float32 else 2**-7
    for name, a, e in zip(("hidden", "weight", "bias"), grads, eager_grads):
        assert a.dtype == dtype, name
        torch.testing.assert_close(
            a.float(), e.float(), rtol=rtol, atol=ATOL * float(e.abs().max()), msg=name
        )
    # both against the plain head: float32 to its rounding; bfloat16 to a unit in the last place of a logit
    tol = dict(rtol=RTOL, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.0, atol=2e-2)
    torch.testing.assert_close(lp, want, **tol)
    if entropy:
        torch.testing.assert_close(ent, want_entropy, **tol)
    for name, a, e in zip(("hidden", "weight", "bias"), grads, want_grads):
        scale = float(e.abs().max())
        assert scale > 0, name
        if dtype == torch.float32:
            torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL * scale, msg=name)
        else:  # blocks rounded to bfloat16 one by one, the plain head's gradient once
            assert float((a.float() - e.float()).abs().max()) <= 2e-2 * scale, name


@pytest.mark.integration  # compiling starts a C++ compiler
def test_should_compile_each_tile_a_bounded_number_of_times_when_the_row_count_changes_every_call():
    """Packed micro-batches project a different number of positions each time, and the last vocabulary block
    is narrower than the others: the compiled tiles take every size symbolically (a size of 1 once more)."""
    from torch._dynamo.utils import counters

    g = torch.Generator().manual_seed(1)
    weight = torch.randn(700, 16, generator=g, requires_grad=True)
    torch._dynamo.reset()  # the graphs of earlier tests would be reused: count this test's own
    ll._FUSED.clear()
    counters.clear()
    for n in (37, 50, 64, 91, 129, 200, 333, 40, 12):
        hidden = torch.randn(n, 16, generator=g, requires_grad=True)
        lp, _ = ll.linear_logprobs(hidden, weight, None, torch.randint(0, 700, (n,), generator=g),
                                   temperature=0.7, with_entropy=True, budget=1000, fused=True)  # fmt: skip
        lp.sum().backward()
    graphs = counters["stats"]["unique_graphs"]
    assert 2 <= graphs <= 4, dict(counters["stats"])  # one forward, one backward, and a 1-row chunk each


def test_should_give_no_gradient_to_the_head_when_there_is_no_position_to_score():
    """A one-token response leaves the shared-prompt layout's second pass with no position: its backward
    must add nothing to the head's gradient (an uninitialised one would be garbage)."""
    torch.manual_seed(0)
    weight = torch.randn(300, 8, requires_grad=True)
    hidden = torch.randn(0, 8, requires_grad=True)
    lp, _ = ll.linear_logprobs(hidden, weight, None, torch.zeros(0, dtype=torch.long))
    (lp.sum() + (weight * 0).sum()).backward()
    assert torch.equal(weight.grad, torch.zeros_like(weight)) and hidden.grad.shape == (0, 8)


def test_should_split_positions_only_when_a_vocabulary_block_of_the_minimum_width_leaves_no_room():
    assert ll.tiles(4096, 262144, 2**26) == (4096, 16384)  # every position at once, 16 blocks
    assert ll.tiles(100, 49152, 2**26) == (100, 49152)  # one tile
    assert ll.tiles(4096, 49152, 2**19) == (2048, 256)  # the minimum block: positions split in two


@pytest.mark.parametrize("rows", [1, 7, 1359, 4093, 12345, 16384, 65537])
@pytest.mark.parametrize("vocab", [151936, 262144, 49152, 32001])
@pytest.mark.parametrize("budget", [2**19, 2**24, 2**26])
def test_should_keep_every_tile_row_aligned_when_the_positions_do_not_divide_the_budget(rows, vocab, budget):
    """A block of, say, 1359 bf16 entries gives the tile's logits a row stride cuBLAS cannot use its aligned
    kernels for (a 1.5B model's step ran 1.37x longer on a GPU): every block but the vocabulary's last is a
    multiple of BLOCK_ALIGN, and the tiles stay within the budget and cover every position."""
    step, block = ll.tiles(rows, vocab, budget)
    assert block == vocab or block % ll.BLOCK_ALIGN == 0
    assert step * block <= max(budget, block) and 1 <= step <= rows
    assert block >= min(vocab, ll.MIN_BLOCK)


def test_should_apply_the_models_own_final_softcapping_when_a_gemma_model_caps_its_logits():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from trainer.policy.batch import pack_batch

    config = Gemma3TextConfig(vocab_size=70, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                              final_logit_softcapping=1.0, sliding_window=8)  # fmt: skip
    model = Gemma3ForCausalLM(config).to(torch.float32)
    batch = pack_batch(skewed_samples()[:5], pad_id=0)
    args = (model, batch, torch.device("cpu"), None, 0.8, True)
    want, want_entropy = forward.logits_logprobs(*args)  # the model's own logits: capped inside its forward
    got, got_entropy = forward.forward_logprobs(*args)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got_entropy, want_entropy, rtol=RTOL, atol=ATOL)
    config.final_logit_softcapping = None  # what ignoring the cap would give: it matters here
    assert (forward.forward_logprobs(*args)[0] - want).abs().max() > 1e-3


# ----- the policy worker, each layout --------------------------------------------------------------

LAYOUTS = {
    "packed": dict(sequence_packing=True, shared_prefix=False),
    "padded": dict(sequence_packing=False, shared_prefix=False),
    "shared-prompt": dict(sequence_packing=False, shared_prefix=True),
}


@pytest.fixture(scope="module")
def worker(tiny_model_path):
    overrides = ["policy.max_grad_norm=null", "policy.micro_batch_size=5", "policy.logprob_micro_batch_size=5",
                 "policy.reshard_after_forward=true", "policy.compute_entropy=true",
                 "generation.temperature=0.8", "grpo.loss.reference_policy_kl_penalty=0.1"]  # fmt: skip
    with one_rank_worker(tiny_model_path, overrides, frozen_lr=True) as w:
        assert w.model.get_output_embeddings().weight is w.model.get_input_embeddings().weight  # tied
        yield w


def _run(w, samples, policy: dict) -> dict:
    """Policy and reference logprobs, one training step's metrics and every parameter's gradient."""
    saved = {k: getattr(w.cfg.policy, k) for k in policy}
    for k, v in policy.items():
        setattr(w.cfg.policy, k, v)
    try:
        tokens = float(sum(sum(s.response_mask) for s in samples))
        out = {"logprobs": w.compute_logprobs(samples), "ref": w.compute_logprobs(samples, reference=True),
               "metrics": w.train([samples], [{"tokens": tokens, "seqs": float(len(samples))}])}  # fmt: skip
    finally:
        for k, v in saved.items():
            setattr(w.cfg.policy, k, v)
    out["grads"] = {n: p.grad.full_tensor().clone() for n, p in w.model.named_parameters()}
    return out


def _assert_same(got: dict, want: dict) -> None:
    for key in ("logprobs", "ref"):
        for a, b in zip(got[key], want[key], strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=RTOL, atol=ATOL, msg=key)
    assert got["metrics"].keys() == want["metrics"].keys() and "entropy" in want["metrics"]
    for key, value in want["metrics"].items():
        assert got["metrics"][key] == pytest.approx(value, rel=RTOL, abs=ATOL), key
    assert want["metrics"]["grad_norm"] > 0
    for name, grad in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_should_give_todays_logprobs_entropy_and_gradients_when_the_head_is_tiled_in_each_layout(
    worker, layout, monkeypatch
):
    samples = skewed_samples()
    with monkeypatch.context() as today:
        today.setattr(forward, "forward_logprobs", forward.logits_logprobs)
        want = _run(worker, samples, LAYOUTS[layout])
    _small_tiles(monkeypatch)
    got = _run(worker, samples, LAYOUTS[layout])
    _assert_same(got, want)


# ----- Ulysses -------------------------------------------------------------------------------------


def _rank_main(rank: int, world: int, port: int, model_path: str, out: str) -> None:
    """One of two sequence-parallel ranks: today's path, then the tiled one; rank 0 saves both."""
    from trainer.policy.worker import PolicyWorker

    cfg = load(["experiment=tiny", f"model.name={model_path}", f"cluster.cpu_workers_per_node={world}",
                f"policy.sequence_parallel_size={world}", "policy.max_grad_norm=null",
                "policy.micro_batch_size=5", "policy.logprob_micro_batch_size=5", "policy.compute_entropy=true",
                "grpo.loss.reference_policy_kl_penalty=0.1"])  # fmt: skip
    w = PolicyWorker(cfg, model_path, rank=rank, world_size=world, colocated_engine=False)
    w.setup("127.0.0.1", port)
    w.scheduler.base_lrs = [0.0] * len(w.scheduler.base_lrs)
    for group in w.optimizer.param_groups:
        group["lr"] = 0.0
    tiled = forward.forward_logprobs
    forward.forward_logprobs = forward.logits_logprobs
    want = _run(w, skewed_samples(), {})
    forward.forward_logprobs = tiled
    ll.MIN_BLOCK, ll.tile_elements, forward.TILE_ABOVE_BYTES = 16, lambda device: 16 * 5, 0
    got = _run(w, skewed_samples(), {})
    if rank == 0:
        torch.save({"want": want, "got": got}, out)
    w.shutdown()


def test_should_give_todays_logprobs_and_gradients_when_two_ulysses_ranks_tile_their_halves(
    tiny_model_path, tmp_path
):
    port, out = free_port("127.0.0.1"), tmp_path / "ulysses.pt"
    procs = [
        subprocess.Popen([sys.executable, "-c", f"from tests.policy.test_linear_logprobs import _rank_main; "
                          f"_rank_main({rank}, 2, {port}, {tiny_model_path!r}, {str(out)!r})"], cwd=REPO)
        for rank in range(2)
    ]  # fmt: skip
    assert wait_all(procs, timeout=400) == [0, 0], "a rank failed (its output is above)"
    runs = torch.load(out)
    _assert_same(runs["got"], runs["want"])


# ----- memory --------------------------------------------------------------------------------------


class _Largest(TorchDispatchMode):
    """The largest tensor any op returns while active (forward and backward), by element count."""

    def __init__(self):
        super().__init__()
        self.numel, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.op = t.numel(), f"{func} -> {tuple(t.shape)}"
        return out


def test_should_project_the_whole_logits_only_when_they_stay_under_the_size_the_head_tiles_from(monkeypatch):
    from trainer.policy.batch import Sample, pack_batch

    calls: list[str] = []
    monkeypatch.setattr(forward, "logits_logprobs", lambda *a, **k: calls.append("plain"))
    monkeypatch.setattr(forward, "_root_forward", lambda model: lambda *a, **k: calls.append("tiled"))
    model = torch.nn.Module()
    head = torch.nn.Linear(8, 1000, bias=False)
    model.get_output_embeddings = lambda: head
    model.config = types.SimpleNamespace()
    batch = pack_batch([Sample(prompt_ids=[1, 2], response_ids=[3] * 99, advantage=1.0)], pad_id=0)
    assert batch.positions == 99
    for limit, expected in ((99 * 1000 * 4, "plain"), (99 * 1000 * 4 - 1, "tiled")):
        monkeypatch.setattr(forward, "TILE_ABOVE_BYTES", limit)
        calls.clear()
        try:
            forward.forward_logprobs(model, batch, torch.device("cpu"), None, 1.0)
        except Exception:  # the stand-in root forward returns nothing to unpack: only the choice is checked
            pass
        assert calls[:1] == [expected], (limit, calls)


def test_should_never_make_a_positions_by_vocabulary_tensor_when_logprobs_and_their_gradient_are_computed(
    monkeypatch,
):
    monkeypatch.setattr(
        forward, "TILE_ABOVE_BYTES", 0
    )  # the model here is small; the rule is what is checked
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.policy.batch import Sample, pack_batch

    vocab = 16384
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.float32)
    g = torch.Generator().manual_seed(0)
    samples = [Sample(torch.randint(0, vocab, (8,), generator=g).tolist(),
                      torch.randint(0, vocab, (128,), generator=g).tolist(), advantage=1.0) for _ in range(4)]  # fmt: skip
    batch = pack_batch(samples, pad_id=0)
    positions = batch.predict.numel()
    assert (
        positions == 512 and positions * vocab > 2**19
    )  # the CPU's tile (2 MiB of float32) cannot hold them all
    with _Largest() as largest:
        logprobs, entropy = forward.forward_logprobs(model, batch, torch.device("cpu"), None, 1.0, True)
        (logprobs * batch.loss_mask).sum().backward()
    assert entropy is not None and model.lm_head.weight.grad is not None
    # the weight and its gradient (vocab x 32) are the largest things here: 16x fewer than the logits' elements
    assert largest.numel < positions * vocab // 4, largest.op
