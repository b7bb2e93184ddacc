"""The hf generation backend on the tiny model: shapes, stopping, logprobs, weight updates."""

from __future__ import annotations

import pytest
import torch

from trainer.generation.base import SamplingParams
from trainer.generation.hf import HFGenerationEngine
from trainer.models import load_model, load_tokenizer


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    torch.manual_seed(0)
    return HFGenerationEngine(
        load_model(tiny_model_path, "float32"), load_tokenizer(tiny_model_path), batch_size=3
    )


def _prompts(engine) -> list[list[int]]:
    tok = engine.tokenizer
    return [tok("1+2=")["input_ids"], tok("what is 3+4?")["input_ids"], tok("9")["input_ids"]]


def test_should_return_n_completions_per_prompt_in_order_when_batched(engine):
    out = engine.generate(_prompts(engine), 2, SamplingParams(max_new_tokens=5, seed=0))
    assert [len(group) for group in out] == [2, 2, 2]
    for group in out:
        for c in group:
            assert 1 <= len(c.token_ids) <= 5 and len(c.logprobs) == len(c.token_ids)
            assert c.finish_reason in ("stop", "length")
            assert all(lp <= 0 for lp in c.logprobs)


def test_should_be_deterministic_and_independent_of_batching_when_greedy(engine):
    prompts = _prompts(engine)
    together = engine.generate(prompts, 1, SamplingParams(max_new_tokens=6, temperature=0.0))
    alone = [engine.generate([p], 1, SamplingParams(max_new_tokens=6, temperature=0.0))[0] for p in prompts]
    assert [g[0].token_ids for g in together] == [g[0].token_ids for g in alone]


def test_should_report_the_models_own_logprobs_when_sampling_at_temperature_one(engine):
    prompt = _prompts(engine)[1]
    ((c,),) = engine.generate([prompt], 1, SamplingParams(max_new_tokens=6, seed=3))
    ids = torch.tensor([prompt + c.token_ids])
    with torch.no_grad():
        logits = engine.model(ids).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(c.logprobs), expected, atol=1e-4)


def test_should_stop_at_eos_and_keep_it_when_the_model_ends(engine):
    eos = engine.tokenizer.eos_token_id
    boost = torch.zeros(engine.model.config.vocab_size)
    boost[eos] = 100.0  # make EOS the only likely token
    hook = engine.model.lm_head.register_forward_hook(lambda module, args, out: out + boost)
    try:
        ((c,),) = engine.generate([_prompts(engine)[0]], 1, SamplingParams(max_new_tokens=5, seed=0))
    finally:
        hook.remove()
    assert c.token_ids == [eos] and c.finish_reason == "stop"


def test_should_change_outputs_when_weights_are_updated(engine):
    prompt = _prompts(engine)[0]
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    before = engine.generate([prompt], 1, greedy)[0][0].token_ids
    original = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    engine.update_weights((n, torch.randn_like(t)) for n, t in original.items())
    after = engine.generate([prompt], 1, greedy)[0][0].token_ids
    engine.update_weights(original.items())
    assert engine.generate([prompt], 1, greedy)[0][0].token_ids == before
    assert after != before
    with pytest.raises(KeyError):
        engine.update_weights([("no.such.weight", torch.zeros(1))])


def test_should_draw_what_torch_manual_seed_drew_and_leave_the_process_rng_alone_when_seeded(engine):
    from trainer.generation.hf import _draw

    probs = torch.softmax(torch.randn(6, 300, generator=torch.Generator().manual_seed(1)), -1)
    torch.manual_seed(11)
    reseeded = _draw(probs)  # the process's default generator, seeded
    assert torch.equal(_draw(probs, torch.Generator().manual_seed(11)), reseeded)
    torch.manual_seed(5)
    state = torch.get_rng_state()
    first = engine.generate(_prompts(engine), 2, SamplingParams(max_new_tokens=5, seed=4))
    assert torch.equal(torch.get_rng_state(), state)  # a seeded call draws from a generator of its own
    again = engine.generate(_prompts(engine), 2, SamplingParams(max_new_tokens=5, seed=4))
    assert [[c.token_ids for c in g] for g in again] == [[c.token_ids for c in g] for g in first]
    # One seed for a call is one stream for all of its rows, the process's own once seeded alike: seeds per
    # prompt (streams per row) leave a call with one seed drawing what it always drew.
    torch.manual_seed(4)
    unseeded = engine.generate(_prompts(engine), 2, SamplingParams(max_new_tokens=5))
    assert [[c.token_ids for c in g] for g in unseeded] == [[c.token_ids for c in g] for g in first]
