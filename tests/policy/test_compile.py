"""Compiled decoder blocks (``policy.compile``) and the FSDP root's reshard, through the real PolicyWorker.

One float32 rank (gloo, in this process) with a reference model, its blocks compiled. Eager is the same
worker under ``torch.compiler.set_stance("force_eager")``, which runs every compiled function as the plain
Python it came from: the same weights, the same batches, only the compilation differs. The learning rate is
0, so every call sees the same weights and leaves its gradient in ``param.grad`` for the comparison.
"""

from __future__ import annotations

import pytest
import torch

from tests.policy.helpers import one_rank_worker, skewed_samples
from trainer.config import load
from trainer.policy.batch import Sample

# float32 on CPU: inductor fuses the norms, rotary and activations and may sum in another order, so compiled
# and eager agree to rounding, not bit for bit.
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def worker(tiny_model_path):
    overrides = [
        "policy.compile=true",
        "policy.max_grad_norm=null",
        "policy.micro_batch_size=5",
        "policy.logprob_micro_batch_size=5",
        "policy.shared_prefix=false",
        "grpo.loss.reference_policy_kl_penalty=0.1",
        "grpo.loss.ratio_clip_min=0.2",
        "grpo.loss.ratio_clip_max=0.2",
    ]
    with one_rank_worker(tiny_model_path, overrides, frozen_lr=True) as w:
        yield w


def _counts(samples: list[Sample]) -> list[dict[str, float]]:
    return [{"tokens": float(sum(sum(s.response_mask) for s in samples)), "seqs": float(len(samples))}]


def _step(w, samples: list[Sample], **policy) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """One training step with ``policy.*`` overridden: its metrics and every parameter's gradient."""
    saved = {k: getattr(w.cfg.policy, k) for k in policy}
    for k, v in policy.items():
        setattr(w.cfg.policy, k, v)
    try:
        metrics = w.train([samples], _counts(samples))
    finally:
        for k, v in saved.items():
            setattr(w.cfg.policy, k, v)
    return metrics, {n: p.grad.full_tensor().clone() for n, p in w.model.named_parameters()}


def _assert_same(a: tuple[dict, dict], b: tuple[dict, dict]) -> None:
    (ma, ga), (mb, gb) = a, b
    assert ma.keys() == mb.keys()
    for key in ma:
        assert ma[key] == pytest.approx(mb[key], rel=RTOL, abs=ATOL), key
    assert ma["grad_norm"] > 0
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=RTOL, atol=ATOL, msg=name)


def test_should_compile_every_decoder_block_when_policy_compile_is_on(worker):
    blocks = [m for m in worker.model.modules() if type(m).__name__.endswith("DecoderLayer")]
    assert len(blocks) == worker.model.config.num_hidden_layers
    # The instance's forward is torch.compile's wrapper (compile_block), FSDP2's hooks around it.
    assert all(hasattr(b.forward, "_torchdynamo_orig_callable") for b in blocks)


@pytest.mark.parametrize(
    "layout",
    [
        {"sequence_packing": True},
        {"sequence_packing": False},  # padded rows: a (B, T) mask instead of packed rows
        {"sequence_packing": True, "activation_checkpointing": True},
    ],
    ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()),
)
def test_should_give_eager_logprobs_loss_and_gradients_when_blocks_are_compiled(worker, layout):
    samples = skewed_samples()
    checkpointing = layout.get("activation_checkpointing", False)
    saved = worker.cfg.policy.sequence_packing
    worker.cfg.policy.sequence_packing = layout["sequence_packing"]
    if checkpointing:
        worker.model.gradient_checkpointing_enable()
    try:
        compiled = [worker.compute_logprobs(samples), worker.compute_logprobs(samples, reference=True)]
        compiled_step = _step(worker, samples, **layout)
        with torch.compiler.set_stance("force_eager"):
            eager = [worker.compute_logprobs(samples), worker.compute_logprobs(samples, reference=True)]
            eager_step = _step(worker, samples, **layout)
    finally:
        worker.cfg.policy.sequence_packing = saved
        if checkpointing:
            worker.model.gradient_checkpointing_disable()
    for got, want in zip(compiled, eager):
        for s, a, b in zip(samples, got, want):
            assert len(a) == len(s.response_ids)
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=RTOL, atol=ATOL)
    _assert_same(compiled_step, eager_step)


def test_should_compile_no_new_graph_after_the_first_steps_when_packed_lengths_vary(worker):
    """Ten steps (the policy's and the reference's logprob passes, then training) on packed rows of other
    lengths each time: the first two may compile (the pieces around the eager attention take their first
    length, then any), the other eight compile nothing."""
    from torch._dynamo.utils import counters

    samples = skewed_samples()
    g = torch.Generator().manual_seed(3)
    graphs, compilations, rows = [], [], set()
    for step in range(10):
        order = torch.randperm(len(samples), generator=g).tolist()
        chosen = [samples[i] for i in order[: 5 + step % 6]]
        size = 3 + step % 3
        rows.update(
            sum(s.length for s in chosen[i : i + size]) for i in range(0, len(chosen), size)
        )  # every packed row's length this step
        worker.compute_logprobs(chosen)
        worker.compute_logprobs(chosen, reference=True)
        _step(worker, chosen, micro_batch_size=size, logprob_micro_batch_size=size)
        graphs.append(counters["stats"]["unique_graphs"])
        compilations.append(worker.compile_clock.count)
    assert len(rows) >= 15  # the lengths did vary
    assert graphs[1:] and compilations[0] > 0
    assert graphs[-1] == graphs[1], graphs  # no graph after the second step
    assert compilations[-1] == compilations[1], compilations


def test_should_keep_the_root_gathered_from_forward_to_backward_when_training(worker):
    """The root (embeddings, final norm, head) keeps FSDP2's default: not resharded after its forward, so the
    backward that reads the head's weight right after needs no second all-gather. A gathered parameter is a
    plain tensor, a sharded one a DTensor. Before the optimizer steps the root is sharded again."""
    from torch.distributed.tensor import DTensor

    embed = worker.model.get_input_embeddings()
    block = next(m for m in worker.model.modules() if type(m).__name__.endswith("DecoderLayer"))
    seen: list[tuple[bool, bool]] = []
    forward = worker._forward_logprobs

    def recording(model, batch, with_entropy=False):
        out = forward(model, batch, with_entropy)
        if torch.is_grad_enabled():  # a training forward: (root sharded?, a block's weight sharded?)
            seen.append((isinstance(embed.weight, DTensor), isinstance(block.mlp.up_proj.weight, DTensor)))
        return out

    worker._forward_logprobs = recording
    try:
        worker.compute_logprobs(skewed_samples())
        assert not isinstance(embed.weight, DTensor)  # a logprob pass leaves it gathered for the next forward
        _step(worker, skewed_samples())
    finally:
        del worker._forward_logprobs
    assert seen and seen == [(False, True)] * len(seen)  # root gathered, blocks resharded after forward
    assert isinstance(embed.weight, DTensor)


def test_should_step_the_weights_the_next_forward_gathers_when_a_step_had_no_backward(worker):
    """A logprob pass leaves the root gathered; a mini-batch with nothing to train on (every advantage 0)
    still steps the optimizer (weight decay moves the weights). The next forward must gather the stepped
    weights, not reuse the copy gathered before the step: the logprobs equal those after an explicit
    reshard."""
    samples = skewed_samples()[:6]
    worker.compute_logprobs(samples)
    lrs = [group["lr"] for group in worker.optimizer.param_groups]
    for group in worker.optimizer.param_groups:
        group["lr"], group["weight_decay"] = 0.5, 0.5
    try:
        worker.train([[]], [{"tokens": 0.0, "seqs": 0.0}])
    finally:
        for group, lr in zip(worker.optimizer.param_groups, lrs):
            group["lr"], group["weight_decay"] = lr, worker.cfg.policy.weight_decay
    after = worker.compute_logprobs(samples)
    worker._reshard()
    fresh = worker.compute_logprobs(samples)
    for a, b in zip(after, fresh):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=0)


@pytest.mark.integration  # builds two (meta) models: transformers' MoE modeling is seconds of import
@pytest.mark.parametrize("setting", [True, None])
def test_should_refuse_or_leave_eager_an_moe_policy_when_compile_is_asked_or_left_to_the_gpu(setting):
    """An MoE policy's routers record and replay routes per forward: ``policy.compile=true`` is refused in one
    line naming the key; left null on a GPU cluster, its blocks stay eager. A dense model there compiles."""
    import transformers

    from trainer.models.moe import MoEError
    from trainer.policy.worker import compiles

    cfg = load(["experiment=tiny", f"policy.compile={'null' if setting is None else 'true'}"])
    cfg.cluster.gpus_per_node = 1  # what null decides by (cluster.use_gpus); no GPU is touched
    common = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    with torch.device("meta"):
        moe_model = transformers.AutoModelForCausalLM.from_config(
            transformers.Qwen3MoeConfig(
                **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8
            )
        )
        dense = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**common))
    if setting:
        with pytest.raises(MoEError, match=r"^policy\.compile=true: .*set policy\.compile=false$"):
            compiles(cfg, moe_model)
    else:
        assert compiles(cfg, moe_model) is False
    assert compiles(cfg, dense) is True
