"""The memory plan's terms for the model-scored rewards (:mod:`trainer.tools.plan` counts them as it counts the
policy's): the reward model and the judge, each a :class:`~trainer.tools.plan.Scorer`. Each config section names
its planner here (``plans``, as it names its component: :mod:`trainer.components`), so the plan itself names no
reward; a planner returns None when the run does not use its reward.

- **the reward model** (``{name: reward_model}``): each replica's weights in ``reward_model.dtype`` and one
  forward pass without gradients of its largest batch (:func:`reward_model_pass`);
- **the judge** (``{name: llm_judge}``): each replica's weights in ``judge.dtype``, and on the hf engine the KV
  cache and prefill of one batch of ``judge.batch_size`` prompts of :func:`judge_sequence`'s length; a vLLM
  judge takes its ``gpu_memory_utilization`` share of a whole GPU, which must hold its weights and one such
  sequence (:func:`judge_share`).
"""

from __future__ import annotations

from trainer.tools.plan import (
    BYTES,
    Device,
    GiB,
    Scorer,
    Shape,
    block_activation_bytes,
    kv_bytes_per_token,
    model_shape,
    replica_devices,
    replica_dtype,
)

# The key a user changes when one of their terms is the largest.
REWARD_MODEL_ADVICE = {
    "reward model weights": "a smaller reward model (reward_model.name), or reward_model.dtype=bfloat16",
    "reward model activations": "a smaller reward_model.max_tokens_per_batch (or reward_model.max_length)",
    "reward model attention mask": "a smaller reward_model.max_tokens_per_batch (or reward_model.max_length)",
}
JUDGE_ADVICE = {
    "judge weights": "a smaller judge (judge.model), or judge.dtype=bfloat16",
    "judge engine (vLLM's share)": "judge.num_gpus=1 (vLLM takes its share of a whole GPU), or judge.backend=hf",
    "judge KV cache": "a smaller judge.batch_size, judge.max_response_tokens or judge.max_new_tokens",
    "judge KV cache (one sequence)": "a smaller judge.max_response_tokens or judge.max_new_tokens",
    "judge activations": "a smaller judge.batch_size or judge.max_response_tokens",
    "judge attention mask": "a smaller judge.batch_size or judge.max_response_tokens",
    "judge logits": "a smaller judge.batch_size",
}


def reward_model(cfg) -> Scorer | None:
    """The reward model's replicas as the plan counts them, when an entry of ``env.reward_functions`` names it."""
    from trainer.rewards.registry import REWARD_MODEL

    if not any(spec.name == REWARD_MODEL for spec in cfg.env.reward_functions):
        return None
    rm = cfg.reward_model
    return reward_model_scorer(cfg, model_shape(rm.name, rm.trust_remote_code, True, "reward_model.name"))


def judge(cfg) -> Scorer | None:
    """The judge's replicas as the plan counts them, when an entry of ``env.reward_functions`` names it."""
    from trainer.rewards.registry import LLM_JUDGE

    if not any(spec.name == LLM_JUDGE for spec in cfg.env.reward_functions):
        return None
    return judge_scorer(cfg, model_shape(cfg.judge.model, cfg.judge.trust_remote_code, key="judge.model"))


def reward_model_pass(cfg, shape: Shape) -> tuple[int, int]:
    """``(tokens, longest)`` of a replica's largest forward pass: one sample alone with
    ``reward_model.batch_invariant`` (the default), else a batch of at most
    ``reward_model.max_tokens_per_batch`` padded tokens, or one sample alone when it is longer. The
    longest sample it reads is a whole sequence of the policy (``policy.max_total_sequence_length``, in
    the policy's tokens; the reward model's chat template adds a few) up to ``reward_model.max_length``
    (by default the model's context): a longer one is not read but scored ``overlong_score``."""
    rm = cfg.reward_model
    limit = rm.max_length or shape.context or cfg.policy.max_total_sequence_length
    longest = min(cfg.policy.max_total_sequence_length, limit)
    return (longest if rm.batch_invariant else max(rm.max_tokens_per_batch, longest)), longest


def reward_model_terms(cfg, shape: Shape, gpu: bool) -> dict[str, float]:
    """Bytes one replica holds at its peak: its weights, and one forward pass without gradients, where
    each block's intermediates are freed as the next block runs (:func:`block_activation_bytes` of one
    block bounds them), beside the residual stream and the (batch, 1, T, T) boolean mask that SDPA gets
    for a padded batch. The score head reads the last position: no logits over a vocabulary."""
    dtype = BYTES[replica_dtype(cfg.reward_model.dtype, gpu)]
    tokens, longest = reward_model_pass(cfg, shape)
    return {
        "reward model weights": shape.params * dtype,
        "reward model activations": block_activation_bytes(shape, tokens, dtype)
        + tokens * shape.hidden * dtype,
        "reward model attention mask": tokens * longest,
    }


def reward_model_scorer(cfg, shape: Shape) -> Scorer:
    tokens, longest = reward_model_pass(cfg, shape)
    return Scorer(
        "reward model",
        "reward_model",
        shape,
        lambda capacity: reward_model_terms(cfg, shape, gpu=capacity is not None),
        f"its largest forward pass: {tokens} tokens, samples up to {longest} tokens",
        kind="a score head",
        advice=REWARD_MODEL_ADVICE,
    )


def judge_sequence(cfg, shape: Shape) -> tuple[int, int]:
    """``(prompt, total)`` tokens of the judge's longest sequence: ``judge.template`` (its UTF-8 bytes, each
    ``{nonce}`` as the code it renders: a byte-level tokenizer writes no more tokens than that; the chat template and a short reference add a few),
    the question (the policy's prompt, at most ``policy.max_total_sequence_length - generation.max_new_tokens``
    of the policy's tokens) and a response of at most ``judge.max_response_tokens`` (a longer one is not judged),
    then the judge's own ``judge.max_new_tokens``; within the judge's context."""
    from trainer.rewards.judge import NONCE_HEX

    j = cfg.judge
    question = max(0, cfg.policy.max_total_sequence_length - cfg.generation.max_new_tokens)
    template = len(j.template.encode()) + j.template.count("{nonce}") * (NONCE_HEX - len("{nonce}"))
    prompt = template + question + j.max_response_tokens
    total = prompt + j.max_new_tokens
    if shape.context:
        total = min(total, shape.context)
        prompt = min(prompt, total)
    return prompt, total


def judge_utilization(cfg) -> float:
    """The share of its GPU a vLLM judge replica takes (its engine: :func:`trainer.generation.judge.generation_config`)."""
    from trainer.generation.judge import generation_config
    from trainer.generation.vllm_engine import resolve_gpu_memory_utilization

    # the share does not depend on the dtype; a judge's engine never shares its GPU with a policy rank
    return resolve_gpu_memory_utilization(generation_config(cfg.judge, "bfloat16"), colocated=False)


def judge_terms(cfg, shape: Shape, capacity: float | None) -> dict[str, float]:
    """Bytes one judge replica holds at its peak, on a GPU of ``capacity`` (None: in host memory). A vLLM
    engine on a GPU takes its ``gpu_memory_utilization`` share, whatever the judge (:func:`judge_share` says
    what the share must hold); on CPU, its weights and its KV cache space
    (:data:`trainer.generation.vllm_cpu.CPU_KV_CACHE_GIB`). The hf engine (:mod:`trainer.generation.hf`):
    its weights, the KV cache of one batch (``judge.batch_size`` sequences of :func:`judge_sequence`'s
    length), and the prefill of that batch, its largest pass: one block's working set, the residual stream,
    the padded batch's boolean attention mask, and the float32 logits of its last positions."""
    j = cfg.judge
    dtype = BYTES[replica_dtype(j.dtype, capacity is not None)]
    weights = shape.params * dtype
    if j.backend == "vllm":
        if capacity is not None:
            return {"judge engine (vLLM's share)": judge_utilization(cfg) * capacity}
        from trainer.generation.vllm_cpu import CPU_KV_CACHE_GIB

        return {"judge weights": weights, "judge KV cache": CPU_KV_CACHE_GIB * GiB}
    prompt, total = judge_sequence(cfg, shape)
    batch = j.batch_size
    return {
        "judge weights": weights,
        "judge KV cache": batch * total * kv_bytes_per_token(shape, dtype, 1),
        "judge activations": block_activation_bytes(shape, batch * prompt, dtype) + batch * prompt * shape.hidden * dtype,
        "judge attention mask": batch * prompt * prompt,
        "judge logits": batch * shape.vocab * 4,
    }  # fmt: skip


def judge_share(cfg, shape: Shape, capacity: float) -> Device | None:
    """A vLLM judge's share of its GPU, as :func:`engine_device` plans the policy's engine: its weights in
    ``judge.dtype`` and the KV cache of one judge sequence (vLLM refuses to start without room for one); the
    rest of the share holds as many more as fit. None for the hf engine."""
    j = cfg.judge
    if j.backend != "vllm":
        return None
    util = judge_utilization(cfg)
    dtype = BYTES[replica_dtype(j.dtype, True)]
    _, total = judge_sequence(cfg, shape)
    weights = shape.params * dtype
    per_seq = kv_bytes_per_token(shape, dtype, 1) * total
    dev = Device(
        "judge engine's share",
        util * capacity,
        {"judge weights": weights, "judge KV cache (one sequence)": per_seq},
    )
    sequences = int((util * capacity - weights) // per_seq) if per_seq else 0
    dev.notes.append(
        f"KV cache for {max(0, sequences)} judge sequences of {total} tokens in the engine's {util:g} share "
        f"({util * capacity / GiB:.1f} GiB)"
    )
    return dev


def judge_scorer(cfg, shape: Shape) -> Scorer:
    prompt, total = judge_sequence(cfg, shape)
    j = cfg.judge
    batch = "as many as its share holds" if j.backend == "vllm" else f"judge.batch_size={j.batch_size}"
    return Scorer(
        "judge",
        "judge",
        shape,
        lambda capacity: judge_terms(cfg, shape, capacity),
        f"the {j.backend} engine; its prompts up to {prompt} tokens, {total} with its verdict, {batch} at once",
        lambda capacity: judge_share(cfg, shape, capacity),
        kind="a causal LM",
        advice=JUDGE_ADVICE,
    )


def reward_model_devices(
    cfg, shape: Shape, capacity: float, policy: list[Device]
) -> tuple[list[Device], Device]:
    """:func:`replica_devices` of the reward model."""
    return replica_devices(cfg, reward_model_scorer(cfg, shape), capacity, policy)
