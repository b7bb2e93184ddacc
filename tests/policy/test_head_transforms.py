"""The tiled LM head against each model family's own logits, the head a run takes, and the start-up self-check
(trainer.policy.forward).

- tiny random models of the real transformers classes, each with its transform after the head set (Granite's
  ``logits_scaling``, Cohere's ``logit_scale``, Falcon-H1's ``lm_head_multiplier``, the Gemmas' softcap, on the
  text config of a multimodal wrapper too): the tiled logprobs and entropy equal the model's own log-softmax
  in float32, at temperature 1 and 0.7, and ignoring the transform would not;
- every ForCausalLM / ForConditionalGeneration of the installed transformers whose forward reads a transform
  key has its entry in ``TRANSFORMS``, and each entry names a class that exists;
- the op's chained transform (scale, then cap) and its gradients against autograd;
- the real PolicyWorker: a step's logprob pass and training pass, micro-batches of different sizes, take one
  head; its set-up reports the self-check;
- the self-check refuses, in one line, a model whose forward does more after its head than its class is known
  to (a subclass that triples its logits), and lets it through with ``policy.unchecked_head``;
- a class that is not known but whose config names a transform key takes the plain path.
"""

from __future__ import annotations

import ast
import os
import re

import pytest
import torch
import torch.nn.functional as F
import transformers

from tests.policy.helpers import one_rank_worker, skewed_samples
from trainer.algorithms import core_algos
from trainer.algorithms import linear_logprobs as ll
from trainer.config import PolicyConfig
from trainer.policy import forward
from trainer.policy.batch import Sample, pack_batch, pad_batch

RTOL, ATOL = 1e-5, 1e-5  # float32: the same terms, summed in another order (tiles, an online log-sum-exp)
CPU = torch.device("cpu")
VOCAB = 300
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, initializer_range=0.1)  # fmt: skip


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 16 vocabulary entries and a few positions (every loop of the op runs more than once), and the
    head tiled whatever the size of the logits."""
    monkeypatch.setattr(forward, "TILE_ABOVE_BYTES", 0)
    monkeypatch.setattr(ll, "MIN_BLOCK", 16)
    monkeypatch.setattr(ll, "tile_elements", lambda device: 16 * 5)
    # the eager tiles, the reference: compiling starts a C++ compiler, which the fast tier refuses (the fused
    # tiles equal these: tests/policy/test_linear_logprobs.py; tests/families runs them for each family)
    monkeypatch.setattr(ll, "fused_default", lambda device: False)


def _samples() -> list[Sample]:
    """5 samples over the whole vocabulary: prompts of 3..7 tokens, responses of 2..18."""
    g = torch.Generator().manual_seed(0)
    return [
        Sample(torch.randint(0, VOCAB, (3 + i,), generator=g).tolist(),
               torch.randint(0, VOCAB, ([9, 2, 18, 5, 11][i],), generator=g).tolist(), advantage=1.0)
        for i in range(5)
    ]  # fmt: skip


# ----- the model families ----------------------------------------------------------------------------


def _gemma3_wrapper():
    text = dict(SMALL, head_dim=16, final_logit_softcapping=1.0, sliding_window=8)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)  # fmt: skip
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    return transformers.Gemma3ForConditionalGeneration(config)


def _gemma4_wrapper():
    text = dict(SMALL, head_dim=16, final_logit_softcapping=1.0, sliding_window=8, vocab_size_per_layer_input=VOCAB,
                hidden_size_per_layer_input=8)  # fmt: skip
    vision = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=8
    )
    config = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
    return transformers.Gemma4ForConditionalGeneration(config)


# name -> (a tiny model, the transform head_transform must read off it)
FAMILIES = {
    "llama": (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)), ()),
    "granite": (
        lambda: transformers.GraniteForCausalLM(transformers.GraniteConfig(**SMALL, logits_scaling=0.25)),
        (("div", 0.25),),
    ),
    "cohere": (
        lambda: transformers.CohereForCausalLM(transformers.CohereConfig(**SMALL, logit_scale=4.0)),
        (("mul", 4.0),),
    ),
    "falcon_h1": (
        lambda: transformers.FalconH1ForCausalLM(
            transformers.FalconH1Config(
                **SMALL,
                head_dim=16,
                mamba_d_ssm=32,
                mamba_n_heads=2,
                mamba_d_head=16,
                mamba_d_state=8,
                mamba_chunk_size=8,
                lm_head_multiplier=4.0,
            )
        ),
        (("mul", 4.0),),
    ),
    "gemma2": (
        lambda: transformers.Gemma2ForCausalLM(
            transformers.Gemma2Config(**SMALL, head_dim=16, final_logit_softcapping=1.0, sliding_window=8)
        ),
        (("softcap", 1.0),),
    ),
    "gemma3-text": (
        lambda: transformers.Gemma3ForCausalLM(
            transformers.Gemma3TextConfig(**SMALL, head_dim=16, final_logit_softcapping=1.0, sliding_window=8)
        ),
        (("softcap", 1.0),),
    ),
    # Gemma3ForConditionalGeneration's forward does not apply its text config's cap (transformers 5.19):
    # neither may the head.
    "gemma3-wrapper": (_gemma3_wrapper, ()),
    # Gemma4ForConditionalGeneration's does (config.get_text_config().final_logit_softcapping).
    "gemma4-wrapper": (_gemma4_wrapper, (("softcap", 1.0),)),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_should_give_the_models_own_logprobs_when_the_head_is_tiled_for_each_family(family, small_tiles):
    build, transform = FAMILIES[family]
    torch.manual_seed(0)
    model = build().to(torch.float32).eval()
    batch = pack_batch(_samples(), pad_id=0)
    for temperature in (1.0, 0.7):
        args = (model, batch, CPU, None, temperature, True)
        want, want_entropy = forward.logits_logprobs(*args)  # the model's own logits, its transform inside
        got, got_entropy = forward.forward_logprobs(*args)
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=f"{family} T={temperature}")
        torch.testing.assert_close(got_entropy, want_entropy, rtol=RTOL, atol=ATOL)
    assert forward.head_transform(model) == transform and forward.takes_tiles(model, batch.positions)
    if transform:  # what the head gives without the transform (the old head's): it matters on this model
        ignoring = forward.TiledHead(model, 1.0, False)
        ignoring.transform = ()
        got, _ = batch.logprobs(model, ignoring, CPU, None)
        want, _ = forward.logits_logprobs(model, batch, CPU, None, 1.0)
        gap = float((got - want).detach().abs()[batch.loss_mask > 0].mean())
        assert gap > 0.05, gap  # 0.09-2.7 nats/token here


def _transform_readers(source: str) -> set[str]:
    """ForCausalLM / ForConditionalGeneration classes of one modeling file whose forward's code (its docstring
    aside) reads a key of forward.TRANSFORM_KEYS (or Inkling's ``logit_softcap`` module)."""
    keys = re.compile(r"\b(" + "|".join(forward.TRANSFORM_KEYS) + r"|logit_softcap)\b")
    found = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and re.search(
            r"(ForCausalLM|ForConditionalGeneration)$", node.name
        ):
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "forward":
                    body = fn.body[1:] if ast.get_docstring(fn) else fn.body
                    if any(keys.search(ast.get_source_segment(source, stmt) or "") for stmt in body):
                        found.add(node.name)
    return found


def test_should_know_every_installed_class_whose_forward_transforms_its_logits_when_transformers_changes():
    """A transformers release that adds a family with a transform after its head (or renames one) fails here,
    not silently in a run: read its forward and give it its entry in forward.TRANSFORMS."""
    root = os.path.join(os.path.dirname(transformers.__file__), "models")
    readers: set[str] = set()
    for family in sorted(os.listdir(root)):
        folder = os.path.join(root, family)
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
            if name.startswith("modeling_") and name.endswith(".py"):
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    source = f.read()
                if any(key in source for key in forward.TRANSFORM_KEYS):
                    readers |= _transform_readers(source)
    assert {"GraniteForCausalLM", "CohereForCausalLM", "FalconH1ForCausalLM", "Gemma2ForCausalLM"} <= readers
    assert readers - forward.KNOWN == set()
    missing = sorted(name for name in forward.KNOWN if not hasattr(transformers, name))
    assert missing == [], f"TRANSFORMS names classes this transformers does not have: {missing}"


# ----- the op ----------------------------------------------------------------------------------------


def test_should_apply_and_differentiate_a_chained_transform_op_by_op_when_a_model_scales_then_caps():
    g = torch.Generator().manual_seed(0)
    n, h, v = 29, 16, 500
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    upstream = torch.randn(n, generator=g)
    transform = (("mul", 3.0), ("div", 2.0), ("softcap", 4.0))

    logits = torch.tanh(F.linear(hidden, weight) * 3.0 / 2.0 / 4.0) * 4.0
    want, want_entropy = core_algos.logprobs_and_entropy(logits, labels, chunk_size=7, temperature=0.7,
                                                         with_entropy=True)  # fmt: skip
    want_grads = torch.autograd.grad((want * upstream).sum(), [hidden, weight])
    got, got_entropy = ll.linear_logprobs(hidden, weight, None, labels, temperature=0.7, transform=transform,
                                          with_entropy=True, budget=1000, fused=False)  # fmt: skip
    got_grads = torch.autograd.grad((got * upstream).sum(), [hidden, weight])

    torch.testing.assert_close(got, want, rtol=RTOL, atol=1e-6)
    torch.testing.assert_close(got_entropy, want_entropy, rtol=RTOL, atol=1e-5)
    for a, e in zip(got_grads, want_grads):
        torch.testing.assert_close(a, e, rtol=RTOL, atol=1e-6 * float(e.abs().max()))
    with pytest.raises(ValueError, match="unknown transform op 'exp'"):
        ll.linear_logprobs(hidden, weight, None, labels, transform=(("exp", 1.0),))


# ----- the head a run takes --------------------------------------------------------------------------


def test_should_bound_the_runs_micro_batches_by_the_longest_sequence_when_no_token_budget_is_set():
    p = PolicyConfig(micro_batch_size=4, logprob_micro_batch_size=8, max_total_sequence_length=1024)
    assert forward.run_rows(p) == 8 * 1024
    p = PolicyConfig(max_tokens_per_microbatch=4096, logprob_max_tokens_per_microbatch=2048,
                     max_total_sequence_length=1024)  # fmt: skip
    assert forward.run_rows(p) == 4096
    p = PolicyConfig(micro_batch_size=3, logprob_micro_batch_size=2, max_total_sequence_length=1001,
                     sequence_parallel_size=2)  # fmt: skip
    assert forward.run_rows(p) == 1502  # each rank holds half of a row


def test_should_take_one_head_for_the_logprob_and_the_training_pass_of_a_step_when_their_micro_batches_differ(
    tiny_model_path, monkeypatch
):
    """The logprob pass runs the step's 12 samples as one micro-batch, training as six of two: with the head
    tiled from a size between the two, each pass choosing by its own micro-batch would give the old logprobs
    from the tiles and the new ones from the whole logits. The run's head is one (the largest micro-batch its
    config allows is above that size: tiled)."""
    overrides = [
        "policy.micro_batch_size=2",
        "policy.logprob_micro_batch_size=12",
        "generation.max_new_tokens=32",
    ]
    with one_rank_worker(tiny_model_path, overrides) as w:
        info = w.info
        samples = skewed_samples()
        vocab = w.model.get_output_embeddings().weight.shape[0]
        largest = pack_batch(samples, pad_id=0).positions  # the logprob pass's micro-batch, packed
        monkeypatch.setattr(forward, "TILE_ABOVE_BYTES", largest * vocab * 4 - 1)
        assert max(pack_batch(samples[i : i + 2], pad_id=0).positions for i in range(0, 12, 2)) < largest // 2
        heads: list[tuple[str, str]] = []
        phase = ["logprobs"]

        class Tiled(forward.TiledHead):
            def __init__(self, *args, **kwargs):
                heads.append((phase[0], "tiled"))
                super().__init__(*args, **kwargs)

        class Plain(forward.LogitsHead):
            def __init__(self, *args, **kwargs):
                heads.append((phase[0], "plain"))
                super().__init__(*args, **kwargs)

        monkeypatch.setattr(forward, "TiledHead", Tiled)
        monkeypatch.setattr(forward, "LogitsHead", Plain)
        w.compute_logprobs(samples)
        phase[0] = "training"
        tokens = float(sum(sum(s.response_mask) for s in samples))
        w.train([samples], [{"tokens": tokens, "seqs": float(len(samples))}])
    assert {p for p, _ in heads} == {"logprobs", "training"}
    assert {h for _, h in heads} == {"tiled"}, heads
    assert info["head_check"].startswith("self-check: lm head (plain"), info  # at set-up: a tiny vocabulary


# ----- the self-check --------------------------------------------------------------------------------


class TriplingLlama(transformers.LlamaForCausalLM):
    """A model whose forward does after its head what its transformers base does not: remote code, a subclass."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 3
        return out


class ScalingLlama(transformers.LlamaForCausalLM):
    """A class transformers does not have, dividing its logits by its config's ``logits_scaling``."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits / self.config.logits_scaling
        return out


def _check(model, unchecked: bool = False) -> str:
    batch = pad_batch(_samples()[:2], pad_id=0)
    return forward.check_head(model, batch, CPU, None, 1.0, torch.float32, unchecked=unchecked)


def test_should_refuse_in_one_line_when_the_models_forward_transforms_its_logits_in_a_way_not_known(
    small_tiles,
):
    torch.manual_seed(0)
    model = TriplingLlama(transformers.LlamaConfig(**SMALL)).to(torch.float32)
    forward.fix_rows(model, 4096)
    with pytest.raises(forward.HeadCheckError) as e:
        _check(model)
    message = str(e.value)
    assert "\n" not in message and message.startswith("TriplingLlama (model_type llama): the LM head (tiled")
    assert "nats/token off the model's own logits" in message and "policy.unchecked_head=true" in message
    line = _check(model, unchecked=True)
    assert line.startswith("self-check: lm head (tiled, no transform) does NOT match TriplingLlama's logits")
    assert "training on it anyway" in line and "\n" not in line

    torch.manual_seed(0)
    model = transformers.GraniteForCausalLM(transformers.GraniteConfig(**SMALL, logits_scaling=4.0))
    forward.fix_rows(model, 4096)
    line = _check(model.to(torch.float32))
    assert line.startswith(
        "self-check: lm head (tiled, scale 1/4.0) matches GraniteForCausalLM's logits (model_type granite) within "
    ), line


def test_should_take_the_plain_path_when_a_class_not_known_sets_a_transform_key(small_tiles):
    torch.manual_seed(0)
    model = ScalingLlama(transformers.LlamaConfig(**SMALL, logits_scaling=0.25)).to(torch.float32)
    assert forward.head_transform(model) is None and not forward.takes_tiles(model, 10**6)
    batch = pack_batch(_samples(), pad_id=0)
    torch.testing.assert_close(
        forward.forward_logprobs(model, batch, CPU, None, 0.7)[0],
        forward.logits_logprobs(model, batch, CPU, None, 0.7)[0],
    )
    line = _check(model)
    assert line.startswith(
        "self-check: lm head (plain: the model's own logits, its transform after the head is"
    )
