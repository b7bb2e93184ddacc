"""A tiny mixture of experts (``builtin:tiny?experts=4``: a Qwen3-MoE, every layer routing each token to 2 of 4
experts) learns ``experiment=tiny``'s sums end to end, on either engine, and reports its routing.

- hf engine, router replay on: the engine returns each sample's routes, the start-up check replays the policy's
  own routes exactly, every position the engine routed is replayed in training (train/routing_replayed_frac 1),
  the engine-trainer mismatch is reported, and the reward rises;
- vLLM colocated (its CPU build returns no routes): the reward rises, the routers' own statistics are reported
  and the routing mismatch, which nothing measured, is absent rather than 0.
"""

from __future__ import annotations

from tests.tiny_run import assert_learned, needs_vllm, read_scalars, train_tiny

MOE = "model.name='builtin:tiny?experts=4'"


def test_should_learn_and_replay_every_route_when_the_hf_engine_samples_a_tiny_moe(trainer_env, tmp_path):
    stdout, run_dir = train_tiny(trainer_env, tmp_path, MOE, "policy.moe.router_replay=true")
    # The ranks' own self-check line reaches the driver's output through Ray's log forwarding, which a test
    # cannot wait on; it is tested where it runs (tests/policy/test_moe.py). The driver's route gate prints here.
    assert (
        "self-check: engine routes match the policy's routing as the engines loaded the model (step 1)"
        in stdout
    )
    scalars = read_scalars(run_dir)
    assert_learned(scalars["train/reward_mean"])
    assert set(scalars["train/routing_replayed_frac"]) == {1.0}
    assert all(0.0 <= v <= 1.0 for v in scalars["train/routing_mismatch"])
    assert all(1.0 <= v <= 2.0 for v in scalars["moe/load_imbalance"])  # top-2 of 4: at most 2x the mean
    assert all(0.0 < v <= 1.3863 for v in scalars["moe/router_entropy"])  # at most log 4


def test_should_learn_when_vllm_samples_a_tiny_moe_and_report_no_mismatch_it_did_not_measure(
    trainer_env, tmp_path
):
    needs_vllm()
    _, run_dir = train_tiny(trainer_env, tmp_path, MOE, "generation.backend=vllm")
    scalars = read_scalars(run_dir)
    assert_learned(scalars["train/reward_mean"])
    assert "moe/router_entropy" in scalars and "moe/load_imbalance" in scalars
    assert "train/routing_mismatch" not in scalars and "train/routing_replayed_frac" not in scalars


def test_should_replay_the_sampling_policys_routes_when_rollouts_are_a_step_stale(trainer_env, tmp_path):
    # Disaggregated and asynchronous: each step trains on samples drawn by the weights of the step before, whose
    # routers (at this learning rate) disagree with the trainer's on a large share of the decisions. The routes
    # are the sampler's, carried with its samples: replayed on every position it routed, the mismatch reported.
    _, run_dir = train_tiny(
        trainer_env, tmp_path, MOE, "policy.moe.router_replay=true", "generation.placement=disaggregated",
        "grpo.async.max_staleness=1", "grpo.max_num_steps=6", "cluster.cpu_workers_per_node=2",
    )  # fmt: skip
    scalars = read_scalars(run_dir)
    assert set(scalars["train/routing_replayed_frac"]) == {1.0}
    stale = [m for m, s in zip(scalars["train/routing_mismatch"], scalars["train/staleness_mean"]) if s > 0]
    assert stale and max(stale) > 0.05
