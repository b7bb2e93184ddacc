"""The start-up check of a prompt's first token (trainer.data.prompts.check_bos): a model that needs BOS gets
it once, on real families' formats; Gemma without it, or any model with it twice, is refused in one line."""

from __future__ import annotations

import pytest

from tests.families.chat import FAMILIES, build_tokenizer
from trainer.data.prompts import BosError, check_bos, encode_prompt

MESSAGES = [{"role": "user", "content": "What is 2+3?"}]


def test_should_pass_when_gemmas_template_writes_bos_once():
    tok = build_tokenizer(FAMILIES["gemma3"])
    line = check_bos(tok, encode_prompt(tok, MESSAGES, {}), "gemma3_text")
    assert line == "self-check: prompts start with '<bos>' once, as gemma3_text expects"


def test_should_refuse_gemma_prompts_without_bos():
    tok = build_tokenizer(FAMILIES["gemma3"])
    tok.chat_template = tok.chat_template.replace("{{- bos_token }}", "")  # a template that forgot it
    with pytest.raises(BosError, match="do not start with '<bos>' \\(gemma3_text needs it\\)"):
        check_bos(tok, encode_prompt(tok, MESSAGES, {}), "gemma3_text")


def test_should_refuse_when_the_tokenizer_adds_bos_to_plain_text_and_the_prompt_lacks_it():
    tok = build_tokenizer(FAMILIES["llama3"])
    tok.add_bos_token = True  # as Llama 3's tokenizer does
    tok.chat_template = tok.chat_template.replace("{{- '<|begin_of_text|>' }}", "")
    with pytest.raises(BosError, match="its tokenizer puts it in front of plain text"):
        check_bos(tok, encode_prompt(tok, MESSAGES, {}), "llama")


def test_should_refuse_two_bos_tokens():
    tok = build_tokenizer(FAMILIES["llama3"])
    tok.add_bos_token = True
    twice = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    with pytest.raises(BosError, match="twice"):
        check_bos(tok, tok(twice)["input_ids"], "llama")  # encoded with the tokenizer's BOS on top


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_should_pass_every_familys_own_format(name):
    fam = FAMILIES[name]
    tok = build_tokenizer(fam)
    assert check_bos(tok, encode_prompt(tok, MESSAGES, {}), name.replace("3-moe", "3_moe")).startswith(
        "self-check:"
    )
