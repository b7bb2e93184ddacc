"""The hf engine's own decode loop against references: HF generate, a plain forward pass, HF's stop rules.

The stored tiny model is nearly uniform and repeats one token when greedy, which would hide a wrong
position, mask or cache row; these tests redraw its weights larger so that continuations vary.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers.cache_utils import DynamicCache
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import trainer.generation.hf as hf
from trainer.generation.base import SamplingParams
from trainer.generation.hf import HFGenerationEngine
from trainer.models import load_model, load_tokenizer

# Prompts of 1 to 35 tokens; greedy, the first two end with EOS within 12 tokens (weights of seed 1 below).
TEXTS = ["1+2=", "what is 3+4?", "9", "compute 12*3 and then add 7, please:", "8+8="]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return load_tokenizer(tiny_model_path)


@pytest.fixture(scope="module")
def model(tiny_model_path):
    model = load_model(tiny_model_path, "float32")
    gen = torch.Generator().manual_seed(1)  # one whose greedy rows end both ways (EOS and length)
    with torch.no_grad():
        for tensor in model.parameters():
            if tensor.dim() == 2:  # embeddings and projections; norms stay at one
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.3)
    return model


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(t)["input_ids"] for t in TEXTS]


def _hf_greedy(engine: HFGenerationEngine, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF generate on the prompt alone (no padding), the continuation only."""
    ids = torch.tensor([prompt])
    out = engine.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=engine.pad_id,
        eos_token_id=engine.eos_ids,
    )
    return out[0, len(prompt) :].tolist()


def _no_row_select(self, indices):
    raise NotImplementedError


@pytest.mark.parametrize("cache", ["static", "static-growing", "dynamic", "no-row-select"])
def test_should_match_hf_generate_token_for_token_when_greedy(model, tokenizer, prompts, cache, monkeypatch):
    if cache == "static-growing":  # the static cache grows every 3 columns, not every 32
        monkeypatch.setattr(hf, "_CACHE_CHUNK", 3)
    if cache in ("dynamic", "no-row-select"):  # a model with other cache layers falls back to a DynamicCache
        monkeypatch.setattr(hf, "_is_plain_static_cache", lambda *args: False)
    if cache == "no-row-select":  # ... and one whose cache cannot select rows prefills every row
        monkeypatch.setattr(DynamicCache, "batch_select_indices", _no_row_select)
    # batch_size 3 splits the 2 samples of a prompt across batches: 10 rows go as 3 + 3 + 3 + 1.
    engine = HFGenerationEngine(model, tokenizer, batch_size=3)
    out = engine.generate(prompts, 2, SamplingParams(max_new_tokens=12, temperature=0.0))
    assert engine._static_cache is cache.startswith("static")  # Llama takes the fast path unless made not to
    reasons = set()
    for prompt, group in zip(prompts, out):
        expected = _hf_greedy(engine, prompt, 12)
        assert [c.token_ids for c in group] == [expected, expected]
        reason = "stop" if expected[-1] in engine.eos_ids else "length"
        assert [c.finish_reason for c in group] == [reason, reason]
        assert group[0].text == tokenizer.decode(expected, skip_special_tokens=True)
        reasons.add(reason)
    assert reasons == {"stop", "length"}  # some rows ended early while others went on


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, -1, 1.0), (0.7, 5, 0.9)])
def test_should_record_the_logprobs_a_plain_forward_gives_when_sampling(
    model, tokenizer, prompts, temperature, top_k, top_p
):
    engine = HFGenerationEngine(model, tokenizer, batch_size=5)
    params = SamplingParams(max_new_tokens=10, temperature=temperature, top_k=top_k, top_p=top_p, seed=1)
    out = engine.generate(prompts, 3, params)
    for prompt, group in zip(prompts, out):
        for c in group:
            assert len(c.logprobs) == len(c.token_ids) >= 1
            with torch.no_grad():
                logits = model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1]  # (L, V)
            tokens = torch.tensor(c.token_ids)[:, None]
            # Each sample against its own forward pass: a cache row shared between samples would fail here.
            expected = torch.log_softmax(logits / temperature, -1).gather(1, tokens)[:, 0]
            assert torch.allclose(torch.tensor(c.logprobs), expected, atol=1e-4)
            if top_k > 0:  # sampled within the top-k, top-p truncation, recorded before it
                scaled = logits / temperature
                kth = scaled.topk(top_k, -1).values[:, -1:]
                probs = torch.softmax(scaled.masked_fill(scaled < kth, float("-inf")), -1)  # (L, V)
                chosen = probs.gather(1, tokens)  # (L, 1)
                assert (chosen > 0).all()
                assert ((probs * (probs > chosen)).sum(-1) < top_p).all()


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, -1, 1.0), (1.5, 8, 0.8)])
def test_should_sample_with_the_frequencies_hf_warpers_give(
    model, tokenizer, prompts, temperature, top_k, top_p
):
    n = 4000  # one prefill, then a single sampling step over n rows
    engine = HFGenerationEngine(model, tokenizer, batch_size=n)
    params = SamplingParams(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p, seed=0)
    (group,) = engine.generate([prompts[1]], n, params)
    with torch.no_grad():
        scores = model(torch.tensor([prompts[1]])).logits[:, -1].float()  # (1, V)
    warpers = [TemperatureLogitsWarper(temperature)]
    warpers += [TopKLogitsWarper(top_k)] if top_k > 0 else []
    warpers += [TopPLogitsWarper(top_p)] if top_p < 1.0 else []
    for warper in warpers:
        scores = warper(None, scores)
    expected = torch.softmax(scores, -1)[0].double()  # (V,)
    assert expected.max() < 0.5 and (expected > 0.01).sum() >= 4  # a spread-out distribution to test on
    counts = torch.bincount(torch.tensor([c.token_ids[0] for c in group]), minlength=len(expected)) / n
    assert (counts[expected == 0] == 0).all()
    assert (counts - expected).abs().max() < 0.03  # 4 standard deviations at n = 4000


def test_should_give_each_sample_of_a_prompt_its_own_continuation(model, tokenizer, prompts):
    engine = HFGenerationEngine(model, tokenizer, batch_size=8)
    params = SamplingParams(max_new_tokens=8, seed=0)
    (group,) = engine.generate([prompts[1]], 4, params)
    assert len({tuple(c.token_ids) for c in group}) == 4
    (again,) = engine.generate([prompts[1]], 4, params)
    assert [c.token_ids for c in again] == [c.token_ids for c in group]  # the seed is honoured


def test_should_stop_each_row_at_its_own_eos_and_keep_it(model, tokenizer, prompts):
    engine = HFGenerationEngine(model, tokenizer, batch_size=8)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    free = [g[0].token_ids for g in engine.generate(prompts, 1, greedy)]
    stop_token = free[0][3]  # one more end-of-sequence id, produced early by the first prompt
    engine.eos_ids = engine.eos_ids + [stop_token]
    out = engine.generate(prompts, 2, greedy)
    ended_early = 0
    for ids, group in zip(free, out):
        ends = [i for i, t in enumerate(ids) if t in engine.eos_ids]
        expected, reason = (ids[: ends[0] + 1], "stop") if ends else (ids, "length")
        for c in group:
            assert (c.token_ids, c.finish_reason) == (expected, reason)
            assert len(c.logprobs) == len(expected)
        ended_early += len(expected) < len(ids)
    assert 1 <= ended_early < len(prompts)  # rows finished at different steps


def _first_prefix_containing(tokenizer, ids: list[int], stop: str) -> int | None:
    """The length of the shortest prefix of ``ids`` whose text contains ``stop``."""
    return next((k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k])), None)


def test_should_stop_right_after_a_stop_string_is_complete(model, tokenizer, prompts):
    engine = HFGenerationEngine(model, tokenizer, batch_size=8)
    free = [g[0] for g in engine.generate(prompts, 1, SamplingParams(max_new_tokens=12, temperature=0.0))]
    stop = free[0].text[3:5]  # one character per token: ends at the 5th generated token
    params = SamplingParams(max_new_tokens=12, temperature=0.0, stop_strings=["never seen", stop])
    out = engine.generate(prompts, 2, params)
    stopped = 0
    for f, group in zip(free, out):
        cut = _first_prefix_containing(tokenizer, f.token_ids, stop)
        expected, reason = (f.token_ids[:cut], "stop") if cut else (f.token_ids, f.finish_reason)
        for c in group:
            assert (c.token_ids, c.finish_reason) == (expected, reason)
            assert c.text.endswith(stop) or not cut
        stopped += bool(cut)
    assert 1 <= stopped < len(prompts)


class _TwoCharTokenizer:
    """The tiny tokenizer, except that every id decodes to two characters ("Aa", "Bb", ...)."""

    def __init__(self, tokenizer):
        self.pad_token_id, self.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(65 + i % 26) + chr(97 + i % 26) for i in ids)


def test_should_stop_when_a_stop_string_ends_inside_the_last_token(model, tokenizer, prompts):
    """Like HF's StopStringCriteria: the token that completes the string may run past its end."""
    engine = HFGenerationEngine(model, _TwoCharTokenizer(tokenizer), batch_size=8)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    (free,) = engine.generate([prompts[0]], 1, greedy)[0]
    stop = free.text[5:7]  # the 2nd character of token 2 to the 1st of token 3
    ((c,),) = engine.generate([prompts[0]], 1, dataclasses.replace(greedy, stop_strings=[stop]))
    cut = _first_prefix_containing(engine.tokenizer, free.token_ids, stop)
    assert cut <= 4 and not c.text.endswith(stop)
    assert (c.token_ids, c.finish_reason) == (free.token_ids[:cut], "stop")
