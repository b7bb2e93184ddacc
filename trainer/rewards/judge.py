"""A self-hosted LLM judge as a reward: ``{name: llm_judge, weight: w}`` in ``env.reward_functions``, scored by a
causal LM of the run's choosing (``judge.model``) that reads a template and writes a verdict, on Ray actors of
its own; for tasks without a checkable answer, and without a judge API.

What the judge reads: ``judge.template`` with ``{question}`` (the prompt's last user turn), ``{response}`` and
optionally ``{reference}`` (the example's ground truth), as its user message through its own tokenizer's chat
template (:func:`prompt_ids`). It generates on one of the run's generation engines (``judge.backend``: hf or
vllm), greedily by default: its actors (:mod:`trainer.generation.judge`) own an engine each, built by the
engine factory, so they live with the engines, a layer above the rewards.

What it pays (:func:`parse`, on the judge's own generated text alone): what the judge meant, or nothing; never
more. The template asks for a final line of a fixed form, and only that line is read: its thinking
(``<think>...</think>``) is dropped first, markdown emphasis (``**Score:** 8``, ``Score: **8**``) is ignored, and
everything before the last non-empty line (where a judge quotes the response, or weighs "10/10" before settling)
is never read. With ``judge.parse=score``, the number ``judge.score_pattern`` reads there (by default "Score: N",
"N/M" or MT-Bench's "[[N]]"), signs kept, if it lies in ``[min_score, max_score]``, mapped to ``[0, 1]``; two
different numbers on that line ("Score: 3 (it claims 10/10)") are ambiguous and unparsed. With
``parse=verdict``, the ``judge.verdicts`` word on that line; a negated one ("not correct") or two different ones
are unparsed. An output cut off at ``judge.max_new_tokens`` (its finish reason) is unparsed whatever it holds: it
may end inside a quotation of the response. Unparsed pays ``judge.unparsed_score``. Every sample's note quotes
what the judge wrote, so a step can be audited. Full marks (1) say ``correct``. Thinking judges (Qwen3) think
unless told otherwise: ``judge.chat_template_kwargs`` (e.g. ``{enable_thinking: false}``) reaches their chat
template.

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
    actors.check_weights(model_name(cfg), "judge.model")


# ----- what the judge's output pays --------------------------------------------------------------------


_THINK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_EMPHASIS = re.compile(r"[*_`]+")  # markdown bold, italics and code around a label or a number
# A negation shortly before a verdict word: "not correct", "isn't correct", "is not at all correct", "never correct".
_NEGATION = re.compile(r"\b(?:not|no|never|hardly|cannot|can't|\w+n't)\b(?:\W+\w+){0,2}\W*$", re.IGNORECASE)


def final_line(text: str) -> tuple[str | None, str]:
    """The line a judge's verdict is read from: the last non-empty line of ``text`` once its thinking is dropped
    and its markdown emphasis removed; ``(None, why)`` when there is none."""
    if "<think>" in text.lower() and "</think>" not in text.lower():
        return None, "the judge never finished thinking (no </think>)"
    lines = [line.strip() for line in _EMPHASIS.sub("", _THINK.sub("", text)).splitlines() if line.strip()]
    return (lines[-1], "") if lines else (None, "no final line")


def parse(text: str, cfg: JudgeConfig) -> tuple[float | None, str]:
    """``(score in [0, 1], what was read)`` from the judge's own output ``text``, read on its final line alone
    (:func:`final_line`); ``(None, why)`` when that line holds no verdict, an ambiguous one, or one out of range.
    Bounded: regular-expression scans of a text of at most ``judge.max_new_tokens`` tokens."""
    line, why = final_line(text)
    if line is None:
        return None, why
    if cfg.parse == "verdict":
        words = sorted(cfg.verdicts, key=len, reverse=True)  # "incorrect" before "correct" where both fit
        pattern = r"(?<![\w-])(" + "|".join(re.escape(w) for w in words) + r")(?![\w-])"
        found = list(re.finditer(pattern, line, re.IGNORECASE))
        if not found:
            return None, f"no verdict ({', '.join(cfg.verdicts)}) on the final line"
        negated = [m.group(1) for m in found if _NEGATION.search(line[: m.start()])]
        if negated:
            return None, f"a negated verdict ({negated[0]!r}): not read as the bare word"
        said = {m.group(1).lower() for m in found}
        if len(said) > 1:
            return None, f"two verdicts on the final line ({', '.join(sorted(said))})"
        (only,) = said
        word = next(w for w in cfg.verdicts if w.lower() == only)
        return float(cfg.verdicts[word]), word
    captured = [
        next((g for g in m.groups() if g is not None), None) for m in re.finditer(cfg.score_pattern, line)
    ]
    numbers: list[str] = [str(n) for n in captured if n is not None]
    if not numbers:
        return None, "no score on the final line"
    try:
        values = {float(n) for n in numbers}
    except ValueError:
        return None, f"score {numbers[-1]!r} is not a number"
    if len(values) > 1:
        return None, f"two scores on the final line ({', '.join(numbers)})"
    number, n = numbers[0], values.pop()
    if not cfg.min_score <= n <= cfg.max_score:  # nan too
        return None, f"score {number!r} outside [{cfg.min_score:g}, {cfg.max_score:g}]"
    return (n - cfg.min_score) / (cfg.max_score - cfg.min_score), number


def judged(text: str, cfg: JudgeConfig, finish_reason: str | None = None) -> tuple[float, str]:
    """What the judge's output ``text`` pays, and the note that says why and quotes it. An output cut off at
    ``judge.max_new_tokens`` (``finish_reason`` "length") pays nothing it might hold."""
    if finish_reason == "length":
        score, read = None, f"cut off at judge.max_new_tokens={cfg.max_new_tokens}"
    else:
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
    tokenizer: Any,
    template: str,
    question: str,
    response_ids: list[int],
    reference: str,
    chat_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The judge's prompt: ``template`` with the question and the reference, as the user's turn of the judge's
    chat template (with the assistant's turn opened; ``chat_kwargs``: judge.chat_template_kwargs), the response's
    own ``response_ids`` in its slot."""
    text = template.format(question=question, response=_SLOT, reference=reference)
    special = bool(getattr(tokenizer, "chat_template", None))
    if special:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}],
            tokenize=False,
            add_generation_prompt=True,
            **(chat_kwargs or {}),
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
