"""Prompt building: chat messages -> token ids through the tokenizer's chat template."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def encode_prompt(
    tokenizer, messages: list[dict[str, str]], chat_template_kwargs: dict[str, Any]
) -> list[int]:
    """Render ``messages`` with ``add_generation_prompt`` and tokenize (no second BOS)."""
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **chat_template_kwargs
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_examples(
    tokenizer, examples: list[dict], chat_template_kwargs: dict[str, Any], max_prompt_tokens: int
):
    """Token ids for each example; prompts longer than ``max_prompt_tokens`` are dropped with one warning."""
    kept, dropped = [], 0
    for ex in examples:
        ids = encode_prompt(tokenizer, ex["messages"], chat_template_kwargs)
        if len(ids) > max_prompt_tokens:
            dropped += 1
            continue
        kept.append({**ex, "prompt_ids": ids})
    if dropped:
        log.warning(
            "dropped %d of %d prompts longer than %d tokens (policy.max_total_sequence_length - "
            "generation.max_new_tokens)",
            dropped,
            len(examples),
            max_prompt_tokens,
        )
    return kept


_PLACEHOLDER = "\u2063KUBERL_ASSISTANT_TURN\u2063"


class TurnEncoder:
    """Token ids that continue a conversation after the model's turn with a new user turn.

    The model's own tokens are kept exactly as sampled (re-tokenizing text need not give them
    back); only the template's glue is tokenized: the end of the assistant turn, the user turn and
    the next generation prompt. Both are found by rendering the template around a placeholder.
    """

    def __init__(self, tokenizer, chat_template_kwargs: dict[str, Any]):
        self.tokenizer, self.kwargs = tokenizer, chat_template_kwargs

    def continuation(self, messages: list[dict[str, str]], feedback: str, ended_with_eos: bool) -> list[int]:
        tok = self.tokenizer
        turn = [*messages, {"role": "assistant", "content": _PLACEHOLDER}]
        closed = tok.apply_chat_template(turn, tokenize=False, **self.kwargs)
        nxt = tok.apply_chat_template(
            [*turn, {"role": "user", "content": feedback}],
            tokenize=False,
            add_generation_prompt=True,
            **self.kwargs,
        )
        if not nxt.startswith(closed):  # a template that rewrites history: fall back to the tail
            closed = closed[: closed.index(_PLACEHOLDER) + len(_PLACEHOLDER)]
        end_of_turn = closed[closed.index(_PLACEHOLDER) + len(_PLACEHOLDER) :]
        ids = tok(end_of_turn, add_special_tokens=False)["input_ids"]
        if ended_with_eos and ids and ids[0] == tok.eos_token_id:
            ids = ids[1:]  # the model already wrote the end-of-turn token
        return ids + tok(nxt[len(closed) :], add_special_tokens=False)["input_ids"]
