"""What one GRPO step reports: its scalars (``train/``, ``timing/``, ``perf/``) and its jsonl rows, one per
rollout, built from what the step already holds; and the console's sample line. The loop
(:mod:`trainer.loop.grpo`) times and runs the step; this module only reads what it produced.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer import perf
from trainer.config import Config

# The routing statistics the policy reports (trainer.models.moe) under the names the run logs.
ROUTING_METRICS = {
    "moe/routing_mismatch": "train/routing_mismatch",
    "moe/routing_replayed": "train/routing_replayed_frac",
}
# What each importance-sampling mode flags, as a share of the response tokens trained on.
IS_METRICS = {
    "tis": "train/tis_truncated_frac",  # ratio above tis_cap, truncated
    "mis": "train/mis_masked_frac",  # ratio outside [mis_low, mis_high], dropped
    "seq_mis": "train/seq_mis_masked_frac",  # tokens of sequences dropped on their geometric-mean ratio
}


def step_metrics(
    cfg: Config,
    rollouts: list,
    reward: torch.Tensor,
    advantages: torch.Tensor,
    overlong: torch.Tensor | None,
    train_metrics: dict[str, float],
    timing: dict[str, float],
    perf_scalars: dict[str, float],
    stream_metrics: dict[str, float],
) -> dict[str, float]:
    """The step's scalars. ``rollouts``: the scored rollouts (:class:`trainer.loop.rollout.Rollout`);
    ``reward`` (B,): their rewards' totals; ``advantages`` (B,); ``overlong`` (B,): DAPO's penalty, or None;
    ``train_metrics``: the policy's; ``timing``: the ``timing/`` scalars and the generation's seconds under
    ``generation_s``; ``perf_scalars``: :func:`perf_metrics`'; ``stream_metrics``: the rollout stream's."""
    loss_cfg = cfg.grpo.loss
    lengths = torch.tensor([r.model_tokens for r in rollouts], dtype=torch.float32)  # the model's own tokens
    generation_s = timing["generation_s"]
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
        "train/grad_norm": train_metrics["grad_norm"],
        "train/loss": train_metrics["loss"],
        "train/lr": train_metrics["lr"],
        **{f"timing/{k}": v for k, v in timing.items()},
        "perf/generated_tokens_per_s": lengths.sum().item() / max(generation_s, 1e-9),
        **perf_scalars,
        **stream_metrics,
    }
    # Means over the tokens trained on: absent on a step that trained on none (Objective.metrics), the entropy
    # also where policy.compute_entropy is off; the KL reads 0 where there is no penalty.
    if "ppo_kl" in train_metrics:
        metrics["train/kl"] = train_metrics.get("kl", 0.0)
    for key in ("ppo_kl", "pg_clipfrac", "entropy"):
        if key in train_metrics:
            metrics[f"train/{key}"] = train_metrics[key]
    if "gen_logprob_abs_diff" in train_metrics:  # absent on a step that trained on no engine-sampled token
        # The engine against the policy's own recomputation, on the sampled tokens (see core_algos).
        metrics["train/gen_logprob_abs_diff"] = train_metrics["gen_logprob_abs_diff"]
        metrics["train/gen_train_kl"] = train_metrics["gen_train_kl"]
        metrics["train/is_flagged_frac"] = train_metrics[
            "is_flagged"
        ]  # whatever the mode; and under its own name:
        metrics[IS_METRICS.get(loss_cfg.importance_sampling, "train/is_flagged_frac")] = train_metrics[
            "is_flagged"
        ]
    # An MoE policy's routing (trainer.models.moe.STAT_KEYS, moe/aux_loss): the engine-trainer agreement under
    # train/, the routers' own health under moe/; each absent where nothing measured it.
    for key, value in train_metrics.items():
        if key.startswith("moe/"):
            metrics[ROUTING_METRICS.get(key, key)] = value
    if cfg.grpo.max_rollout_turns > 1:
        metrics["train/mean_turns"] = sum(r.turns for r in rollouts) / len(rollouts)
        metrics["train/turns_mean"] = metrics["train/mean_turns"]
        # The environment's counters (trainer.envs.base.Step.info), summed over each episode's turns.
        counted = [getattr(r, "env_info", {}) for r in rollouts]
        if cfg.env.environment is not None:
            metrics["train/tool_calls_mean"] = sum(c.get("tool_calls", 0.0) for c in counted) / len(rollouts)
            metrics["train/tool_errors"] = sum(c.get("tool_errors", 0.0) for c in counted)
            metrics["train/tool_call_rate"] = sum(c.get("tool_calls", 0.0) > 0 for c in counted) / len(
                rollouts
            )
            metrics["timing/tool_s"] = sum(c.get("tool_s", 0.0) for c in counted)  # summed over samples
        # Any other environment's counters (skyrl_gym: errors, step_s), each summed over the step's samples.
        for key in sorted({k for c in counted for k in c} - {"tool_calls", "tool_errors", "tool_s"}):
            metrics[f"train/env/{key}"] = sum(c.get(key, 0.0) for c in counted)
    if cfg.env.verifiers.id:  # its rubric's metrics and each sample's turns, averaged over the step's samples
        counted = [getattr(r, "env_info", {}) for r in rollouts]
        for key in sorted({k for c in counted for k in c}):
            metrics[f"train/verifiers/{key}"] = sum(c.get(key, 0.0) for c in counted) / len(rollouts)
    for name in rollouts[0].reward.scores:
        metrics[f"train/reward/{name}"] = sum(r.reward.scores.get(name, 0.0) for r in rollouts) / len(
            rollouts
        )
    if overlong is not None:
        metrics["train/overlong_penalty_mean"] = overlong.mean().item()
    return metrics


def rollout_rows(
    step: int,
    rollouts: list,
    advantages: list[float],
    versions: list[int],
    overlong: torch.Tensor | None,
    tokenizer: Any,
) -> list[dict]:
    """One jsonl row per rollout: prompt, response, what the reward judged and paid, its advantage and the
    weights that generated it (``versions``); ``tokenizer`` decodes a multi-turn transcript."""
    rows = [
        {
            "step": step,
            "id": r.example.get("id"),
            "prompt": r.example["messages"][-1]["content"],
            "response": r.completion.text,  # the final attempt, which the reward judged
            "transcript": tokenizer.decode(r.tokens) if r.turns > 1 else None,
            "ground_truth": r.example["ground_truth"],
            "rewards": r.reward.scores,
            "reward": r.reward.total,
            "extracted_answer": r.reward.answer,  # what the (first) reward judged: None when it found none
            "answer_note": r.reward.answer_note,  # where it came from, or why there is none or it is wrong
            "correct": r.reward.correct,
            "advantage": advantage,
            "generation_length": r.model_tokens,
            "finish_reason": r.completion.finish_reason,
            "turns": r.turns,
            # a tool environment's counters for this episode (tool_calls, tool_errors, tool_s); {} otherwise
            "env_info": dict(getattr(r, "env_info", {})),
            "policy_version": version,  # the weights that generated it: step - 1 - version steps stale
        }
        for r, advantage, version in zip(rollouts, advantages, versions)
    ]
    if (
        overlong is not None
    ):  # the jsonl keeps reward as the reward functions' total; the penalty is its own field
        for row, penalty in zip(rows, overlong.tolist()):
            row["overlong_penalty"] = penalty
    return rows


def perf_metrics(
    cfg: Config,
    trained_lengths: list[int],
    train_s: float,
    ranks: list[dict],
    flops: perf.ModelFlops | None,
    refit_bytes: int | None = None,
    projected: int | None = None,
) -> dict[str, float]:
    """Trained tokens/s, MFU of the policy's training pass, each rank's peak memory and what a refit moves;
    ``trained_lengths``: prompt + response tokens of each sample trained on, ``ranks``:
    :meth:`PolicyGroup.perf_stats`, ``refit_bytes``: :attr:`PolicyGroup.refit_bytes`, ``projected``: the
    response tokens among them, the positions the LM head projects (:attr:`PolicyGroup.trained_responses`)."""
    tokens = sum(trained_lengths)
    out = {"perf/trained_tokens_per_s": tokens / max(train_s, 1e-9)}
    if refit_bytes is not None:  # into each engine: the trainable weights (frozen ones never travel)
        out["perf/refit_bytes"] = float(refit_bytes)
    if flops is not None:
        done = flops.training(trained_lengths, frozen_base=cfg.policy.lora.enabled, projected=projected)
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
