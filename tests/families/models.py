"""Tiny random models of real families, each built from its own transformers config class and saved with its
family's tokenizer (tests/families/chat.py) so that the trainer's forward and both engines load it.

Every model has hidden size 64, 2 layers and 2 attention heads of head_dim 32 (vLLM's CPU attention needs
head_dim >= 32), a vocabulary of the family tokenizer's size, and float32 weights. Each family keeps what sets
it apart from a plain Llama where the trainer could get it wrong: Qwen2.5's q/k/v biases, Qwen3's q/k norms,
Qwen3-MoE's routed experts, Gemma 3's sliding-window layers beside a global one, its logit softcap, scaled
embeddings and tied head, Granite's four multipliers (the logits divided after the head), SmolLM2's tied head.
The weights are drawn wider than the configs' defaults (``INIT``) so the logits spread over several nats: at
the default 0.02 every distribution is near uniform and a wrong head would hide in it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from tests.families.chat import FAMILIES, build_tokenizer

HIDDEN, LAYERS, HEADS, HEAD_DIM = 64, 2, 2, 32
INIT = 0.2  # initializer_range: logits of a few nats (see the module docstring)


def _common(vocab: int) -> dict[str, Any]:
    return dict(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=1,  # grouped-query attention, as every family here ships it
        head_dim=HEAD_DIM,
        max_position_embeddings=512,
        initializer_range=INIT,
    )


def _config(family: str, vocab: int, tok) -> Any:
    """The family's own transformers config for a tiny model of ``vocab`` tokens."""
    import transformers

    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    common = {**_common(vocab), **ids}
    builders: dict[str, Callable[[], Any]] = {
        "llama3": lambda: transformers.LlamaConfig(**common, tie_word_embeddings=False),
        "smollm2": lambda: transformers.LlamaConfig(**common, tie_word_embeddings=True),
        "qwen2.5": lambda: transformers.Qwen2Config(**common, tie_word_embeddings=False),
        "qwen3": lambda: transformers.Qwen3Config(**common, tie_word_embeddings=False),
        "qwen3-moe": lambda: transformers.Qwen3MoeConfig(
            **common,
            tie_word_embeddings=False,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=HIDDEN,
            decoder_sparse_step=1,
            norm_topk_prob=True,
        ),
        "gemma3": lambda: transformers.Gemma3TextConfig(
            **common,
            tie_word_embeddings=True,
            sliding_window=4,  # shorter than the prompts: the window cuts
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=HEAD_DIM,
            final_logit_softcapping=5.0,  # below the logits' spread: the cap bends them
            attn_logit_softcapping=None,
        ),
        "mistral": lambda: transformers.MistralConfig(
            **common, tie_word_embeddings=False, sliding_window=None
        ),
        "granite": lambda: transformers.GraniteConfig(
            **common,
            tie_word_embeddings=True,
            logits_scaling=2.0,  # the logits divided after the head (8 and 16 in Granite 3's configs)
            embedding_multiplier=4.0,
            residual_multiplier=0.5,
            attention_multiplier=0.05,
        ),
    }
    return builders[family]()


def build_family_model(family: str, out_dir: str, seed: int = 0) -> str:
    """Write ``family``'s tiny model (float32 safetensors, config, generation config) and its tokenizer to
    ``out_dir``; the same ``seed`` gives the same weights."""
    import torch
    import transformers

    tok = build_tokenizer(FAMILIES[family])
    config = _config(family, len(tok), tok)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir
