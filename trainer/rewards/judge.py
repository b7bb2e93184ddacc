"""A self-hosted LLM judge as a reward: ``{name: llm_judge, weight: w}`` in ``env.reward_functions``, scored by a
causal LM of the run's choosing (``judge.model``) that reads a template and writes a verdict, on Ray actors of
its own; for tasks without a checkable answer, and without a judge API.

What the judge reads: ``judge.template`` with ``{question}`` (the prompt's last user turn), ``{response}`` and
optionally ``{reference}`` (the example's ground truth), as its user message through its own tokenizer's chat
template (:func:`prompt_ids`). It generates on one of the run's generation engines (``judge.backend``: hf or
vllm), greedily by default: its actors (:mod:`trainer.generation.judge`) own an engine each, built by the
engine factory, so they live with the engines, a layer above the rewards.

What it pays (:func:`parse`, on the judge's own generated text alone): with ``judge.parse=score``, the number
``judge.score_pattern`` reads in its last match (by default the last "Score: N", else the last "N/M"), if it
lies in ``[min_score, max_score]``, mapped to ``[0, 1]``; with ``parse=verdict``, the score of the last of the
``judge.verdicts`` words it wrote. An output with neither pays ``judge.unparsed_score``. Every sample's note
quotes what the judge wrote, so a step can be audited. Full marks (1) say ``correct``.

A judge is an attack surface. The response is data inside the template, never the judge's output: a response
that writes "Score: 10" is read by the judge, not by the parser. Its special-token strings are tokenised as
plain text (a response cannot close the user's turn and open the judge's), and a response longer than
``judge.max_response_tokens`` (judge tokens) is not judged at all: it pays ``judge.overlong_score`` with a
note (cut, the judge would pay for what it never saw; whole, it could push the instructions out of reach).

Failure is bounded and loud, as the reward model's (:mod:`trainer.rewards.actors`): a missing model, or one
that is not a causal LM, is one line at start (:func:`check`); a batch is bounded by ``env.reward_timeout_s``
from the moment its replica starts it; a replica that dies ends the run in one line naming it.
"""

from __future__ import annotations

import re
from typing import Any

from trainer.config import ConfigError, JudgeConfig, RewardSpec
from trainer.rewards import actors
from trainer.rewards.registry import LLM_JUDGE as NAME  # the env.reward_functions entry it scores

# Stands for the response while the template and the chat template are rendered; the response's own tokens
# go in its place (prompt_ids), so nothing in it is read as template or as a special token.
_SLOT = "\x00response\x00"
PARSED = "judge read "  # how the note of a parsed output starts (the others are warnings)
QUOTE_CHARS = 2000  # the judge's output quoted in a note (its whole output, up to judge.max_new_tokens)


def used(specs: list[RewardSpec]) -> bool:
    return actors.used(NAME, specs)


def model_name(cfg: JudgeConfig) -> str:
    return actors.model_path(cfg.model, "judge.model", NAME, "a causal LM's hub id or directory (the judge)")


def check(cfg: JudgeConfig, specs: list[RewardSpec]) -> None:
    """An ``llm_judge`` entry has a judge that is a causal LM, read from its config alone; else a ConfigError
    naming the key. Nothing to check when no entry names it."""
    if not used(specs):
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = actors.model_config(model_name(cfg), "judge.model", cfg.trust_remote_code)
    arch = (getattr(config, "architectures", None) or [None])[0]
    generative = (
        arch.endswith(("ForCausalLM", "ForConditionalGeneration"))
        if arch
        else config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or bool(getattr(config, "auto_map", None))
    )
    if not generative:
        raise ConfigError(
            f"judge.model={cfg.model}: it is a {arch or config.model_type}, not a causal LM; a judge writes its "
            "verdict (a sequence classifier is a reward model: reward_model.name)"
        )


# ----- what the judge's output pays --------------------------------------------------------------------


def parse(text: str, cfg: JudgeConfig) -> tuple[float | None, str]:
    """``(score in [0, 1], what was read)`` from the judge's own output ``text``; ``(None, why)`` when it holds
    no score. Bounded: one regular-expression scan of a text of at most ``judge.max_new_tokens`` tokens."""
    if cfg.parse == "verdict":
        words = sorted(cfg.verdicts, key=len, reverse=True)  # "incorrect" before "correct" where both fit
        pattern = r"(?<![\w-])(" + "|".join(re.escape(w) for w in words) + r")(?![\w-])"
        found = list(re.finditer(pattern, text, re.IGNORECASE))
        if not found:
            return None, f"no verdict ({', '.join(cfg.verdicts)})"
        said = found[-1].group(1)
        word = next(w for w in cfg.verdicts if w.lower() == said.lower())
        return float(cfg.verdicts[word]), word
    matches = list(re.finditer(cfg.score_pattern, text))
    if not matches:
        return None, "no score"
    number = next((g for g in matches[-1].groups() if g is not None), None)
    try:
        n = float(number) if number is not None else float("nan")
    except ValueError:
        n = float("nan")
    if not cfg.min_score <= n <= cfg.max_score:  # nan too
        return None, f"score {number!r} outside [{cfg.min_score:g}, {cfg.max_score:g}]"
    return (n - cfg.min_score) / (cfg.max_score - cfg.min_score), number or ""


def judged(text: str, cfg: JudgeConfig) -> tuple[float, str]:
    """What the judge's output ``text`` pays, and the note that says why and quotes it."""
    score, read = parse(text, cfg)
    quote = text if len(text) <= QUOTE_CHARS else text[:QUOTE_CHARS] + "..."
    if score is None:
        return cfg.unparsed_score, f"judge output unparsed ({read}), scored judge.unparsed_score: {quote!r}"
    return score, f"{PARSED}{read} -> {score:.3g}: {quote!r}"


# ----- what the judge reads ----------------------------------------------------------------------------


def last_user_turn(messages: list[dict]) -> str:
    users = [m.get("content") for m in messages if m.get("role") == "user"]
    return users[-1] if users and isinstance(users[-1], str) else ""


def prompt_ids(
    tokenizer: Any, template: str, question: str, response_ids: list[int], reference: str
) -> list[int]:
    """The judge's prompt: ``template`` with the question and the reference, as the user's turn of the judge's
    chat template (with the assistant's turn opened), the response's own ``response_ids`` in its slot."""
    text = template.format(question=question, response=_SLOT, reference=reference)
    special = bool(getattr(tokenizer, "chat_template", None))
    if special:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
    pieces = text.split(_SLOT)
    ids = tokenizer(pieces[0], add_special_tokens=not special)["input_ids"]
    for piece in pieces[1:]:
        ids += response_ids + tokenizer(piece, add_special_tokens=False)["input_ids"]
    return ids


def response_ids(tokenizer: Any, response: str) -> list[int]:
    """The response in the judge's tokens, special-token strings read as plain text."""
    return tokenizer(response, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def item(ground_truth: Any, response: str, messages: list[dict]) -> tuple[str, str, str]:
    """What the judge reads of one sample: ``(question, response, reference)``."""
    reference = "" if ground_truth is None else str(ground_truth)
    return last_user_turn(messages), response, reference
