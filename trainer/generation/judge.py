"""The judge's actors (:mod:`trainer.rewards.judge` says what it reads and pays): each replica owns a generation
engine over the judge's model, built by the engine factory (:func:`trainer.generation.factory.build_engine`:
``judge.backend`` hf or vllm, the same engines the policy samples from, never a decode loop of its own), and
judges batches of ``(question, response, reference)`` with ``judge.template``.

A batch is judged in one pass, then its unparsed outputs once more (``judge.retries``), sampled at
``judge.retry_temperature``, when the first pass leaves time for a second within ``env.reward_timeout_s`` (counted,
as the reward runner counts it, from the moment the replica starts the batch). Each call's nonce and sampling seed
are the run's seed and the sample's (:func:`trainer.rewards.judge.draw`), so a sample is judged the same whatever
it is batched with; the pool carries the run's seed and time bound to each batch.

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
        # The first pass's sampling; seeded per sample by sampling() when it samples at all
        self.params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature)

    def ready(self) -> dict:
        return {"chat_template": bool(getattr(self.tokenizer, "chat_template", None))}

    def prompts(
        self, items: list[tuple[str, str, str]], seed: int = 0, attempt: int = 0
    ) -> tuple[list[list[int] | None], list[str]]:
        """Each item's prompt ids for its ``attempt`` (0: the first, 1: the retry) in a run of ``seed``, the
        call's nonce in its markers; or None and a note for a response too long to judge, or one that holds
        the call's nonce."""
        prompts: list[list[int] | None] = []
        notes = []
        for question, response, reference in items:
            ids = rules.response_ids(self.tokenizer, response)
            nonce, _ = rules.draw(seed, attempt, (question, response, reference))
            if len(ids) > self.cfg.max_response_tokens:
                prompts.append(None)
                notes.append(
                    f"too long for the judge: {len(ids)} tokens > {self.cfg.max_response_tokens} "
                    "(judge.max_response_tokens); scored judge.overlong_score"
                )
                continue
            if rules.holds_nonce(response, nonce):
                prompts.append(None)
                notes.append(
                    "not judged: the response holds the judge call's nonce, which marks where it ends in "
                    "judge.template; scored judge.unparsed_score"
                )
                continue
            prompts.append(
                rules.prompt_ids(
                    self.tokenizer,
                    self.cfg.template,
                    question,
                    ids,
                    reference,
                    self.cfg.chat_template_kwargs,
                    nonce,
                )
            )
            notes.append("")
        return prompts, notes

    def sampling(self, items: list[tuple[str, str, str]], seed: int, attempt: int) -> SamplingParams:
        """How ``items`` are sampled on their ``attempt``: the first at judge.temperature, the retry at
        judge.retry_temperature; when sampled, each from a seed of its own (:func:`~trainer.rewards.judge.draw`)."""
        temperature = self.cfg.temperature if attempt == 0 else self.cfg.retry_temperature
        params = dataclasses.replace(self.params, temperature=temperature)
        if params.greedy:
            return params  # nothing drawn: no seeds (a vLLM engine on CPU then keeps its prompts in one call)
        return dataclasses.replace(params, seeds=[rules.draw(seed, attempt, item)[1] for item in items])

    def _judge(
        self, items: list[tuple[str, str, str]], seed: int, attempt: int
    ) -> tuple[list[Any | None], list[str]]:
        """Each item's output on its ``attempt`` (a Completion), or None and the note of why it was not judged."""
        prompts, notes = self.prompts(items, seed, attempt)
        todo = [i for i, p in enumerate(prompts) if p is not None]
        judged = [p for p in prompts if p is not None]  # todo's prompts, in its order
        outs: list[Any | None] = [None] * len(items)
        if todo:
            params = self.sampling([items[i] for i in todo], seed, attempt)
            for i, out in zip(todo, self.engine.generate(judged, 1, params)):
                outs[i] = out[0]
        return outs, notes

    def score(
        self, items: list[tuple[str, str, str]], seed: int = 0, timeout_s: float | None = None
    ) -> Iterator[Any]:
        """Yields None once running (the time limit starts), then ``(scores, notes, seconds)``: what each item
        pays, and a note quoting the judge's output (or why it was not judged). ``seed``: the run's; ``timeout_s``:
        env.reward_timeout_s, which a retry must fit in (None: no bound)."""
        yield None
        start = time.monotonic()
        cfg = self.cfg
        outs, notes = self._judge(items, seed, 0)
        scores = [cfg.overlong_score if n.startswith("too long") else cfg.unparsed_score for n in notes]
        again: dict[int, tuple[str, str]] = {}  # item -> its first output and why it is unparsed
        for i, out in enumerate(outs):
            if out is None:
                continue
            scores[i], notes[i] = rules.judged(out.text, cfg, out.finish_reason)
            if notes[i].startswith(rules.UNPARSED):
                again[i] = (out.text, rules.read(out.text, cfg, out.finish_reason)[1])
        first_pass_s = time.monotonic() - start
        if again and cfg.retries:
            if rules.retry_fits(first_pass_s, timeout_s):
                idx = sorted(again)
                retried, _ = self._judge([items[i] for i in idx], seed, 1)
                for i, out in zip(idx, retried):
                    if out is not None:  # judged the first time, so the second (the nonce aside: see prompts)
                        scores[i], notes[i] = rules.judged(out.text, cfg, out.finish_reason, again[i])
            else:
                for i in again:
                    notes[i] += (
                        f"; not asked again: the batch's first pass took {first_pass_s:.1f}s, and a second would "
                        f"not fit in env.reward_timeout_s={timeout_s:g}s"
                    )
        yield scores, notes, time.monotonic() - start

    def shutdown(self) -> None:
        self.engine.shutdown()


class JudgePool(actors.ModelPool):
    """The judge's replicas (:class:`~trainer.rewards.actors.ModelPool`); a batch is a list of ``(question,
    response, reference)``."""

    NAME, SECTION, WHAT, worker = rules.NAME, "judge", "judge", JudgeWorker

    def __init__(self, cfg: JudgeConfig, *, seed: int, timeout_s: float | None):
        """``seed``: the run's (each call's nonce and sampling seed derive from it and the sample); ``timeout_s``:
        env.reward_timeout_s, which each batch's retry must fit in."""
        self.seed, self.timeout_s = seed, timeout_s
        super().__init__(cfg)

    def call(self, items: list, replica: int | None = None) -> Any:
        """As :meth:`ModelPool.call`, the run's seed and time bound with the batch."""
        worker = self.workers[self.pick() if replica is None else replica]
        return worker.score.remote(items, self.seed, self.timeout_s)

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
        retry = (
            f", asks again once (temperature {self.cfg.retry_temperature:g}) when unparsed"
            if self.cfg.retries
            else ""
        )
        return (
            f"judge {self.cfg.model}: {self.cfg.replicas} replica(s) of {self.asks()} on the {self.cfg.backend} "
            f"engine, reads {template}, writes up to {self.cfg.max_new_tokens} tokens ({how}), "
            f"parse={self.cfg.parse}{retry}"
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


def component(cfg: Any) -> actors.PoolComponent | None:
    """The run's judge as a component (:mod:`trainer.components`), when an entry of ``env.reward_functions``
    names it."""
    if not rules.used(cfg.env.reward_functions):
        return None
    return actors.PoolComponent(
        "judge",
        lambda: rules.check(cfg.judge, cfg.env.reward_functions),
        lambda: JudgePool(cfg.judge, seed=cfg.seed, timeout_s=cfg.env.reward_timeout_s),
    )
