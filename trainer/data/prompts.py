"""Prompt building: chat messages -> token ids through the tokenizer's chat template.

A run with tools (a multi-turn environment that offers them) passes their schemas to the template's own
``tools=`` support, on the first prompt and on every rendering of the glue between turns, so the template
lays out its tool prompt and its tool-response markers as the model was trained to read them.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def encode_prompt(
    tokenizer,
    messages: list[dict[str, str]],
    chat_template_kwargs: dict[str, Any],
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Render ``messages`` (and ``tools``, if any) with ``add_generation_prompt`` and tokenize (no second BOS)."""
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **_with_tools(chat_template_kwargs, tools)
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _with_tools(kwargs: dict[str, Any], tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {**kwargs, "tools": tools} if tools else dict(kwargs)


def encode_examples(
    tokenizer,
    examples: list[dict],
    chat_template_kwargs: dict[str, Any],
    max_prompt_tokens: int,
    tools: list[dict[str, Any]] | None = None,
):
    """Token ids for each example; prompts longer than ``max_prompt_tokens`` are dropped with one warning."""
    kept, dropped = [], 0
    for ex in examples:
        ids = encode_prompt(tokenizer, ex["messages"], chat_template_kwargs, tools)
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
    """Token ids that continue a conversation after the model's turn with the environment's messages.

    The model's own tokens are kept exactly as sampled (re-tokenizing text need not give them
    back); only the template's glue is tokenized: the end of the assistant turn, the environment's
    messages (a user turn, or tool results inside the template's own tool-response markers) and the next
    generation prompt. Both are found by rendering the template around a placeholder.
    """

    def __init__(
        self, tokenizer, chat_template_kwargs: dict[str, Any], tools: list[dict[str, Any]] | None = None
    ):
        self.tokenizer, self.kwargs = tokenizer, _with_tools(chat_template_kwargs, tools)

    def continuation(
        self, messages: list[dict[str, Any]], feedback: str | list[dict[str, Any]], ended_with_eos: bool
    ) -> list[int]:
        """The glue after a model turn: ``feedback`` is the next user turn's text, or the messages to append
        (role "tool" or "user"). ``messages`` are the example's prompt messages."""
        tok = self.tokenizer
        after = [{"role": "user", "content": feedback}] if isinstance(feedback, str) else list(feedback)
        turn = [*messages, {"role": "assistant", "content": _PLACEHOLDER}]
        closed = tok.apply_chat_template(turn, tokenize=False, **self.kwargs)
        nxt = tok.apply_chat_template(
            [*turn, *after],
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
