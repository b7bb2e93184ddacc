"""FSDP2 policy ranks on a real local Ray instance: data-parallel equivalence, logprobs, weight sync."""

from __future__ import annotations

import gc
import math

import pytest
import torch

from trainer.config import load
from trainer.generation.base import SamplingParams
from trainer.policy.batch import Sample

pytestmark = pytest.mark.slow


def _cfg(tiny_model_path: str, *extra: str):
    return load(
        [
            "experiment=tiny",
            f"model.name={tiny_model_path}",
            "grpo.num_prompts_per_step=2",
            "grpo.num_generations_per_prompt=4",
            "policy.micro_batch_size=2",
            *extra,
        ]
    )


def _samples(grouped: bool = False) -> list[Sample]:
    """8 samples; ``grouped``: as GRPO makes them, 2 prompts (of different lengths) x 4 responses."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 50, (5 + i % 3,), generator=g).tolist() for i in range(8)]
    out = []
    for i in range(8):
        prompt = prompts[i // 4 * 2] if grouped else prompts[i]
        response = torch.randint(4, 50, (2 + i % 4,), generator=g).tolist()
        out.append(Sample(prompt, response, advantage=float(i % 4) - 1.5))
    return out


@pytest.fixture(scope="module")
def groups(ray_local, tiny_model_path):
    from trainer.policy.group import PolicyGroup

    made = {}

    def make(world: int, shared_prefix: bool = True, tag: str = "", *extra: str):
        key = (world, shared_prefix, tag, extra)
        if key not in made:
            cfg = _cfg(
                tiny_model_path,
                f"cluster.cpu_workers_per_node={world}",
                f"policy.shared_prefix={shared_prefix}",
                *extra,
            )
            made[key] = PolicyGroup(cfg, tiny_model_path, colocated_engine=True)
        return made[key]

    yield make
    for group in made.values():
        group.shutdown()


def test_should_match_single_rank_loss_and_grad_norm_when_batch_is_split_over_two_ranks(groups):
    metrics_one = groups(1).train(_samples(grouped=True))
    two = groups(2)
    metrics_two = two.train(_samples(grouped=True))
    assert metrics_two["loss"] == pytest.approx(metrics_one["loss"], rel=1e-4, abs=1e-6)
    assert metrics_two["grad_norm"] == pytest.approx(metrics_one["grad_norm"], rel=1e-4)
    assert metrics_one["grad_norm"] > 0


def test_should_match_single_rank_count_batches_when_two_ranks_fill_micro_batches_to_a_token_budget(groups):
    """Two ranks whose token budgets make different numbers of micro-batches (the ranks agree on the
    largest, the other splits): the same loss and gradient as one rank taking two samples at a time."""
    samples = _samples(grouped=True)  # 7..12 tokens: at 16 a rank, 4 + 4 samples, makes 4 and 3 micro-batches
    budget = (
        "policy.max_total_sequence_length=16",
        "policy.max_tokens_per_microbatch=16",
        "policy.logprob_max_tokens_per_microbatch=16",
    )
    metrics_one = groups(1, True, "fresh").train(samples)
    metrics_two = groups(2, True, "fresh", *budget).train(samples)
    assert metrics_two["loss"] == pytest.approx(metrics_one["loss"], rel=1e-4, abs=1e-6)
    assert metrics_two["grad_norm"] == pytest.approx(metrics_one["grad_norm"], rel=1e-4)


def test_should_equal_a_plain_forward_when_policy_computes_logprobs(groups, tiny_model_path):
    from transformers import AutoModelForCausalLM

    group = groups(2)
    samples = _samples() + _samples(grouped=True)
    state = group.run("full_state_dict")[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    model.load_state_dict(state, strict=False)
    got = group.gather_logprobs(group.compute_logprobs_async(samples), len(samples))
    for s, lp in zip(samples, got):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, :-1]
        expected = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0][len(s.prompt_ids) - 1 :]
        assert torch.allclose(torch.tensor(lp), expected, atol=1e-5)


def test_should_train_as_the_padded_layout_does_when_samples_share_prompts(groups):
    """Each prompt computed once with its KV shared by its 4 samples (FSDP2, two forwards before
    backward) gives the logprobs, loss, gradient and updated weights of the plain padded batch."""
    unpacked = "policy.sequence_packing=false"  # shared_prefix is a padded layout
    shared, padded = groups(2, True, "fresh", unpacked), groups(2, False, "fresh", unpacked)
    samples = _samples(grouped=True)
    lp_shared = shared.gather_logprobs(shared.compute_logprobs_async(samples), len(samples))
    lp_padded = padded.gather_logprobs(padded.compute_logprobs_async(samples), len(samples))
    for a, b in zip(lp_shared, lp_padded):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)
    m_shared, m_padded = shared.train(samples), padded.train(samples)
    assert m_shared["loss"] == pytest.approx(m_padded["loss"], rel=1e-4, abs=1e-6)
    assert m_shared["grad_norm"] == pytest.approx(m_padded["grad_norm"], rel=1e-4)
    w_shared, w_padded = shared.run("full_state_dict")[0], padded.run("full_state_dict")[0]
    for name, tensor in w_padded.items():
        # Adam turns float noise in near-zero gradients into up to lr-sized steps on a few elements
        # (which ones depends on the CPU's kernels: AVX2 and AVX-512 sum in different orders); a
        # missing gradient path (e.g. through the shared prompt's KV) moves most of them by ~lr (1e-2).
        moved = (w_shared[name] - tensor).abs()
        assert (moved > 1e-4).float().mean() < 0.01 and moved.max() < 1e-3, name


def test_should_give_engine_the_trained_weights_when_colocated_engine_is_refreshed(groups):
    from trainer.generation.placement import ColocatedGenerator

    group = groups(2)
    before = group.run("engine_state_dict")[0]
    group.train(_samples())
    ColocatedGenerator(group).update_weights()
    policy = group.run("full_state_dict")[0]
    for rank_engine in group.run("engine_state_dict"):
        for name, tensor in policy.items():
            assert torch.equal(rank_engine[name], tensor), name
    assert any(not torch.equal(before[n], policy[n]) for n in policy)


def test_should_train_as_when_gathering_afresh_when_the_synced_weights_are_kept_for_the_next_forward(
    ray_local, tiny_model_path
):
    """With reshard_after_forward=false the weights gathered for the engine after an optimizer step
    serve the next training forward, which gathers nothing. Two steps must give what re-gathering
    (reshard_after_forward=true) gives, and the engine must hold each step's new weights."""
    from trainer.generation.placement import ColocatedGenerator
    from trainer.policy.group import PolicyGroup

    made = []
    try:
        for keep in ("false", "true"):
            cfg = _cfg(
                tiny_model_path, "cluster.cpu_workers_per_node=2", f"policy.reshard_after_forward={keep}"
            )
            made.append(PolicyGroup(cfg, tiny_model_path, colocated_engine=True))
        kept, fresh = made
        for grouped in (True, False):
            m_kept, m_fresh = kept.train(_samples(grouped)), fresh.train(_samples(grouped))
            assert m_kept["grad_norm"] == pytest.approx(m_fresh["grad_norm"], rel=1e-5)
            for group in made:
                ColocatedGenerator(group).update_weights()
            policy = kept.run("full_state_dict")[0]
            for name, tensor in fresh.run("full_state_dict")[0].items():
                assert torch.allclose(policy[name], tensor, atol=1e-6), name
            for name, tensor in kept.run("engine_state_dict")[1].items():
                assert torch.equal(tensor, policy[name]), name
    finally:
        for group in made:
            group.shutdown()


def test_should_update_as_training_on_every_sample_does_when_zero_advantage_samples_are_skipped(
    ray_local, tiny_model_path
):
    """Skipping samples without a policy gradient keeps the update: one step where one prompt's group
    has a zero advantage, then one where all have (a zero gradient, but Adam's momentum still moves)."""
    from trainer.policy.group import PolicyGroup

    made = []
    try:
        for skip in ("true", "false"):
            cfg = _cfg(
                tiny_model_path,
                "cluster.cpu_workers_per_node=2",
                f"policy.skip_zero_advantage={skip}",
                "grpo.loss.reference_policy_kl_penalty=0",
            )
            made.append(PolicyGroup(cfg, tiny_model_path, colocated_engine=False))
        skipping, full = made
        for zero_groups in (1, 2):
            samples = _samples(grouped=True)
            for s in samples[: 4 * zero_groups]:
                s.advantage = 0.0
            before = skipping.run("full_state_dict")[0]
            m_skip, m_full = skipping.train(samples), full.train(samples)
            assert m_skip["loss"] == pytest.approx(m_full["loss"], rel=1e-5, abs=1e-7)
            assert m_skip["grad_norm"] == pytest.approx(m_full["grad_norm"], rel=1e-5, abs=1e-7)
            assert (m_full["grad_norm"] == 0) == (zero_groups == 2)
            w_skip, w_full = skipping.run("full_state_dict")[0], full.run("full_state_dict")[0]
            for name, tensor in w_full.items():
                # Sums in another order differ by float noise (at most 7e-6 here at lr 1e-2); a lost or
                # extra gradient moves most elements by about lr.
                assert torch.allclose(w_skip[name], tensor, atol=1e-4), name
            assert any(not torch.equal(before[n], w_skip[n]) for n in w_skip)  # it did step
    finally:
        for group in made:
            group.shutdown()


@pytest.mark.parametrize("engine_dtype", ["float32", "bfloat16"])
def test_should_broadcast_trained_weights_when_generation_is_disaggregated(
    ray_local, tiny_model_path, engine_dtype
):
    import ray

    from trainer.generation.placement import DisaggregatedGenerator
    from trainer.policy.group import PolicyGroup

    cfg = _cfg(
        tiny_model_path,
        "cluster.cpu_workers_per_node=2",
        "generation.placement=disaggregated",
        f"generation.dtype={engine_dtype}",
        # bfloat16: FSDP gathers in its mixed-precision param_dtype, and rank 0 sends those
        f"policy.param_dtype={'bfloat16' if engine_dtype == 'bfloat16' else 'null'}",
    )
    policy = PolicyGroup(cfg, tiny_model_path, colocated_engine=False)
    generator = DisaggregatedGenerator(cfg, tiny_model_path, policy)
    try:
        policy.train(_samples())
        generator.update_weights()
        expected = policy.run("full_state_dict")[0]
        got = ray.get(generator.workers[0].state_dict.remote())
        for name, tensor in expected.items():
            assert torch.equal(got[name], tensor.to(getattr(torch, engine_dtype))), name
        # And the engine samples from them: prompts in, completions with logprobs out.
        ((ref, idx),) = generator.submit([[4, 5, 6]], 3, SamplingParams(max_new_tokens=3, seed=1))
        completions = ray.get(ref)
        assert idx == [0] and len(completions[0]) == 3
        assert all(len(c.logprobs) == len(c.token_ids) > 0 for c in completions[0])
        # Each actor paused its collector while it imported, then froze the imports and turned it back on
        # (trainer.heap): on, with the imported objects (hundreds of thousands) frozen.
        for actor in policy.workers + generator.workers:
            enabled, frozen = ray.get(
                actor.__ray_call__.remote(lambda _: (gc.isenabled(), gc.get_freeze_count()))
            )
            assert enabled and frozen > 100_000, (enabled, frozen)
    finally:
        generator.shutdown()
        policy.shutdown()


def test_should_weight_the_policy_gradient_by_the_truncated_ratio_when_the_engine_was_off_policy(
    ray_local, tiny_model_path
):
    """Engine logprobs 5 nats below the policy's: every ratio pi/pi_engine = e^5 is truncated at
    tis_cap=2, so with importance_sampling=tis the policy gradient is exactly twice that without;
    the gap itself is reported whatever the correction."""
    from trainer.policy.group import PolicyGroup

    grads, metrics = {}, {}
    for mode in ("none", "tis"):
        cfg = _cfg(
            tiny_model_path,
            "cluster.cpu_workers_per_node=1",
            f"grpo.loss.importance_sampling={mode}",
            "policy.max_grad_norm=null",
        )
        group = PolicyGroup(cfg, tiny_model_path, colocated_engine=False)
        try:
            samples = _samples(grouped=True)
            own = group.gather_logprobs(group.compute_logprobs_async(samples), len(samples))
            for s, lp in zip(samples, own):
                s.gen_logprobs = [v - 5.0 for v in lp]
            metrics[mode] = group.train(samples)
            grads[mode] = metrics[mode]["grad_norm"]
        finally:
            group.shutdown()
    assert grads["tis"] == pytest.approx(2 * grads["none"], rel=1e-4)
    assert metrics["tis"]["is_flagged"] == pytest.approx(1.0) and metrics["none"]["is_flagged"] == 0.0
    for m in metrics.values():
        assert m["gen_logprob_abs_diff"] == pytest.approx(5.0, rel=1e-4)
        assert m["gen_train_kl"] == pytest.approx(math.exp(5.0) - 5.0 - 1.0, rel=1e-3)  # k3 of a 5-nat gap


def test_should_train_on_each_responses_mean_log_ratio_when_ratio_level_is_sequence(
    ray_local, tiny_model_path
):
    """GSPO through the worker: old logprobs that differ from the policy's by a ramp with zero mean
    over each response give every sequence the ratio 1, so the step is the on-policy one (token
    ratios of e^-0.3 .. e^0.3 would be clipped at 0.2). Padding and the prompt must not count in the
    mean (pad_batch puts old logprobs of 0 there). A shift of -0.1 nats on every token scales the
    whole policy gradient by e^0.1 (inside the clip range)."""
    from trainer.policy.group import PolicyGroup

    # lr 1e-30: Adam moves no float32 weight, so all three steps see the same policy.
    cfg = _cfg(
        tiny_model_path,
        "cluster.cpu_workers_per_node=1",
        "grpo.loss.ratio_level=sequence",
        "policy.max_grad_norm=null",
        "policy.learning_rate=1e-30",
        "policy.shared_prefix=false",
    )
    group = PolicyGroup(cfg, tiny_model_path, colocated_engine=False)
    try:
        samples = _samples(grouped=True)
        own = group.gather_logprobs(group.compute_logprobs_async(samples), len(samples))

        def step(shift):
            for s, lp in zip(samples, own):
                s.old_logprobs = [v + shift(t, len(lp)) for t, v in enumerate(lp)]
            return group.train(samples)

        on_policy = step(lambda t, n: 0.0)
        ramp = step(lambda t, n: 0.2 * (t - (n - 1) / 2))  # (n - 1) / 2 centres it on each response
        shifted = step(lambda t, n: -0.1)
    finally:
        group.shutdown()
    assert on_policy["grad_norm"] > 0 and on_policy["pg_clipfrac"] == 0.0
    assert ramp["grad_norm"] == pytest.approx(on_policy["grad_norm"], rel=1e-5)
    assert ramp["loss"] == pytest.approx(on_policy["loss"], rel=1e-5, abs=1e-7)
    assert ramp["pg_clipfrac"] == 0.0
    assert shifted["grad_norm"] == pytest.approx(math.exp(0.1) * on_policy["grad_norm"], rel=1e-5)


def test_should_clamp_the_per_token_kl_in_the_penalty_when_kl_clamp_is_set(ray_local, tiny_model_path):
    """Reference logprobs 5 nats above the policy's: k3 = e^5 - 6 = 142.4 on every token, clamped to
    kl_clamp=10; 1 nat above: e - 2 = 0.718, under the bound and left alone."""
    from trainer.policy.group import PolicyGroup

    cfg = _cfg(
        tiny_model_path,
        "cluster.cpu_workers_per_node=1",
        "grpo.loss.reference_policy_kl_penalty=0.1",
        "grpo.loss.kl_clamp=10",
    )
    group = PolicyGroup(cfg, tiny_model_path, colocated_engine=False)
    try:
        kl = {}
        for gap in (5.0, 1.0):
            samples = _samples(grouped=True)
            own = group.gather_logprobs(group.compute_logprobs_async(samples), len(samples))
            for s, lp in zip(samples, own):
                s.ref_logprobs = [v + gap for v in lp]
            kl[gap] = group.train(samples)["kl"]
    finally:
        group.shutdown()
    assert kl[5.0] == pytest.approx(10.0)
    assert kl[1.0] == pytest.approx(math.e - 2.0, rel=1e-3)


class _Other:
    """An actor of another class, whose creation imports the packages that pause for their own actors."""

    def __init__(self):
        import trainer.generation  # noqa: F401
        import trainer.policy  # noqa: F401

    def collector(self) -> tuple[bool, int]:
        return gc.isenabled(), gc.get_freeze_count()


def test_should_leave_the_collector_alone_when_another_actor_or_a_task_imports_the_packages(ray_local):
    """trainer.heap pauses the collector only in a policy rank or a generation actor being created."""
    import ray

    actor = ray.remote(num_cpus=0)(_Other).remote()
    try:
        assert ray.get(actor.collector.remote()) == (True, 0)
    finally:
        ray.kill(actor)

    @ray.remote(num_cpus=0)
    def task() -> tuple[bool, int]:
        import trainer.generation  # noqa: F401
        import trainer.policy  # noqa: F401

        return gc.isenabled(), gc.get_freeze_count()

    assert ray.get(task.remote()) == (True, 0)
