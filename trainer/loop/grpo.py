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

Each step also says how fast it ran (``perf/``, :func:`perf_metrics`): generated and trained tokens/s, the
training's model FLOPs utilisation (:mod:`trainer.perf`) and each policy rank's peak memory.

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
from trainer.generation.placement import Generator
from trainer.logger import RunLogger
from trainer.loop import rollout
from trainer.loop.rollout_stream import AsyncRollouts, RolloutBatch, SyncRollouts, make_rollout_stream
from trainer.loop.state import LoopState
from trainer.policy.batch import Sample
from trainer.policy.group import PolicyGroup
from trainer.rewards.runner import RewardRunner

# What each importance-sampling mode flags, as a share of the response tokens trained on.
IS_METRICS = {
    "tis": "train/tis_truncated_frac",        # ratio above tis_cap, truncated
    "mis": "train/mis_masked_frac",           # ratio outside [mis_low, mis_high], dropped
    "seq_mis": "train/seq_mis_masked_frac",   # tokens of sequences dropped on their geometric-mean ratio
}


def sampling_params(cfg: Config, seed: int, greedy: bool = False) -> SamplingParams:
    g = cfg.generation
    return SamplingParams(
        max_new_tokens=g.max_new_tokens,
        temperature=0.0 if greedy else g.temperature,
        top_p=g.top_p,
        top_k=g.top_k,
        stop_strings=list(g.stop_strings),
        seed=seed,
    )


def grpo_step(
    cfg: Config, step: int, stream: SyncRollouts | AsyncRollouts, state: LoopState, flops: perf.ModelFlops | None = None
) -> tuple[dict[str, float], list[dict], RolloutBatch]:
    policy, rewards = state.policy, state.rewards
    g, loss_cfg = cfg.grpo, cfg.grpo.loss
    t0 = time.monotonic()
    batch = stream.next(step)
    pending = batch.pending
    samples = [
        Sample(r.prompt_ids, r.tokens, response_mask=r.response_mask, gen_logprobs=r.logprobs) for r in pending.rollouts
    ]

    # Logprob passes need only the tokens, so they run while the rewards are still being computed.
    t1 = time.monotonic()
    old = policy.compute_logprobs_async(samples) if g.num_minibatches > 1 else None
    ref = policy.compute_logprobs_async(samples, reference=True) if loss_cfg.reference_policy_kl_penalty > 0 else None
    rollouts = rollout.finish(pending, rewards)
    t2 = time.monotonic()
    for name, p in (("old_logprobs", old), ("ref_logprobs", ref)):
        if p is not None:
            for s, lp in zip(samples, PolicyGroup.gather_logprobs(p, len(samples))):
                setattr(s, name, lp)
    t3 = time.monotonic()
    # The last point where this step can be dropped whole: the weights are still the previous step's.
    state.preemption_point()

    reward = torch.tensor([r.reward.total for r in rollouts], dtype=torch.float32)  # (B,)
    shaped, overlong = reward, None
    if g.reward_shaping.overlong_buffer > 0:  # DAPO: the model's own tokens (multi-turn: all its turns)
        n_tokens = torch.tensor([r.model_tokens for r in rollouts], dtype=torch.float32)  # (B,)
        overlong = core_algos.overlong_penalty(
            n_tokens, cfg.generation.max_new_tokens, g.reward_shaping.overlong_buffer, g.reward_shaping.overlong_penalty
        )
        shaped = reward + overlong  # advantages only: train/reward_* and the jsonl reward stay the rewards' total
    estimator = "leave_one_out" if g.use_leave_one_out_baseline else "mean"
    advantages = core_algos.compute_advantages(
        shaped, g.num_generations_per_prompt, estimator=estimator, normalize_std=g.normalize_rewards,
        std=g.advantage.std,
    )
    for s, a in zip(samples, advantages.tolist()):
        s.advantage = a

    train_metrics = policy.train(samples)
    t4 = time.monotonic()
    push_wait_s = stream.push_weights(step)  # async: once the round in flight ends
    t5 = time.monotonic()

    lengths = torch.tensor([r.model_tokens for r in rollouts], dtype=torch.float32)  # the model's own tokens
    metrics = {
        "train/reward_mean": reward.mean().item(),
        "train/reward_min": reward.min().item(),
        "train/reward_max": reward.max().item(),
        "train/reward_std": reward.std().item() if len(reward) > 1 else 0.0,
        "train/accuracy": sum(r.reward.correct for r in rollouts) / len(rollouts),
        # no policy gradient (groups that all scored the same); not trained on with policy.skip_zero_advantage
        "train/zero_advantage_frac": (advantages == 0).float().mean().item(),
        "train/mean_generation_length": lengths.mean().item(),
        "train/truncated_frac": sum(r.completion.finish_reason == "length" for r in rollouts) / len(rollouts),
        "train/kl": train_metrics.get("kl", 0.0),
        "train/ppo_kl": train_metrics["ppo_kl"],
        "train/pg_clipfrac": train_metrics["pg_clipfrac"],
        "train/entropy": train_metrics.get("entropy", 0.0),
        "train/grad_norm": train_metrics["grad_norm"],
        # The engine against the policy's own recomputation, on the sampled tokens (see core_algos).
        "train/gen_logprob_abs_diff": train_metrics["gen_logprob_abs_diff"],
        "train/gen_train_kl": train_metrics["gen_train_kl"],
        "train/is_flagged_frac": train_metrics["is_flagged"],  # whatever the mode; and under its own name:
        IS_METRICS.get(loss_cfg.importance_sampling, "train/is_flagged_frac"): train_metrics["is_flagged"],
        "train/loss": train_metrics["loss"],
        "train/lr": train_metrics["lr"],
        "timing/generation_s": batch.generation_s,
        "timing/reward_s": t2 - t1,  # only the wait left after generation and the logprob launches
        "timing/logprobs_s": t3 - t1,
        "timing/train_s": t4 - t3,
        "timing/weight_sync_s": t5 - t4,
        "timing/weight_push_wait_s": push_wait_s,  # of weight_sync_s: waiting for a generation round to end
        "timing/step_s": t5 - t0,
        "perf/generated_tokens_per_s": lengths.sum().item() / max(batch.generation_s, 1e-9),
        **perf_metrics(cfg, policy.trained_lengths, t4 - t3, policy.perf_stats(), flops),
        **batch.metrics(),
    }
    if g.max_rollout_turns > 1:
        metrics["train/mean_turns"] = sum(r.turns for r in rollouts) / len(rollouts)
    for name in rollouts[0].reward.scores:
        metrics[f"train/reward/{name}"] = sum(r.reward.scores.get(name, 0.0) for r in rollouts) / len(rollouts)
    rows = [
        {
            "step": step,
            "id": r.example.get("id"),
            "prompt": r.example["messages"][-1]["content"],
            "response": r.completion.text,  # the final attempt, which the reward judged
            "transcript": state.turns.tokenizer.decode(r.tokens) if r.turns > 1 else None,
            "ground_truth": r.example["ground_truth"],
            "rewards": r.reward.scores,
            "reward": r.reward.total,
            "extracted_answer": r.reward.answer,  # what the (first) reward judged: None when it found none
            "answer_note": r.reward.answer_note,  # where it came from, or why there is none or it is wrong
            "correct": r.reward.correct,
            "advantage": s.advantage,
            "generation_length": r.model_tokens,
            "finish_reason": r.completion.finish_reason,
            "turns": r.turns,
            "policy_version": version,  # the weights that generated it: step - 1 - version steps stale
        }
        for r, s, version in zip(rollouts, samples, batch.versions)
    ]
    if overlong is not None:  # the jsonl keeps reward as the reward functions' total; the penalty is its own field
        metrics["train/overlong_penalty_mean"] = overlong.mean().item()
        for row, penalty in zip(rows, overlong.tolist()):
            row["overlong_penalty"] = penalty
    return metrics, rows, batch


def model_flops(cfg: Config, policy: PolicyGroup) -> perf.ModelFlops | None:
    """The policy's FLOPs per token for MFU, from its shape (``trainer.plan``, the model on the meta device);
    None, said once, for a model whose shape cannot be read that way."""
    from trainer.models.shape import model_shape

    try:
        return perf.ModelFlops.from_shape(model_shape(policy.model_path, cfg.model.trust_remote_code))
    except Exception as e:  # an architecture the plan cannot count: the run trains, without perf/mfu
        print(f"kuberl: perf: no perf/mfu for model.name={cfg.model.name}: its shape cannot be read "
              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})", flush=True)
        return None


def perf_metrics(
    cfg: Config, trained_lengths: list[int], train_s: float, ranks: list[dict], flops: perf.ModelFlops | None
) -> dict[str, float]:
    """Trained tokens/s, MFU of the policy's training pass and each rank's peak memory; ``trained_lengths``:
    prompt + response tokens of each sample trained on, ``ranks``: :meth:`PolicyGroup.perf_stats`."""
    tokens = sum(trained_lengths)
    out = {"perf/trained_tokens_per_s": tokens / max(train_s, 1e-9)}
    if flops is not None:
        done = flops.training(trained_lengths, frozen_base=cfg.policy.lora.enabled)
        out["perf/mfu"] = perf.mfu(done, train_s, sum(r["peak_flops"] for r in ranks))
        out["perf/train_tflops_per_s_per_rank"] = done / max(train_s, 1e-9) / len(ranks) / 1e12
    memory = [r["peak_memory_bytes"] / 2**30 for r in ranks]
    out.update({f"perf/peak_memory_gib/rank_{r}": gib for r, gib in enumerate(memory)})
    out["perf/peak_memory_gib_max"] = max(memory)
    return out


def sample_line(row: dict) -> str:
    """A rollout for the console: the response, its reward and the answer the reward paid for (or
    why there was none), e.g. ``'13 + 7 = \\boxed{20}' -> reward 1.00, answer '20' (\\boxed{})``."""
    line = f"{row['response'][:160]!r} -> reward {row['reward']:.2f}"
    note = f" ({row['answer_note']})" if row.get("answer_note") else ""
    if row.get("extracted_answer") is not None:
        return f"{line}, answer {row['extracted_answer'][:60]!r}{note}"
    return f"{line}, no answer{': ' + row['answer_note'] if row.get('answer_note') else ''}"


def validate(cfg: Config, step: int, examples: list[dict], generator: Generator, rewards: RewardRunner) -> dict:
    """Greedy pass over the validation prompts; accuracy is the share scored fully correct. The caller
    holds the engines (``stream.engines()``), so no weights arrive in the middle."""
    t0 = time.monotonic()
    pending = rollout.generate(generator, rewards, examples, 1, sampling_params(cfg, cfg.seed, greedy=True))
    results = rollout.finish(pending, rewards)
    return {
        "val/accuracy": sum(r.reward.correct for r in results) / len(results),
        "val/reward_mean": sum(r.reward.total for r in results) / len(results),
        "timing/validation_s": time.monotonic() - t0,
    }


def run(cfg: Config, state: LoopState) -> list[dict[str, float]]:
    """The loop. ``state`` holds the workers, data and logger; ``state.progress`` is where it stands."""
    history: list[dict[str, float]] = []
    log: RunLogger = state.logger
    g = cfg.grpo
    start = state.progress.step
    stream = make_rollout_stream(cfg, state, lambda step: sampling_params(cfg, cfg.seed + step))
    flops = model_flops(cfg, state.policy)
    try:
        if state.val_examples and g.val_at_start and start == 0:
            with stream.engines():
                before = validate(cfg, 0, state.val_examples, state.generator, stream.val_rewards)
            log.scalars(0, before)
            print(f"step    0/{g.max_num_steps} | val {before['val/accuracy']:.3f} (before training)", flush=True)
        for step in range(start + 1, g.max_num_steps + 1):
            metrics, rows, batch = grpo_step(cfg, step, stream, state, flops)
            if step == start + 1:
                print(f"kuberl: perf: MFU against {state.policy.perf_stats()[0]['peak_source']} per policy rank",
                      flush=True)
            if state.val_examples and g.val_period and step % g.val_period == 0:
                with stream.engines():
                    metrics.update(validate(cfg, step, state.val_examples, state.generator, stream.val_rewards))
            log.scalars(step, metrics)
            log.rollouts(step, rows)
            log.console(step, metrics)
            for row in rows[: cfg.logger.num_console_samples]:
                print(f"         sample: {sample_line(row)}", flush=True)
            history.append({"step": step, **metrics})
            state.after_step(step, metrics, batch.loader_state)
    finally:
        stream.close()  # batches generated ahead are dropped: a resumed run generates them again
    return history
