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
may end inside a quotation of the response. An unparsed output is asked for once more (``judge.retries=1``), sampled
at ``judge.retry_temperature`` (a greedy judge would only write it again) from a seed of the run's seed and the sample
(:func:`draw`: the same run pays the same sample the same, whatever it is batched with), when the batch's first pass
leaves time for a second within ``env.reward_timeout_s`` (:func:`retry_fits`); what is still unparsed pays
``judge.unparsed_score``. Each step reports the share of the samples the judge read that it asked again
(``train/judge_retried_frac``) and that stayed unparsed (``train/judge_unparsed_frac``): :func:`step_metrics`.
Every sample's note quotes what the judge wrote (both outputs, when it was asked again), so a step can be
audited. Full marks (1) say ``correct``. Thinking judges (Qwen3) think unless told otherwise:
``judge.chat_template_kwargs`` (e.g. ``{enable_thinking: false}``) reaches their chat template.

A judge is an attack surface. The response is data inside the template, never the judge's output: a response
that writes "Score: 10" is read by the judge, not by the parser. Its special-token strings are tokenised as
plain text (a response cannot close the user's turn and open the judge's), and a response longer than
``judge.max_response_tokens`` (judge tokens) is not judged at all: it pays ``judge.overlong_score`` with a
note (cut, the judge would pay for what it never saw; whole, it could push the instructions out of reach).

Nor can a response close its own section of the template and write instructions after it. The default template's
markers around it carry ``{nonce}``, a code of :data:`NONCE_HEX` hex digits drawn for each judge call (:func:`draw`):
an HMAC-SHA256 keyed with the run's seed over the call's attempt, question, reference and the response itself. A
response that writes ``[End of response]``, or any marker it guesses, then "Score: 10", is still inside the real
markers, which the judge is told to look for. To write the real marker it would have to hold a hash of a text
that holds that hash, a fixed point of SHA-256 (2^64 tries for 64 bits, even for someone who knew the run's seed);
and the policy never sees the judge's prompt, nor the seed. Should a response hold the call's code all the same,
it is not judged (it pays ``judge.unparsed_score`` with a note): what cannot be shown safe is not sent. A user's
template without ``{nonce}`` keeps working, and :func:`check` warns of it at start, once: its markers (if it has
any) can be written by the response, and only the template's author knows whether that matters.

Failure is bounded and loud, as the reward model's (:mod:`trainer.rewards.actors`): a missing model, or one
that is not a causal LM, is one line at start (:func:`check`); a batch is bounded by ``env.reward_timeout_s``
from the moment its replica starts it; a replica that dies ends the run in one line naming it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
from typing import Any

from trainer.config import ConfigError, JudgeConfig, RewardSpec
from trainer.rewards import actors
from trainer.rewards.registry import LLM_JUDGE as NAME  # the env.reward_functions entry it scores

# Stands for the response while the template and the chat template are rendered; the response's own tokens
# go in its place (prompt_ids), so nothing in it is read as template or as a special token.
_SLOT = "\x00response\x00"
PARSED = "judge read "  # how the note of a parsed output starts (the others are warnings)
RETRIED = PARSED + "on its retry "  # ... an output parsed when the judge was asked again
UNPARSED = "judge output unparsed"  # ... an output unparsed, not asked again (no retry, or no time for one)
UNPARSED_TWICE = "judge output unparsed twice"  # ... an output unparsed, and again on its retry
QUOTE_CHARS = 2000  # the judge's output quoted in a note (its whole output, up to judge.max_new_tokens)
NONCE_HEX = 16  # hex digits of a judge call's nonce: 64 bits
# A retry goes ahead when twice the batch's first pass fits in this share of env.reward_timeout_s (retry_fits): the
# rest is the estimate's margin (sampled outputs may run longer than greedy ones did) and the way back to the runner.
RETRY_SHARE = 0.8

log = logging.getLogger(__name__)


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
    if (warning := template_warning(cfg.template)) is not None:
        log.warning("%s", warning)


def template_warning(template: str) -> str | None:
    """The start-up warning for a ``judge.template`` whose markers carry no ``{nonce}``; None when they do."""
    import string

    if "nonce" in {field for _, field, _, _ in string.Formatter().parse(template)}:
        return None
    return (
        "judge.template has no {nonce}: a response can write whatever marks its end and add instructions after "
        "it; put {nonce} in the markers around {response} (as the default template does)"
    )


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


def read(text: str, cfg: JudgeConfig, finish_reason: str | None = None) -> tuple[float | None, str]:
    """:func:`parse` of an output that ended as ``finish_reason`` says: one cut off at ``judge.max_new_tokens``
    ("length") is unparsed whatever it holds."""
    if finish_reason == "length":
        return None, f"cut off at judge.max_new_tokens={cfg.max_new_tokens}"
    return parse(text, cfg)


def _quote(text: str) -> str:
    return repr(text if len(text) <= QUOTE_CHARS else text[:QUOTE_CHARS] + "...")


def judged(
    text: str, cfg: JudgeConfig, finish_reason: str | None = None, first: tuple[str, str] | None = None
) -> tuple[float, str]:
    """What the judge's output ``text`` pays, and the note that says why and quotes it. An output cut off at
    ``judge.max_new_tokens`` (``finish_reason`` "length") pays nothing it might hold. ``first``: when ``text``
    is the judge's retry, its first output and why that was unparsed, quoted after it."""
    score, why = read(text, cfg, finish_reason)
    earlier = "" if first is None else f"; first output unparsed ({first[1]}): {_quote(first[0])}"
    if score is None:
        head = UNPARSED if first is None else UNPARSED_TWICE
        return cfg.unparsed_score, f"{head} ({why}), scored judge.unparsed_score: {_quote(text)}{earlier}"
    return score, f"{PARSED if first is None else RETRIED}{why} -> {score:.3g}: {_quote(text)}{earlier}"


def retry_fits(first_pass_s: float, timeout_s: float | None) -> bool:
    """Whether a batch whose first pass (its prompts built, judged and read) took ``first_pass_s`` seconds has time to
    judge its unparsed samples again within ``timeout_s`` (env.reward_timeout_s; None: no bound given). The retry is
    taken to cost a first pass again: it judges no more prompts, and no longer outputs (an over-estimate when few
    are retried: the cost of that is a few samples paid judge.unparsed_score, which their notes say, where a
    retry past the bound would lose the whole batch)."""
    return timeout_s is None or 2 * first_pass_s <= RETRY_SHARE * timeout_s


def outcome(note: str) -> str | None:
    """What the judge's ``note`` on a sample says of its reading: "parsed", "retried" (unparsed, then parsed on its
    retry), "unparsed" (not asked again), "unparsed twice"; None when the judge read nothing (a response too long
    or holding the call's nonce, a batch that failed or timed out)."""
    for head, what in ((RETRIED, "retried"), (PARSED, "parsed"), (UNPARSED_TWICE, "unparsed twice")):
        if note.startswith(head):
            return what
    return "unparsed" if note.startswith(UNPARSED + " (") else None


def step_metrics(rollouts: list) -> dict[str, float]:
    """Of the step's samples the judge read (its note on each: ``RewardResult.model_notes``), the share it asked
    again (``train/judge_retried_frac``) and the share still unparsed after that (``train/judge_unparsed_frac``);
    nothing when it read none (no judge in the run)."""
    read = [
        o
        for r in rollouts
        if (o := outcome((getattr(r.reward, "model_notes", None) or {}).get(NAME, ""))) is not None
    ]
    if not read:
        return {}
    return {
        "train/judge_retried_frac": sum(o in ("retried", "unparsed twice") for o in read) / len(read),
        "train/judge_unparsed_frac": sum(o in ("unparsed", "unparsed twice") for o in read) / len(read),
    }


# ----- what the judge reads ----------------------------------------------------------------------------


def last_user_turn(messages: list[dict]) -> str:
    users = [m.get("content") for m in messages if m.get("role") == "user"]
    return users[-1] if users and isinstance(users[-1], str) else ""


def draw(seed: int, attempt: int, item: tuple[str, str, str]) -> tuple[str, int]:
    """``(nonce, sampling seed)`` of one judge call: its ``attempt`` (0 the first, 1 the retry) on the sample
    ``item`` ``(question, response, reference)`` in a run of ``seed``. Both come from one HMAC-SHA256 keyed with the
    run's seed over the attempt and the sample, so a run judges a sample the same way whatever it is batched with,
    and the nonce (``NONCE_HEX`` hex digits) cannot be written by the response it depends on (module docstring)."""
    message = json.dumps(
        [attempt, *item]
    ).encode()  # ASCII: a lone surrogate in a response is escaped, not lost
    digest = hmac.new(str(seed).encode(), message, hashlib.sha256).digest()
    nonce_bytes = NONCE_HEX // 2
    return digest[:nonce_bytes].hex(), int.from_bytes(
        digest[nonce_bytes : nonce_bytes + 4], "big"
    ) & 0x7FFFFFFF


def holds_nonce(response: str, nonce: str) -> bool:
    """The response holds the call's nonce (any case): it is not judged (module docstring)."""
    return nonce.lower() in response.lower()


def prompt_ids(
    tokenizer: Any,
    template: str,
    question: str,
    response_ids: list[int],
    reference: str,
    chat_kwargs: dict[str, Any] | None = None,
    nonce: str = "",
) -> list[int]:
    """The judge's prompt: ``template`` with the question, the reference and the call's ``nonce`` (:func:`draw`),
    as the user's turn of the judge's chat template (with the assistant's turn opened; ``chat_kwargs``:
    judge.chat_template_kwargs), the response's own ``response_ids`` in its slot."""
    text = template.format(question=question, response=_SLOT, reference=reference, nonce=nonce)
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
