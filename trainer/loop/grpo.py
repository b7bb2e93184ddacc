"""The GRPO loop (Shao et al. 2024, DeepSeekMath), run by a single controller.

One step: take a batch of ``num_generations_per_prompt`` completions for each of
``num_prompts_per_step`` prompts from the rollout stream (:mod:`trainer.loop.rollout_stream`:
generated now, or ahead by older weights with ``grpo.async.max_staleness``), wait for its rewards
(they run while generation and the logprob passes are still going), turn rewards into group-relative
advantages, take ``num_minibatches`` optimizer steps on the FSDP2 policy, and push the new weights to
the generation engines.

Departures from the paper, as in NeMo-RL and verl: the KL penalty is in the loss (not the reward),
and when there is one optimizer step per batch the old logprobs are the current ones detached,
which skips a forward pass and gives exactly the same gradient.

Each step also says how fast it ran (``perf/``): generated and trained tokens/s, the training's model
FLOPs utilisation (:mod:`trainer.perf`) and each policy rank's peak memory. Its scalars and jsonl rows are
built by :mod:`trainer.step_report` from what the step holds.

After SIGTERM the loop stops at the next safe point (``state.preemption_point``): the end of a
step, or inside one once its rollouts are scored but before the optimizer step, when the step is
dropped whole and redone on resume with the same prompts and seeds.
"""

from __future__ import annotations

import time

import torch

from trainer import perf
from trainer.algorithms import core_algos
from trainer.config import Config
from trainer.generation.base import SamplingParams
from trainer.generation.placement import GenerationError, Generator
from trainer.logger import RunLogger
from trainer.loop import rollout
from trainer.loop.rollout_stream import AsyncRollouts, RolloutBatch, SyncRollouts, make_rollout_stream
from trainer.loop.state import LoopState
from trainer.policy.batch import Sample
from trainer.policy.group import PolicyGroup
from trainer.rewards import judge, reward_model
from trainer.rewards.runner import RewardRunner, normalization_metrics
from trainer.step_report import perf_metrics, rollout_rows, sample_line, step_metrics


def sampling_params(cfg: Config, seed: int, greedy: bool = False) -> SamplingParams:
    g = cfg.generation
    return SamplingParams(
        max_new_tokens=g.max_new_tokens,
        temperature=0.0 if greedy else g.temperature,
        top_p=g.top_p,
        top_k=g.top_k,
        stop_strings=list(g.stop_strings),
        seed=seed,
        routes=not greedy,  # an MoE engine's routes, for replay and train/routing_mismatch (a dense one: none)
    )


def grpo_step(
    cfg: Config,
    step: int,
    stream: SyncRollouts | AsyncRollouts,
    state: LoopState,
    flops: perf.ModelFlops | None = None,
    parity: EngineParity | None = None,
) -> tuple[dict[str, float], list[dict], RolloutBatch]:
    policy, rewards = state.policy, state.rewards
    g, loss_cfg = cfg.grpo, cfg.grpo.loss
    t0 = time.monotonic()
    batch = stream.next(step)
    pending = batch.pending
    samples = [
        Sample(
            r.prompt_ids, r.tokens, response_mask=r.response_mask, gen_logprobs=r.logprobs, routes=r.routes
        )
        for r in pending.rollouts
    ]

    # Logprob passes need only the tokens, so they run while the rewards are still being computed.
    t1 = time.monotonic()
    old = policy.compute_logprobs_async(samples) if g.num_minibatches > 1 else None
    ref = (
        policy.compute_logprobs_async(samples, reference=True)
        if loss_cfg.reference_policy_kl_penalty > 0
        else None
    )
    rollouts = rollout.finish(pending, rewards)
    if batch.reward_state is None:  # scored here (sync): the runner's state after this step's rewards
        batch.reward_state = rewards.state_dict()
    t2 = time.monotonic()
    for name, p in (("old_logprobs", old), ("ref_logprobs", ref)):
        if p is not None:
            for s, lp in zip(samples, PolicyGroup.gather_logprobs(p, len(samples))):
                setattr(s, name, lp)
    t3 = time.monotonic()
    # The last point where this step can be dropped whole: the weights are still the previous step's.
    state.preemption_point()

    results = rollout.rewards_of(rollouts)
    reward = torch.tensor([r.total for r in results], dtype=torch.float32)  # (B,)
    shaped, overlong = reward, None
    if g.reward_shaping.overlong_buffer > 0:  # DAPO: the model's own tokens (multi-turn: all its turns)
        n_tokens = torch.tensor([r.model_tokens for r in rollouts], dtype=torch.float32)  # (B,)
        overlong = core_algos.overlong_penalty(
            n_tokens,
            cfg.generation.max_new_tokens,
            g.reward_shaping.overlong_buffer,
            g.reward_shaping.overlong_penalty,
        )
        shaped = (
            reward + overlong
        )  # advantages only: train/reward_* and the jsonl reward stay the rewards' total
    advantages = core_algos.compute_advantages(
        shaped,
        g.num_generations_per_prompt,
        estimator=g.advantage_estimator,
        normalize_std=g.normalize_rewards,
        std=g.advantage.std,
    )
    for s, a in zip(samples, advantages.tolist()):
        s.advantage = a

    train_metrics = policy.train(samples)
    if parity is not None:  # before the new weights reach the engines: the run stops on this step's
        gap = train_metrics.get("gen_logprob_abs_diff")  # absent: no engine-sampled token was trained on
        parity.check(
            step,
            batch,
            gap if gap is not None else 0.0,
            sum(policy.trained_lengths) if gap is not None else 0,
            routing=train_metrics.get(
                "moe/routing_mismatch"
            ),  # an MoE engine's routes, when it returned them
        )
    t4 = time.monotonic()
    push_wait_s, refit_s = stream.push_weights(step)  # async: once the round in flight ends
    t5 = time.monotonic()

    timing = {
        "generation_s": batch.generation_s,
        "reward_s": t2 - t1,  # only the wait left after generation and the logprob launches
        "logprobs_s": t3 - t1,
        "train_s": t4 - t3,
        "weight_sync_s": t5 - t4,
        "weight_push_wait_s": push_wait_s,  # of weight_sync_s: waiting for a generation round to end
        "refit_s": refit_s,  # of weight_sync_s: gathering the weights and loading them into the engines
        "step_s": t5 - t0,
    }
    perf_scalars = perf_metrics(
        cfg,
        policy.trained_lengths,
        t4 - t3,
        policy.perf_stats(),
        flops,
        policy.refit_bytes,
        policy.trained_responses,
    )
    metrics = step_metrics(
        cfg, rollouts, reward, advantages, overlong, train_metrics, timing, perf_scalars, batch.metrics()
    )
    metrics.update(reward_model.step_metrics(rollouts))
    metrics.update(judge.step_metrics(rollouts))
    metrics.update(normalization_metrics(rollouts))
    rows = rollout_rows(
        step, rollouts, [s.advantage for s in samples], batch.versions, overlong, state.turns.tokenizer
    )
    for row, result in zip(rows, results):
        if result.rm_score is not None:
            row["rm_score"] = result.rm_score  # raw, before reward_model.normalize and clip
    return metrics, rows, batch


class EngineParity:
    """The engines' logprobs against the policy's on the tokens they sampled, as a gate and not only a metric:
    a head transform the engine applies and the policy does not (or the other way round), weights loaded in the
    wrong layout, a refit that left a layer out all show here first, while the run would otherwise train on.

    Checked twice per process, each on a batch sampled by the weights the policy had when it recomputed the
    logprobs (staleness 0): the first step (the engines' own load of the checkpoint) and the first step sampled
    by refitted weights (the refit). An asynchronous run whose batches are never on-policy is checked at its
    first step only. Each check prints one ``self-check:`` line; a gap over ``bound`` stops the run
    (:class:`GenerationError`, one line: the model, the check, the fix)."""

    def __init__(self, bound: float | None, model: str):
        self.bound, self.model = bound, model
        self.pending = {"load", "refit"}

    def check(
        self, step: int, batch: RolloutBatch, gap: float, tokens: float = 1.0, routing: float | None = None
    ) -> None:
        """``gap``: the mean over the ``tokens`` sampled tokens the step trained on; a step that trained on none
        (every group skipped) measured nothing, and the check waits for one that did. ``routing``: an MoE
        engine's routes against the policy's own routing (the share of decisions that differ), on the same
        steps: on-policy they differ by rounding near ties (a few percent), and above :data:`ROUTING_BOUND`
        the routes are not laid out as the policy's layers and experts, and replaying them would train every
        token through experts nobody chose."""
        if self.bound is None or not self.pending or any(batch.staleness()) or tokens <= 0:
            return
        what = "refit" if min(batch.versions) >= 1 else "load"
        if what not in self.pending:
            return
        self.pending.discard(what)
        if what == "refit":
            self.pending.clear()  # the load was checked, or the run resumed past it
        where = "after the engines' first refit" if what == "refit" else "as the engines loaded the model"
        if gap > self.bound:
            raise GenerationError(
                f"model={self.model}: at step {step} the engines' logprobs of their own samples are {gap:.3f} "
                f"nats/token from the policy's {where} (bound {self.bound}): they do not sample the policy being "
                "trained (a head transform, a weight layout or a refit differs); check generation.backend and "
                "generation.quantization, or set generation.max_logprob_gap=null to train on at your own risk"
            )
        print(
            f"kuberl: self-check: engine logprobs match the policy's {where} (step {step}): "
            f"{gap:.4f} nats/token, bound {self.bound}",
            flush=True,
        )
        if routing is None:
            return
        if not routing <= ROUTING_BOUND:  # not: a NaN fails too
            raise GenerationError(
                f"model={self.model}: at step {step} the engines' routes differ from the policy's own routing on "
                f"{routing:.0%} of the decisions {where} (bound {ROUTING_BOUND:.0%}): they are not laid out as the "
                "policy's layers and experts (a vLLM whose routed_experts changed?); set "
                "policy.moe.router_replay=false (and vllm_kwargs.enable_return_routed_experts=false) to train "
                "without them"
            )
        print(
            f"kuberl: self-check: engine routes match the policy's routing {where} (step {step}): "
            f"{routing:.1%} of decisions differ, bound {ROUTING_BOUND:.0%}",
            flush=True,
        )


# The share of an MoE engine's routing decisions, on its own samples and the weights it sampled with, that may
# differ from the policy's own routing (EngineParity): near-ties break otherwise in another kernel and precision
# (0 on the CPU tests' float32 engines), where routes read in the wrong layout differ on most.
ROUTING_BOUND = 0.5


def model_flops(cfg: Config, policy: PolicyGroup) -> perf.ModelFlops | None:
    """The policy's FLOPs per token for MFU, from its shape (``trainer.tools.plan``, the model on the meta device);
    None, said once, for a model whose shape cannot be read that way."""
    from trainer.models.shape import model_shape

    try:
        return perf.ModelFlops.from_shape(model_shape(policy.model_path, cfg.model.trust_remote_code))
    except Exception as e:  # an architecture the plan cannot count: the run trains, without perf/mfu
        print(
            f"kuberl: perf: no perf/mfu for model.name={cfg.model.name}: its shape cannot be read "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})",
            flush=True,
        )
        return None


def validate(
    cfg: Config, step: int, examples: list[dict], generator: Generator, rewards: RewardRunner
) -> dict:
    """Greedy pass over the validation prompts; accuracy is the share scored fully correct. The caller
    holds the engines (``stream.engines()``), so no weights arrive in the middle."""
    t0 = time.monotonic()
    with rewards.validating():  # normalised by the training rewards' statistics, never added to them
        pending = rollout.generate(
            generator, rewards, examples, 1, sampling_params(cfg, cfg.seed, greedy=True)
        )
        results = rollout.rewards_of(rollout.finish(pending, rewards))
    return {
        "val/accuracy": sum(r.correct for r in results) / len(results),
        "val/reward_mean": sum(r.total for r in results) / len(results),
        "timing/validation_s": time.monotonic() - t0,
    }


def _val_rewards(stream: SyncRollouts | AsyncRollouts, state: LoopState) -> RewardRunner:
    """The runner validation scores with, holding the training rewards' running statistics as they stand (the
    async stream's is a runner of its own: the producer thread owns the training one)."""
    if stream.val_rewards is not state.rewards:
        stream.val_rewards.load_state_dict(state.rewards.state_dict())
    return stream.val_rewards


def run(cfg: Config, state: LoopState) -> list[dict[str, float]]:
    """The loop. ``state`` holds the workers, data and logger; ``state.progress`` is where it stands."""
    history: list[dict[str, float]] = []
    log: RunLogger = state.logger
    g = cfg.grpo
    start = state.progress.step
    stream = make_rollout_stream(cfg, state, lambda step: sampling_params(cfg, cfg.seed + step))
    flops = model_flops(cfg, state.policy)
    parity = EngineParity(cfg.generation.max_logprob_gap, cfg.model.name)
    try:
        if state.val_examples and g.val_at_start and start == 0:
            with stream.engines():
                before = validate(cfg, 0, state.val_examples, state.generator, _val_rewards(stream, state))
            log.scalars(0, before)
            print(
                f"step    0/{g.max_num_steps} | val {before['val/accuracy']:.3f} (before training)",
                flush=True,
            )
        for step in range(start + 1, g.max_num_steps + 1):
            metrics, rows, batch = grpo_step(cfg, step, stream, state, flops, parity)
            if step == start + 1:
                print(
                    f"kuberl: perf: MFU against {state.policy.perf_stats()[0]['peak_source']} per policy rank",
                    flush=True,
                )
            if state.val_examples and g.val_period and step % g.val_period == 0:
                with stream.engines():
                    metrics.update(
                        validate(cfg, step, state.val_examples, state.generator, _val_rewards(stream, state))
                    )
            log.scalars(step, metrics)
            log.gauges.step(step, metrics)  # the chart's alerts and dashboard (trainer.tracking.ray_gauges)
            log.rollouts(step, rows)
            log.console(step, metrics)
            for row in rows[: cfg.logger.num_console_samples]:
                print(f"         sample: {sample_line(row)}", flush=True)
            history.append({"step": step, **metrics})
            state.after_step(step, metrics, batch.loader_state, batch.reward_state)
    finally:
        stream.close()  # batches generated ahead are dropped: a resumed run generates them again
    return history
