"""The judge's actors (:mod:`trainer.rewards.judge` says what it reads and pays): each replica owns a generation
engine over the judge's model, built by the engine factory (:func:`trainer.generation.factory.build_engine`:
``judge.backend`` hf or vllm, the same engines the policy samples from, never a decode loop of its own), and
judges batches of ``(question, response, reference)`` with ``judge.template``.

They live with the engines because they own one; the reward runner sees only their pool
(:class:`~trainer.rewards.actors.ModelPool`: started once, registered with the watchdog, bounded in time).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import torch

from trainer.config import GenerationConfig, JudgeConfig
from trainer.generation.base import SamplingParams
from trainer.generation.factory import EngineSpec, build_engine
from trainer.rewards import actors
from trainer.rewards import judge as rules


def generation_config(cfg: JudgeConfig, dtype: str) -> GenerationConfig:
    """The engine settings a replica generates with (``dtype`` resolved): the judge's own, the rest generation's
    defaults (a vLLM engine of its own takes the disaggregated share of its GPU); what the memory plan counts."""
    return dataclasses.replace(
        GenerationConfig(),
        backend=cfg.backend,
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        batch_size=cfg.batch_size,
        dtype=dtype,
    )


class JudgeWorker:
    """One replica: the judge's tokenizer and a generation engine over it, judging ``(question, response,
    reference)`` triples. A Ray actor."""

    def __init__(self, cfg: JudgeConfig):
        from trainer.models import load_tokenizer

        self.cfg = cfg
        device, dtype = actors.device_and_dtype(cfg.num_gpus, cfg.dtype)
        name = rules.model_name(cfg)
        self.tokenizer = load_tokenizer(cfg.tokenizer or name, cfg.trust_remote_code)
        gen = generation_config(cfg, dtype)
        spec = EngineSpec(
            model_path=name,
            dtype=dtype,
            trust_remote_code=cfg.trust_remote_code,
            tokenizer_path=cfg.tokenizer,
            device=torch.device(device),
        )
        self.engine = build_engine(gen, spec)
        self.params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature)

    def ready(self) -> dict:
        return {"chat_template": bool(getattr(self.tokenizer, "chat_template", None))}

    def prompts(self, items: list[tuple[str, str, str]]) -> tuple[list[list[int] | None], list[str]]:
        """Each item's prompt ids, or None and a note for a response too long to judge."""
        prompts: list[list[int] | None] = []
        notes = []
        for question, response, reference in items:
            ids = rules.response_ids(self.tokenizer, response)
            if len(ids) > self.cfg.max_response_tokens:
                prompts.append(None)
                notes.append(
                    f"too long for the judge: {len(ids)} tokens > {self.cfg.max_response_tokens} "
                    "(judge.max_response_tokens); scored judge.overlong_score"
                )
                continue
            prompts.append(
                rules.prompt_ids(
                    self.tokenizer, self.cfg.template, question, ids, reference, self.cfg.chat_template_kwargs
                )
            )
            notes.append("")
        return prompts, notes

    def score(self, items: list[tuple[str, str, str]]) -> Iterator[Any]:
        """Yields None once running (the time limit starts), then ``(scores, notes, seconds)``: what each item
        pays, and a note quoting the judge's output (or why it was not judged)."""
        yield None
        start = time.monotonic()
        prompts, notes = self.prompts(items)
        scores = [self.cfg.overlong_score] * len(items)
        todo = [i for i, p in enumerate(prompts) if p is not None]
        judged = [p for p in prompts if p is not None]  # todo's prompts, in its order
        if todo:
            outs = self.engine.generate(judged, 1, self.params)
            for i, out in zip(todo, outs):
                scores[i], notes[i] = rules.judged(out[0].text, self.cfg, out[0].finish_reason)
        yield scores, notes, time.monotonic() - start

    def shutdown(self) -> None:
        self.engine.shutdown()


class JudgePool(actors.ModelPool):
    """The judge's replicas (:class:`~trainer.rewards.actors.ModelPool`); a batch is a list of ``(question,
    response, reference)``."""

    NAME, SECTION, WHAT, worker = rules.NAME, "judge", "judge", JudgeWorker

    def model_name(self) -> str:
        return f"judge.model={self.cfg.model}"

    def item(self, ground_truth: Any, response: str, messages: list[dict]) -> tuple[str, str, str]:
        return rules.item(ground_truth, response, messages)

    def describe(self) -> str:
        info = self.info[0] if self.info else {}
        template = (
            "its chat template" if info.get("chat_template") else "the plain template (no chat template)"
        )
        how = "greedy" if self.cfg.temperature == 0 else f"temperature {self.cfg.temperature:g}"
        return (
            f"judge {self.cfg.model}: {self.cfg.replicas} replica(s) of {self.asks()} on the {self.cfg.backend} "
            f"engine, reads {template}, writes up to {self.cfg.max_new_tokens} tokens ({how}), "
            f"parse={self.cfg.parse}"
        )

    def finish(self, raw: float | None, note: str) -> tuple[float, float | None, str]:
        """The replica's score is the reward's (unparsed and overlong outputs already paid theirs)."""
        score = self.cfg.unparsed_score if raw is None else raw
        return score, raw, note

    def shutdown(self, graceful: bool = True) -> None:
        """End each engine (a vLLM one's processes) before its actor, when there is time to."""
        if graceful and self.workers:
            import ray

            try:
                ray.wait(
                    [w.shutdown.remote() for w in self.workers], num_returns=len(self.workers), timeout=30
                )
            except Exception:  # noqa: S110  (a replica already gone: killed below)
                pass
        super().shutdown(graceful)
