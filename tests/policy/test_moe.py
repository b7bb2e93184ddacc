"""Router capture and replay on a tiny Qwen3-MoE of the real transformers class (trainer.models.moe), through
every layout of trainer.policy.batch.

The "engine" here is the model itself, run whole on each sample with its routes recorded (the shape vLLM and
the hf engine return: prompt + response - 1 positions x layers x k), or a perturbed copy of it (the router's
weights moved a little, as another kernel or precision moves its logits): then a share of the decisions
differ, and replaying the copy's routes must put every token of the trainer's forward through the copy's
experts, in the packed, padded and shared-prompt layouts alike, and bring the trainer's logprobs closer to
the copy's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from trainer.models import moe
from trainer.policy import forward
from trainer.policy.batch import Sample, pack_batch, pad_batch, prefix_batch

CPU = torch.device("cpu")
VOCAB = 200
LAYOUTS = {"packed": pack_batch, "padded": pad_batch, "prefix": prefix_batch}


def _moe_model(seed: int = 0, mixtral: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, initializer_range=0.2)  # fmt: skip
    if mixtral:
        config = transformers.MixtralConfig(**common, num_local_experts=6, num_experts_per_tok=2)
    else:
        config = transformers.Qwen3MoeConfig(
            **common, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True
        )
    config._attn_implementation = "eager"
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _samples() -> list[Sample]:
    """Two prompts of 4 and 6 tokens, three samples each with responses of 3..9 tokens."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (4, 6)]
    lengths = [3, 7, 5, 9, 4, 6]
    return [
        Sample(prompts[i // 3], torch.randint(0, VOCAB, (lengths[i],), generator=g).tolist(), advantage=1.0)
        for i in range(6)
    ]


@torch.no_grad()
def _engine_routes(model, samples: list[Sample]) -> tuple[list[np.ndarray], list[list[float]]]:
    """The model run on each sample alone, as an engine runs it: its routes over prompt + response - 1
    positions (uint8, layers x k) and its logprobs of the response tokens."""
    state = moe.install(model)
    routes, logprobs = [], []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        moe.begin(model)
        with moe.calling(model, moe.Call(record=True)):
            logits = model(input_ids=ids).logits[0].float()
        per = moe.take_routes(state)
        assert per.dtype == np.uint8 and per.shape == (s.length, len(state.routers), 2)
        routes.append(per[: s.length - 1])
        lp = torch.log_softmax(logits, -1)
        p = len(s.prompt_ids)
        logprobs.append([float(lp[p - 1 + j, t]) for j, t in enumerate(s.response_ids)])
    moe.begin(model)
    return routes, logprobs


def _trainer_pass(model, samples, build, mode: moe.Mode):
    batch = build(samples, 0)
    batch.routing = mode
    moe.install(model)
    moe.begin(model)
    with torch.no_grad():
        lp, _ = forward.logits_logprobs(model, batch, CPU, None, 1.0)
    return batch.unpad(samples, lp), moe.state_of(model)


def _one_sample_run(model):
    def run(mode: moe.Mode, routes):
        sample = Sample(list(range(1, 4)), list(range(4, 12)), routes=routes)
        batch = pack_batch([sample], 0)
        batch.routing = mode
        return forward.logits_logprobs(model, batch, CPU, None, 1.0)[0]

    return run


def _perturbed(model) -> torch.nn.Module:
    other = _moe_model()
    other.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for r in moe.routers(other):
            r.module.weight.add_(0.05 * torch.randn(r.module.weight.shape, generator=g))
    return other.eval()


def test_should_find_one_router_per_layer_with_its_rule_when_the_model_is_a_qwen3_moe():
    model = _moe_model()
    found = moe.routers(model)
    assert [r.layer for r in found] == [0, 1, 2]
    assert all(
        r.rule == moe.RULES["Qwen3MoeTopKRouter"] and r.top_k == 2 and r.num_experts == 6 for r in found
    )
    assert moe.is_moe(model.config) and not moe.is_moe(transformers.LlamaConfig())


@pytest.mark.parametrize("mixtral", [False, True], ids=["qwen3-moe", "mixtral"])
def test_should_pass_the_start_up_check_when_replaying_the_models_own_routes_gives_its_own_logits(mixtral):
    model = _moe_model(mixtral=mixtral)
    line = moe.check_replay(model, _one_sample_run(model))
    assert line.startswith("self-check: router replay reproduces") and "3 MoE layers" in line


def test_should_refuse_replay_in_one_line_when_a_router_class_has_no_known_rule():
    model = _moe_model()
    router_class = type(moe.routers(model)[0].module)
    Scaled = type("ScaledTopKRouter", (router_class,), {})  # a subclass kuberl cannot vouch for  # noqa: N806
    for layer in model.model.layers:
        layer.mlp.gate.__class__ = Scaled
    with pytest.raises(moe.MoEError, match="no rule for ScaledTopKRouter .*router_replay=false"):
        moe.check_replay(model, _one_sample_run(model))


def test_should_refuse_replay_in_one_line_when_the_rule_does_not_reproduce_the_models_own_logits(monkeypatch):
    model = _moe_model()
    model.config.norm_topk_prob = False  # the model's forward now keeps the raw top-k probabilities ...
    for r in moe.routers(model):
        r.module.norm_topk_prob = False
    monkeypatch.setitem(
        moe.RULES, "Qwen3MoeTopKRouter", moe.Rule("always", True)
    )  # ... a rule that renormalises
    with pytest.raises(moe.MoEError, match="replaying its own routes moves its logprobs"):
        moe.check_replay(model, _one_sample_run(model))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_should_give_the_models_own_logprobs_when_it_replays_its_own_routes_in_any_layout(layout):
    model, samples = _moe_model(), _samples()
    routes, engine_lp = _engine_routes(model, samples)
    for s, r in zip(samples, routes):
        s.routes = r
    free, _ = _trainer_pass(model, samples, LAYOUTS[layout], moe.Mode())
    replayed, state = _trainer_pass(model, samples, LAYOUTS[layout], moe.Mode(replay=True, record=True))
    for a, b, c in zip(free, replayed, engine_lp):
        assert np.allclose(a, b, atol=1e-5) and np.allclose(b, c, atol=1e-5)
    stats = moe.finish_stats({k: float(v) for k, v in moe.stat_sums(state).items()})
    assert stats["moe/routing_mismatch"] == 0.0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_should_route_every_token_through_the_engines_experts_when_replay_is_on(layout):
    model, samples = _moe_model(), _samples()
    engine = _perturbed(model)
    routes, engine_lp = _engine_routes(engine, samples)
    for s, r in zip(samples, routes):
        s.routes = r
    free, state = _trainer_pass(model, samples, LAYOUTS[layout], moe.Mode(record=True))
    off = moe.finish_stats({k: float(v) for k, v in moe.stat_sums(state).items()})
    replayed, state = _trainer_pass(model, samples, LAYOUTS[layout], moe.Mode(replay=True, record=True))
    on = moe.finish_stats({k: float(v) for k, v in moe.stat_sums(state).items()})
    # The trainer's router disagrees with the engine's on a share of the decisions (with replay too: its own pick
    # is still measured); replayed, every decision the engine made is the one the trainer's forward used, on
    # every real position the engine computed.
    assert 0.02 < off["moe/routing_mismatch"] < 0.6 and on["moe/routing_mismatch"] > 0.02
    assert "moe/routing_replayed" not in off
    for rec in state.records:
        known = rec.engine[:, 0] >= 0
        if rec.real is not None:
            known &= rec.real
        assert torch.equal(rec.ids[known], rec.engine[known])
    # Every position the engine routed is replayed (a sample's last one it never fed back, nor counts).
    assert on["moe/routing_replayed"] == 1.0
    # ... and the trainer's logprobs come closer to the engine's.
    gap = lambda got: np.mean([abs(a - b) for g, e in zip(got, engine_lp) for a, b in zip(g, e)])  # noqa: E731
    assert gap(replayed) < 0.5 * gap(free)


def test_should_lay_out_each_samples_routes_as_its_input_ids_when_packed_padded_or_prefixed():
    samples = _samples()
    for i, s in enumerate(samples):
        r = np.zeros((s.length - 1, 3, 2), dtype=np.uint8)
        r[:, :, 0] = np.arange(s.length - 1)[:, None] % 251
        r[:, :, 1] = i
        s.routes = r
    packed = pack_batch(samples, 0)
    ids = packed.input_ids[0]
    assert packed.routes.shape == (ids.numel(), 3, 2)
    start = 0
    for i, s in enumerate(samples):
        got = packed.routes[start : start + s.length]
        assert torch.equal(got[:-1, :, 1], torch.full((s.length - 1, 3), i)) and (got[-1] == moe.FREE).all()
        start += s.length
    padded = pad_batch(samples, 0)
    for i, s in enumerate(samples):
        assert (padded.routes[i, s.length - 1 :] == moe.FREE).all()
        assert torch.equal(padded.routes[i, : s.length - 1, 0, 0], torch.arange(s.length - 1))
    pre = prefix_batch(samples, 0)
    width = pre.prompt_ids.shape[1]
    for i, s in enumerate(samples):
        p, n = len(s.prompt_ids), len(s.response_ids)
        assert torch.equal(pre.response_routes[i, : n - 1, 0, 0], torch.arange(p, p + n - 1))
        assert (pre.response_routes[i, n - 1 :] == moe.FREE).all()
        row = int(pre.rows[i])
        assert torch.equal(pre.prompt_routes[row, width - p :, 0, 0], torch.arange(p))


def test_should_leave_a_dense_models_forward_and_its_batches_untouched():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    assert moe.install(model) is None and moe.routers(model) == []
    samples = _samples()
    batch = pack_batch(samples, 0)
    assert batch.routes is None
    plain, _ = forward.logits_logprobs(model, batch, CPU, None, 1.0)
    batch.routing = moe.Mode(replay=True, record=True)
    again, _ = forward.logits_logprobs(model, batch, CPU, None, 1.0)
    assert torch.equal(plain, again)


def test_should_add_the_routers_losses_with_their_gradient_when_their_coefficients_are_set():
    model, samples = _moe_model(), _samples()
    batch = pack_batch(samples, 0)
    batch.routing = moe.Mode(record=True, keep_grad=True)
    model.train()
    moe.install(model)
    moe.begin(model)
    forward.logits_logprobs(model, batch, CPU, None, 1.0)
    state = moe.state_of(model)
    assert moe.aux_loss(state, 0.0, 0.0) is None
    balance = moe.aux_loss(state, 1.0, 0.0)
    # num_experts x sum(share x mean prob) over 3 layers: 3 when every layer is even, more when not
    assert 2.5 < float(balance) < 3 * 6
    z = moe.aux_loss(state, 0.0, 1.0)
    assert float(z) > 0
    (balance + z).backward()
    assert all(
        r.module.weight.grad is not None and r.module.weight.grad.abs().sum() > 0 for r in moe.routers(model)
    )


@pytest.mark.integration  # writes a model
def test_should_return_each_samples_routes_from_the_hf_engine_as_the_trainer_routes_them(tmp_path):
    from tests.families.models import build_family_model
    from trainer.generation.base import SamplingParams
    from trainer.generation.hf import HFGenerationEngine
    from trainer.models import load_model, load_tokenizer

    path = build_family_model("qwen3-moe", str(tmp_path / "qwen3-moe"))
    engine = HFGenerationEngine(load_model(path, "float32"), load_tokenizer(path), batch_size=4)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3, routes=True)
    out = [c for row in engine.generate(prompts, 3, params) for c in row]
    samples = [
        Sample(prompts[i // 3], c.token_ids, advantage=1.0, routes=c.routes) for i, c in enumerate(out)
    ]
    layers = engine.model.config.num_hidden_layers
    for s, c in zip(samples, out):
        assert c.routes.dtype == np.uint8 and c.routes.shape == (s.length - 1, layers, 2)
    # The engine's routes are the ones the same model takes on the whole sequence (float32: no near-tie flips
    # beyond a stray one), and replayed in the trainer they give the engine's own logprobs.
    model = load_model(path, "float32").eval()
    recorded, _ = _engine_routes(model, samples)
    differ = sum(int((a != b).any(axis=-1).sum()) for a, b in zip(recorded, (c.routes for c in out)))
    assert differ <= 0.01 * sum(r.shape[0] * layers for r in recorded)
    replayed, _ = _trainer_pass(model, samples, pack_batch, moe.Mode(replay=True))
    for got, c in zip(replayed, out):
        assert np.allclose(got, c.logprobs, atol=1e-4)
    # Not asked, or a dense model: no routes.
    assert all(
        c.routes is None for row in engine.generate(prompts, 1, SamplingParams(max_new_tokens=4)) for c in row
    )
