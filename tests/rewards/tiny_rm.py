"""A tiny Bradley-Terry reward model trained on arithmetic preferences (the right sum over a wrong one), with a
tokenizer and chat template of its own; built once per session and cached like builtin:tiny (``KUBERL_CACHE``),
from a fixed seed in a few seconds (:func:`build_arithmetic_rm`). Shared by tests/rewards/test_reward_model.py
and the learning runs of tests/rewards/test_reward_model_learns.py; import the ``arithmetic_rm`` fixture from
here.
"""

from __future__ import annotations

import random

import pytest

from tests import tiers
from trainer.config import DataConfig
from trainer.rewards import reward_model as rm

RM_VERSION = 3  # bump when the build below changes: the cache keys on it
TINY_OPTIONS = {"num_examples": 512, "min_operand": 0, "max_operand": 2, "ops": "+"}
# The policy (builtin:tiny) writes one of these characters, or nothing (its end-of-turn token).
POLICY_CHARS = "0123456789+-*/=?.,:() \nabcdefghijklmnopqrstuvwxyz"


def build_rm_tokenizer():
    """A character tokenizer that is not the policy's: other special tokens, the characters in another order
    (so every id differs), and a chat template of its own ("<s>user: 1+1</s><s>assistant: 2")."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "<s>", "</s>"]
    chars = list(dict.fromkeys(reversed(POLICY_CHARS)))
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + chars)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    # The last turn stays open: the classifier reads the score off the response's own last token.
    template = (
        "{% for m in messages %}{{ '<s>' + m['role'] + ': ' + m['content'] }}"
        "{% if not loop.last %}{{ '</s>' }}{% endif %}{% endfor %}"
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        bos_token="<s>",
        eos_token="</s>",
        chat_template=template,
    )


def arithmetic_pairs(seed: int = 0, n: int = 512) -> list[tuple[list[dict], str, str]]:
    """``(messages, chosen, rejected)``: each prompt of the tiny arithmetic problems, its sum preferred to a
    wrong response the policy could write (another character, or nothing)."""
    from trainer import data

    examples = data.get("arithmetic")(DataConfig(options=TINY_OPTIONS, seed=seed), "train")
    rng = random.Random(seed)
    pairs = []
    for i in range(n):
        ex = examples[i % len(examples)]
        # Half the time another digit (the hard case: a sum, but the wrong one), else any other character or none.
        pool = "0123456789" if rng.random() < 0.5 else POLICY_CHARS + " "
        wrong = rng.choice([c for c in pool if c != ex["ground_truth"]] + ([""] if len(pool) > 10 else []))
        pairs.append((ex["messages"], ex["ground_truth"], wrong))
    return pairs


def build_arithmetic_rm(out_dir: str, steps: int = 400, seed: int = 0) -> str:
    """Train a tiny Llama sequence classifier with the Bradley-Terry loss -log sigmoid(r_chosen - r_rejected)
    on :func:`arithmetic_pairs` and save it with its tokenizer as a Hugging Face directory."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tokenizer = build_rm_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    pairs = arithmetic_pairs(seed)

    def encode(messages, response):
        text, _ = rm.render(tokenizer, messages, response)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    chosen = [encode(m, c) for m, c, _ in pairs]
    rejected = [encode(m, r) for m, _, r in pairs]

    def batch(seqs):  # right-padded (B, T) ids and mask; no sample ends on the pad
        longest = max(map(len, seqs))
        ids = torch.full((len(seqs), longest), tokenizer.pad_token_id)
        mask = torch.zeros((len(seqs), longest), dtype=torch.long)
        for row, s in enumerate(seqs):
            ids[row, : len(s)], mask[row, : len(s)] = torch.tensor(s), 1
        return ids, mask

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForSequenceClassification(config)
        # A rate that learns the same model on every CPU kind. At 3e-3 the training amplified rounding: with
        # AVX2 kernels (ATEN_CPU_CAPABILITY=avx2) the model ranked a wrong response first on 5 of the 9 prompts,
        # and with AVX-512 its smallest margin was 0.41. At 3e-4 the smallest margin (right sum over the best
        # wrong response) is 5.6-6.4 for seeds 0-3 on both kinds, which differ by under 0.1.
        optim = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)
        order = random.Random(seed)
        for _ in range(steps):
            idx = order.sample(range(len(pairs)), 64)
            ids, mask = batch([chosen[i] for i in idx] + [rejected[i] for i in idx])
            r = model(input_ids=ids, attention_mask=mask).logits[:, 0]  # (2B,)
            loss = -torch.nn.functional.logsigmoid(r[:64] - r[64:]).mean()
            optim.zero_grad()
            loss.backward()
            optim.step()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
@tiers.starts("writes a reward model")
def arithmetic_rm(_quiet_env) -> str:
    """The trained tiny reward model's directory, built once for the session (and its xdist workers)."""
    from trainer.models.resolve import _cached, cache_root

    return str(_cached(cache_root(), f"test-arithmetic-rm-v{RM_VERSION}", build_arithmetic_rm))
