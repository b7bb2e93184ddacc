"""A tiny LLM judge trained to write "score: 1" for a response that is the reference sum and "score: 0" for any
other; built once per session and cached like builtin:tiny (``KUBERL_CACHE``), from a fixed seed, in seconds
(:func:`build_arithmetic_judge`). Shared by tests/rewards/test_judge.py and the learning run of
tests/rewards/test_judge_learns.py; import the ``arithmetic_judge`` fixture from here.
"""

from __future__ import annotations

import random

import pytest

from tests import tiers
from trainer.config import DataConfig
from trainer.rewards import judge

JUDGE_VERSION = 6  # bump when the build below changes: the cache keys on it
TINY_OPTIONS = {"num_examples": 512, "min_operand": 0, "max_operand": 2, "ops": "+"}
# The trained judge's template: the question, the reference answer and the response, nothing else (a tiny
# model reads little, and compares the response with the reference, as a judge given one does).
SUM_TEMPLATE = "{question} {reference} {response}"
# What the policy (builtin:tiny) writes: one of these characters per token.
POLICY_CHARS = "0123456789+-*/=?.,:() \nabcdefghijklmnopqrstuvwxyz"


def judge_examples(seed: int = 0) -> list[tuple[str, str, str, str]]:
    """``(question, reference, response, verdict)`` over the tiny arithmetic problems: the sum ("score: 1"),
    then another digit (the hard case) and another character, nothing or a longer string (each "score: 0")."""
    from trainer import data

    examples = data.get("arithmetic")(DataConfig(options=TINY_OPTIONS, seed=seed), "train")
    rng = random.Random(seed)
    out = []
    for ex in examples:
        question, right = ex["messages"][-1]["content"], ex["ground_truth"]
        out.append((question, right, right, "score: 1"))
        out.append((question, right, rng.choice([d for d in "0123456789" if d != right]), "score: 0"))
        if rng.random() < 0.6:
            other = rng.choice([c for c in POLICY_CHARS if c != right] + [""])
        else:
            other = "".join(rng.choice(POLICY_CHARS) for _ in range(rng.randint(2, 6)))
        out.append((question, right, other, "score: 0"))
    return out


def build_arithmetic_judge(out_dir: str, steps: int = 300, seed: int = 0) -> str:
    """Train builtin:tiny's architecture (a fresh copy) to answer ``SUM_TEMPLATE`` with its verdict: the loss on
    the verdict's tokens (and the end of turn) alone, the prompt built by the judge's own :func:`prompt_ids`."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.models import load_tokenizer
    from trainer.models.tiny import build_tiny_model

    build_tiny_model(out_dir, seed=seed)
    tok = load_tokenizer(out_dir)
    rows = []
    for question, reference, response, verdict in judge_examples(seed):
        prompt = judge.prompt_ids(tok, SUM_TEMPLATE, question, judge.response_ids(tok, response), reference)
        target = tok(verdict, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append((prompt, target))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
        optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        order = random.Random(seed)
        for _ in range(steps):
            batch = order.sample(rows, 64)
            longest = max(len(p) + len(t) for p, t in batch)
            ids = torch.full((64, longest), tok.pad_token_id)
            labels = torch.full((64, longest), -100)
            mask = torch.zeros((64, longest), dtype=torch.long)
            for row, (p, t) in enumerate(batch):
                ids[row, : len(p) + len(t)] = torch.tensor(p + t)
                labels[row, len(p) : len(p) + len(t)] = torch.tensor(t)
                mask[row, : len(p) + len(t)] = 1
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            optim.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(
                model.parameters(), 1.0
            )  # a tiny model at this rate spikes without it
            optim.step()
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
@tiers.starts("writes a judge model")
def arithmetic_judge(_quiet_env) -> str:
    """The trained tiny judge's directory, built once for the session (and its xdist workers)."""
    from trainer.models.resolve import _cached, cache_root

    return str(_cached(cache_root(), f"test-arithmetic-judge-v{JUDGE_VERSION}", build_arithmetic_judge))
