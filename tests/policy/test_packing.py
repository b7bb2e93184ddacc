"""Packed micro-batches and token budgets against the padded layout, through the real PolicyWorker.

One float32 rank (gloo, in this process) with a reference model; the learning rate is 0, so every
call sees the same weights and leaves its gradient in ``param.grad`` for the comparison. Each
case trains one step on a length-skewed batch (GRPO groups sharing a prompt, an environment turn
masked out, old, reference and engine logprobs away from the policy's so clipping, the KL and the
importance weights all act) packed, and again padded, and compares the loss, the metrics and every
parameter's gradient.
"""

from __future__ import annotations

import pytest
import torch

from tests.policy.helpers import one_rank_worker, skewed_samples
from trainer.policy.batch import Sample

# float32 on CPU: packed and padded sum the same terms in a different order (attention over a
# different key count, other matmul shapes), so they agree to rounding, not bit for bit.
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def worker(tiny_model_path):
    overrides = [
        "policy.max_grad_norm=null",
        "policy.micro_batch_size=5",
        "policy.logprob_micro_batch_size=5",
        "policy.shared_prefix=false",  # every packed case packs (the mixed choice has its own test)
        "grpo.loss.reference_policy_kl_penalty=0.1",
        "grpo.loss.ratio_clip_min=0.2",
        "grpo.loss.ratio_clip_max=0.2",
    ]
    with one_rank_worker(tiny_model_path, overrides, frozen_lr=True) as w:
        yield w


def _step(w, samples: list[Sample], **policy) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """One training step with ``policy.*`` overridden: its metrics and every parameter's gradient."""
    saved = {k: getattr(w.cfg.policy, k) for k in policy}
    for k, v in policy.items():
        setattr(w.cfg.policy, k, v)
    try:
        tokens = float(sum(sum(s.response_mask) for s in samples))
        metrics = w.train([samples], [{"tokens": tokens, "seqs": float(len(samples))}])
    finally:
        for k, v in saved.items():
            setattr(w.cfg.policy, k, v)
    grads = {n: p.grad.full_tensor().clone() for n, p in w.model.named_parameters()}
    return metrics, grads


def _assert_same(a: tuple[dict, dict], b: tuple[dict, dict]) -> None:
    (ma, ga), (mb, gb) = a, b
    assert ma.keys() == mb.keys()
    for key in ma:
        if key != "lr":
            assert ma[key] == pytest.approx(mb[key], rel=RTOL, abs=ATOL), key
    assert ma["grad_norm"] > 0
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=RTOL, atol=ATOL, msg=name)


PADDED = dict(sequence_packing=False, shared_prefix=False)


@pytest.mark.parametrize(
    "loss",
    [
        {"aggregation": "token-mean"},
        {"aggregation": "seq-mean-token-mean"},
        {"aggregation": "seq-mean-token-sum-norm"},
        {"ratio_level": "sequence"},  # GSPO
        {"importance_sampling": "tis"},
        {"importance_sampling": "seq_mis", "mis_high": 3.0},
        {"kl_estimator": "k1", "kl_clamp": 1.0},
    ],
    ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()),
)
def test_should_give_the_padded_loss_and_gradients_when_micro_batches_are_packed(worker, loss):
    saved = {k: getattr(worker.cfg.grpo.loss, k) for k in loss}
    for k, v in loss.items():
        setattr(worker.cfg.grpo.loss, k, v)
    try:
        samples = skewed_samples()
        _assert_same(_step(worker, samples, sequence_packing=True), _step(worker, samples, **PADDED))
    finally:
        for k, v in saved.items():
            setattr(worker.cfg.grpo.loss, k, v)


def test_should_give_the_count_split_loss_and_gradients_when_micro_batches_are_filled_to_a_token_budget(
    worker,
):
    samples = skewed_samples()
    by_count = _step(worker, samples, sequence_packing=True)
    for packing in (True, False):
        # 40 tokens: the 12 samples (10..32 tokens) go into 6..12 micro-batches instead of 3 of 5.
        _assert_same(
            _step(
                worker, samples, sequence_packing=packing, shared_prefix=False, max_tokens_per_microbatch=40
            ),
            by_count,
        )


def test_should_give_the_padded_logprobs_when_policy_and_reference_passes_are_packed(worker):
    samples = skewed_samples()
    for reference in (False, True):
        worker.cfg.policy.sequence_packing = False
        try:
            padded = worker.compute_logprobs(samples, reference=reference)
        finally:
            worker.cfg.policy.sequence_packing = True
        worker.cfg.policy.logprob_max_tokens_per_microbatch = 50
        try:
            packed = worker.compute_logprobs(samples, reference=reference)
        finally:
            worker.cfg.policy.logprob_max_tokens_per_microbatch = None
        for s, a, b in zip(samples, packed, padded):
            assert len(a) == len(s.response_ids)
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=RTOL, atol=ATOL)


def test_should_give_the_same_gradients_when_packed_micro_batches_checkpoint_activations(worker):
    samples = skewed_samples()
    plain = _step(worker, samples, sequence_packing=True)
    worker.model.gradient_checkpointing_enable()
    try:
        _assert_same(_step(worker, samples, sequence_packing=True, activation_checkpointing=True), plain)
    finally:
        worker.model.gradient_checkpointing_disable()


def test_should_give_the_padded_loss_and_gradients_when_each_micro_batch_takes_the_cheaper_layout(worker):
    """Packing and shared prompts both on (the defaults): a group of even, short responses under a long
    prompt runs as a PrefixBatch (24 + 4 x 6 positions against 4 x 24 + 22 packed), the ragged group
    packs; together they train as the padded layout does."""
    from trainer.policy.batch import PackedBatch, PrefixBatch

    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(4, 40, (24,), generator=g).tolist()
    even = [Sample(prompt, [], advantage=a) for a in (1.0, -1.0, 0.5, -0.5)]
    for k, s in enumerate(even):
        s.response_ids = torch.randint(4, 40, (5 + k % 2,), generator=g).tolist()
    for s in even:
        n = len(s.response_ids)
        s.response_mask = [1] * n
        s.old_logprobs, s.ref_logprobs, s.gen_logprobs = (
            (torch.randn(n, generator=g) * 0.3 - 3.0).tolist() for _ in range(3)
        )
    samples = even + skewed_samples()[:4]  # the second group: responses of 1, 23, 6 and 14 tokens
    layouts = []
    build = worker._batch
    worker._batch = lambda chunk, prefix, mode=None: (
        layouts.append(type(build(chunk, prefix))) or build(chunk, prefix, mode)
    )
    try:
        mixed = _step(worker, samples, sequence_packing=True, shared_prefix=True, micro_batch_size=4)
    finally:
        del worker._batch
    assert layouts == [PrefixBatch, PackedBatch]
    _assert_same(mixed, _step(worker, samples, micro_batch_size=4, **PADDED))


def test_should_read_no_scalar_back_from_the_device_per_micro_batch_when_training(worker):
    """A scalar read (``.item()``, ``float(t)``: ``aten._local_scalar_dense``) waits for the device: in the
    micro-batch loop it idles a GPU between micro-batches. kuberl's own code reads none per micro-batch: the
    metric sums stay on the device and are read once per step, after the all-reduce. What is left per
    forward is transformers' own: its mask code looks for packed sequences in the position ids
    (masking_utils.find_packed_sequence_indices), which a Llama forward runs on every packed row."""
    import traceback
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.where: Counter[str] = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename]
                caller = frames[-1] if frames else None
                self.where["transformers" if caller and "/transformers/" in caller.filename
                           else f"{caller.filename}:{caller.lineno}" if caller else "?"] += 1  # fmt: skip
            return func(*args, **(kwargs or {}))

    def reads(micro_batch_size: int) -> tuple[Counter[str], int]:
        samples = skewed_samples()
        saved = worker.cfg.policy.micro_batch_size, worker.cfg.policy.max_tokens_per_microbatch
        worker.cfg.policy.micro_batch_size, worker.cfg.policy.max_tokens_per_microbatch = (
            micro_batch_size,
            None,
        )
        try:
            mbs = len(worker._micro_batches(samples, micro_batch_size, None))
            tokens = float(sum(sum(s.response_mask) for s in samples))
            with Reads() as mode:
                worker.train([samples], [{"tokens": tokens, "seqs": float(len(samples))}])
        finally:
            worker.cfg.policy.micro_batch_size, worker.cfg.policy.max_tokens_per_microbatch = saved
        return mode.where, mbs

    few, n_few = reads(6)
    many, n_many = reads(2)
    assert n_many > n_few
    ours_few = {k: v for k, v in few.items() if k != "transformers"}
    ours_many = {k: v for k, v in many.items() if k != "transformers"}
    assert ours_few == ours_many, (ours_few, ours_many)  # per step, not per micro-batch
    assert sum(ours_many.values()) <= 2, ours_many  # the summed metrics, once
    assert many["transformers"] <= n_many, many  # one per packed forward, theirs
