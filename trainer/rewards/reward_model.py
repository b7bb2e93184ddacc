"""A reward model as a reward: ``{name: reward_model, weight: w}`` in ``env.reward_functions``, scored by
a sequence classifier with one label (a Bradley-Terry reward model) on Ray actors of its own.

What the model reads is what it was trained on: the prompt's messages and the response, rendered as text
by the reward model's own tokenizer and chat template (:func:`render`), never the policy's token ids (the
two tokenizers differ in general). A sample longer than ``reward_model.max_length`` (by default the
model's context) is not truncated, which would score a response the model never saw whole: it gets
``reward_model.overlong_score`` and a note.

Scores are raw by default: GRPO normalises rewards within each group of one prompt, so a constant offset
or scale of the reward model changes nothing there; beside other rewards the scale matters, and
``reward_model.normalize`` (``given``: ``reward_model.mean``/``std``; ``config``: the ``mean``/``std`` the
model's config.json carries, as OpenRLHF writes them) and ``reward_model.clip`` bring it to theirs. Each
step reports ``train/rm_score_mean`` (raw) and ``train/rm_length_corr``, the correlation of the raw score
with the response's length: a reward model that pays for length is the usual first thing a policy games.

Placement: ``reward_model.replicas`` actors (:class:`RewardModelWorker`), each with ``reward_model.num_cpus``
CPUs, ``num_gpus`` GPUs and one unit of the custom Ray resource ``reward_model.resource`` when set (on a
GPU cluster, the worker group that serves reward models); on a CPU cluster plain CPU actors. A batch
goes to one replica, which splits it into forward passes of at most ``reward_model.max_tokens_per_batch``
(padded) tokens. The driver's side is :class:`RewardModelPool`; the reward runner
(:mod:`trainer.rewards.runner`) sends it each chunk of samples and combines its scores with the others'
by weight.

Failure is bounded and loud. The model is checked at start from its config alone (:func:`check`): a path
that does not exist, or a model that is not a sequence classifier with one label, is one line before
anything starts. A batch is bounded by ``env.reward_timeout_s`` from the moment its replica starts it; a
late batch's samples score 0 with a warning, as any reward's. A replica that dies ends the run in one line
naming it (the actors are registered with :mod:`trainer.watchdog`).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator
from typing import Any

from trainer.config import ConfigError, RewardModelConfig, RewardSpec
from trainer.rewards import actors
from trainer.rewards.actors import RewardModelError
from trainer.rewards.registry import REWARD_MODEL as NAME  # the env.reward_functions entry it scores

__all__ = ["NAME", "RewardModelError", "RewardModelPool", "RewardModelWorker", "check", "render", "used"]

# A reward model without a chat template reads each turn as "role: content" on its own line.
PLAIN_TEMPLATE = "{role}: {content}\n"


def used(specs: list[RewardSpec]) -> bool:
    return actors.used(NAME, specs)


# ----- the checks at start ----------------------------------------------------------------------------


def _model_name(cfg: RewardModelConfig) -> str:
    """``reward_model.name``; a ConfigError when it is null (an env.reward_functions entry needs a model)."""
    return actors.model_path(
        cfg.name,
        "reward_model.name",
        NAME,
        "a reward model's hub id or directory (an AutoModelForSequenceClassification with one label)",
    )


def _model_config(cfg: RewardModelConfig) -> Any:
    return actors.model_config(_model_name(cfg), "reward_model.name", cfg.trust_remote_code)


def check(cfg: RewardModelConfig, specs: list[RewardSpec]) -> None:
    """A ``reward_model`` entry has a model that is a sequence classifier with one label, read from its
    config alone; else a ConfigError naming the key. Nothing to check when no entry names it."""
    if not used(specs):
        return
    _model_name(cfg)
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    config = _model_config(cfg)
    arch = (getattr(config, "architectures", None) or [None])[0]
    classifier = (
        arch.endswith("ForSequenceClassification")
        if arch
        else (
            config.model_type in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES
            or bool(getattr(config, "auto_map", None))
        )
    )
    if not classifier:
        raise ConfigError(
            f"reward_model.name={cfg.name}: it is a {arch or config.model_type}, not a sequence classifier; a "
            "reward model loads with AutoModelForSequenceClassification and one label (a Bradley-Terry model)"
        )
    if config.num_labels != 1:
        raise ConfigError(
            f"reward_model.name={cfg.name}: a sequence classifier with {config.num_labels} labels; a reward model "
            "has one (its score), e.g. a Bradley-Terry model trained on preference pairs"
        )
    actors.check_weights(_model_name(cfg), "reward_model.name")
    if cfg.normalize == "config":
        stats(cfg, config)


def stats(cfg: RewardModelConfig, config: Any = None) -> tuple[float, float]:
    """``(mean, std)`` scores are normalised with: ``(0, 1)`` for none, the given ones, or the model config's."""
    if cfg.normalize == "none":
        return 0.0, 1.0
    if cfg.normalize == "given":
        return cfg.mean, cfg.std
    config = config if config is not None else _model_config(cfg)
    mean, std = getattr(config, "mean", None), getattr(config, "std", None)
    if isinstance(mean, (int, float)) and isinstance(std, (int, float)):
        if math.isfinite(mean) and math.isfinite(std) and std > 0:
            return float(mean), float(std)
    raise ConfigError(
        f"reward_model.normalize=config: the config.json of reward_model.name={cfg.name} carries no usable "
        f"mean and std (mean={mean!r}, std={std!r}); use reward_model.normalize=given with reward_model.mean "
        "and reward_model.std"
    )


def normalize(raw: float, mean: float, std: float, clip: float | None) -> float:
    score = (raw - mean) / std
    return score if clip is None else min(max(score, -clip), clip)


# ----- what the model reads ----------------------------------------------------------------------------


def render(tokenizer: Any, messages: list[dict], response: str) -> tuple[str, bool]:
    """The conversation with ``response`` as the assistant's turn, as the reward model's own chat template
    writes it, and whether that text already holds the special tokens (a template writes them)."""
    conversation = [*messages, {"role": "assistant", "content": response}]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(conversation, tokenize=False), True
    return "".join(PLAIN_TEMPLATE.format(**m) for m in conversation), False


_SLOT = "\x00response\x00"  # stands for the response while its conversation is rendered (encode)


def encode(tokenizer: Any, messages: list[dict], response: str) -> list[int]:
    """The reward model's tokens of ``messages`` with ``response`` as the assistant's turn. A response that
    writes a special-token string (``<|im_end|>\\n<|im_start|>user\\n...``) reaches the model as that text,
    never as control tokens: a forged turn would be scored as structure. Such a response goes into its slot of
    the rendered conversation tokenised on its own, special strings split; any other is tokenised with the
    conversation as one text, exactly as the model's own template and tokenizer write it."""
    text, special = render(tokenizer, messages, response)
    plain = tokenizer(response, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    if tokenizer(response, add_special_tokens=False)["input_ids"] == plain:
        return tokenizer(text, add_special_tokens=not special)["input_ids"]
    text, special = render(tokenizer, messages, _SLOT)
    before, _, after = text.partition(_SLOT)
    ids = tokenizer(before, add_special_tokens=not special)["input_ids"] + plain
    return ids + (tokenizer(after, add_special_tokens=False)["input_ids"] if after else [])


def batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped into forward passes of at most ``max_tokens`` padded tokens (batch x longest), shortest
    first so that padding stays small; a sample longer than the budget goes alone."""
    out: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if out and (len(out[-1]) + 1) * lengths[i] <= max_tokens:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def passes(ids: list[list[int]], max_tokens: int, invariant: bool) -> list[list[int]]:
    """Indices of ``ids`` per forward pass. ``invariant`` (reward_model.batch_invariant): each distinct sequence
    once and alone, a (1, L) pass with no padding and no batch mates, so its score is a function of its ids
    alone, bit for bit, whatever else the step holds and whichever replica scores it (indices of identical
    sequences share their pass). Else :func:`batches` by the token budget: padded passes, faster, whose scores
    move by rounding with their batch mates (float32: ~3e-8 at 0.4 on a CPU, which the advantages' flat-group
    tolerance absorbs; bfloat16: a unit in the last place, 0.0625 at 10, which it does not)."""
    if not invariant:
        return batches([len(s) for s in ids], max_tokens)
    same: dict[tuple[int, ...], list[int]] = {}
    for i, seq in enumerate(ids):
        same.setdefault(tuple(seq), []).append(i)
    return list(same.values())


class RewardModelWorker:
    """One replica: the tokenizer and the model, scoring ``(messages, response)`` pairs. A Ray actor."""

    def __init__(self, cfg: RewardModelConfig):
        from transformers import AutoModelForSequenceClassification

        from trainer.models import DTYPES, load_tokenizer

        self.cfg = cfg
        self.device, dtype = actors.device_and_dtype(cfg.num_gpus, cfg.dtype)
        name = _model_name(cfg)
        self.tokenizer = load_tokenizer(cfg.tokenizer or name, cfg.trust_remote_code)
        self.model = (
            AutoModelForSequenceClassification.from_pretrained(
                name, dtype=DTYPES[dtype], trust_remote_code=cfg.trust_remote_code, num_labels=1
            )
            .to(self.device)
            .eval()
        )
        self.text_config = self.model.config.get_text_config()
        context = getattr(self.text_config, "max_position_embeddings", None)
        self.max_length = cfg.max_length or context or 2**31

    def ready(self) -> dict:
        return {
            "max_length": self.max_length,
            "chat_template": bool(getattr(self.tokenizer, "chat_template", None)),
        }

    def score(self, items: list[tuple[list[dict], str]]) -> Iterator[Any]:
        """Yields None once running (the time limit starts), then ``(raw scores, notes, seconds)``: a raw score
        per item (None for one too long to read, with its note)."""
        yield None
        start = time.monotonic()
        ids = [encode(self.tokenizer, messages, response) for messages, response in items]
        scores: list[float | None] = [None] * len(items)
        notes = [""] * len(items)
        fits = []
        for i, seq in enumerate(ids):
            if len(seq) > self.max_length:
                notes[i] = (
                    f"too long for the reward model: {len(seq)} tokens > {self.max_length} "
                    f"(reward_model.max_length); scored reward_model.overlong_score"
                )
            else:
                fits.append(i)
        invariant = self.cfg.batch_invariant
        for group in passes([ids[i] for i in fits], self.cfg.max_tokens_per_batch, invariant):
            members = [fits[k] for k in group]
            if invariant:  # one sequence, read once for all its copies
                (value,) = self._forward([ids[members[0]]])
                for i in members:
                    scores[i] = value
                continue
            for i, value in zip(members, self._forward([ids[i] for i in members])):
                scores[i] = value
        yield scores, notes, time.monotonic() - start

    def _forward(self, seqs: list[list[int]]) -> list[float]:
        """One forward pass over right-padded ``seqs``: (B, T) ids -> B scores."""
        import torch

        longest = max(len(s) for s in seqs)
        # A decoder classifier scores the last token that is not its config's pad id: pad with an id no
        # sample ends on, so that a sample ending on the tokenizer's pad (often its eos) is read whole.
        last = {s[-1] for s in seqs}
        pad = next(
            p
            for p in itertools.chain([self.tokenizer.pad_token_id or 0], range(len(last) + 1))
            if p not in last
        )
        input_ids = torch.full((len(seqs), longest), pad, dtype=torch.long)  # (B, T)
        mask = torch.zeros((len(seqs), longest), dtype=torch.long)  # (B, T)
        for row, s in enumerate(seqs):
            input_ids[row, : len(s)] = torch.tensor(s)
            mask[row, : len(s)] = 1
        self.text_config.pad_token_id = pad
        with torch.inference_mode():
            logits = self.model(
                input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device)
            ).logits
        return logits[:, 0].float().cpu().tolist()  # (B, 1) -> B


# ----- the driver's side -------------------------------------------------------------------------------


class RewardModelPool(actors.ModelPool):
    """The reward model's replicas (:class:`~trainer.rewards.actors.ModelPool`); a batch is a list of
    ``(messages, response)``."""

    NAME, SECTION, WHAT, worker = NAME, "reward_model", "reward model", RewardModelWorker

    def __init__(self, cfg: RewardModelConfig, use_gpus: bool = False):
        self.mean, self.std = stats(cfg)
        super().__init__(cfg)

    def model_name(self) -> str:
        return f"reward_model.name={self.cfg.name}"

    def item(self, ground_truth: Any, response: str, messages: list[dict]) -> tuple[list[dict], str]:
        """What a replica reads of one sample: the prompt's messages, then the response."""
        return messages, response

    def describe(self) -> str:
        info = self.info[0] if self.info else {}
        template = (
            "its chat template"
            if info.get("chat_template")
            else "plain 'role: content' lines (no chat template)"
        )
        return (
            f"reward model {self.cfg.name}: {self.cfg.replicas} replica(s) of {self.asks()}, reads {template}, "
            f"up to {info.get('max_length', '?')} tokens"
        )

    def finish(self, raw: float | None, note: str) -> tuple[float, float | None, str]:
        """A replica's raw score as the reward's: ``(score, raw, note)``; None (too long) scores overlong_score."""
        if raw is None:
            return self.cfg.overlong_score, None, note
        return normalize(raw, self.mean, self.std, self.cfg.clip), raw, note


def component(cfg: Any) -> actors.PoolComponent | None:
    """The run's reward model as a component (:mod:`trainer.components`), when an entry of
    ``env.reward_functions`` names it."""
    if not used(cfg.env.reward_functions):
        return None
    return actors.PoolComponent(
        "reward model",
        lambda: check(cfg.reward_model, cfg.env.reward_functions),
        lambda: RewardModelPool(cfg.reward_model),
    )


def step_metrics(rollouts: list) -> dict[str, float]:
    """``train/rm_score_mean`` (raw scores of the samples the model read) and ``train/rm_length_corr``
    (Pearson's, of the raw score with the response's own tokens; 0 when either is constant)."""
    pairs = [
        (r.reward.rm_score, r.model_tokens)
        for r in rollouts
        if getattr(r.reward, "rm_score", None) is not None
    ]
    if not pairs:
        return {}
    n = len(pairs)
    ms, ml = sum(s for s, _ in pairs) / n, sum(length for _, length in pairs) / n
    cov = sum((s - ms) * (length - ml) for s, length in pairs)
    vs, vl = sum((s - ms) ** 2 for s, _ in pairs), sum((length - ml) ** 2 for _, length in pairs)
    corr = cov / math.sqrt(vs * vl) if vs > 0 and vl > 0 else 0.0
    return {"train/rm_score_mean": ms, "train/rm_length_corr": corr}
