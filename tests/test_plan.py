"""The memory plan (`make plan`): shapes from meta instantiation, the verdict per values file, the key
it names when a plan cannot fit, and the formula against a peak torch measured on this CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.cli import run_main
from trainer import config
from trainer.models.shape import known_config
from trainer.tools import plan, plan_rewards, submit

REPO = Path(__file__).resolve().parents[1]
TINY = "builtin:tiny?hidden_size=256&num_layers=4&num_heads=4&intermediate_size=1024"


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return run_main(plan.main, args, env)


@pytest.mark.parametrize(
    ("name", "billions"),
    [
        # the published sizes: Gemma 3 27B with its 0.4B vision tower, Qwen2.5 7B
        ("google/gemma-3-27b-it", 27.4),
        ("Qwen/Qwen2.5-Coder-7B-Instruct", 7.62),
        ("google/gemma-3-1b-it", 1.0),
        ("Qwen/Qwen3-30B-A3B", 30.5),  # every expert: what is stored, trained and refitted
    ],
)
def test_should_count_the_published_parameters_when_a_hub_model_is_planned_offline(name, billions) -> None:
    shape = plan.model_shape(name)
    assert shape.params / 1e9 == pytest.approx(billions, rel=0.01)
    assert 0 < shape.block_params < shape.params and shape.layers > 0


@pytest.mark.integration  # writes a model
def test_should_print_a_table_and_fit_when_every_values_file_is_planned() -> None:
    out = _cli()
    assert out.returncode == 0, out.stdout + out.stderr
    stems = [p.stem for p in sorted(submit.VALUES.glob("*.yaml"))]
    verdicts = [line for line in out.stdout.splitlines() if line.startswith("plan: ")]
    assert len(verdicts) == len(stems) and all(v.startswith("plan: fits") for v in verdicts), out.stdout
    for stem in stems:
        assert f"{stem} on " in out.stdout
    # the published set-up of gemma3-27b: 2 nodes x 8 H200 train, 8 more GPUs for vLLM at TP 8
    assert (
        "gemma3-27b-gsm8k-h200 on 8 x H200" in out.stdout and "generation GPU (engine's share)" in out.stdout
    )


def test_should_fit_a_7b_policy_at_10k_tokens_on_one_node_when_the_gpu_is_given() -> None:
    cfg = config.load(["experiment=codefu-7b-cpp"])
    result = plan.plan(cfg, "h200", "codefu-7b-cpp")
    assert cfg.policy.max_total_sequence_length >= 10240 and cfg.train_world_size == 8
    assert result.fits


def test_should_name_the_key_to_change_when_a_plan_does_not_fit() -> None:
    out = _cli(
        "gemma3-27b-gsm8k", "policy.activation_checkpointing=false", "policy.max_tokens_per_microbatch=16384"
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "does not fit" in out.stdout
    assert "largest term: activations; change: policy.activation_checkpointing=true" in out.stdout


def test_should_ask_for_the_gpu_in_one_line_when_a_gpu_experiment_has_no_values_file() -> None:
    out = _cli("codefu-7b-cpp")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == (
        "kuberl: plan: experiment codefu-7b-cpp runs on GPUs but has no values file with gpu.type: "
        "give GPU=h200 or GPU=b200"
    )


def test_should_count_the_larger_of_activations_and_gradients_when_they_do_not_peak_together() -> None:
    dev = plan.Device("x", 100.0, {"weights (sharded)": 10.0, "gradients (sharded)": 30.0, "activations": 20.0,
                                   "logits": 5.0}, either=plan.TRAINING_EITHER)  # fmt: skip
    assert dev.total == 10.0 + 30.0
    dev.terms["logits"] = 25.0
    assert dev.total == 10.0 + 45.0


@pytest.mark.slow
def test_should_plan_within_a_quarter_of_the_peak_torch_measures_when_one_rank_trains() -> None:
    out = subprocess.run([sys.executable, "bench/bench_plan.py", "--json", "--model", TINY], capture_output=True,
                         text=True, cwd=REPO, timeout=600)  # fmt: skip
    assert out.returncode in (0, 1), out.stderr[-2000:]
    cases = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert {c["checkpointing"] for c in cases} == {True, False}
    for c in cases:
        # activations dominate both cases here: the activation formula is what is checked
        assert c["terms"]["activations"] > c["terms"]["optimizer (AdamW, sharded)"], c
        assert 0.75 <= c["ratio"] <= 1.25, c


def test_should_count_state_for_the_adapters_only_when_the_policy_is_lora() -> None:
    full = config.load(["experiment=gemma3-27b-gsm8k"])
    lora = config.load(
        ["experiment=gemma3-27b-gsm8k", "policy.lora.rank=32", "grpo.loss.reference_policy_kl_penalty=0.01"]
    )
    shape = plan.model_shape(full.model.name)
    adapters = shape.adapter_params(32, list(lora.policy.lora.target_modules))
    # rank 32 on q/k/v/o and the MLP of 62 blocks: ~0.5% of the model (and the vision tower's projections)
    assert 0.001 < adapters / shape.params < 0.01
    full_terms, lora_terms = plan.training_terms(full, shape, 16), plan.training_terms(lora, shape, 16)
    assert lora_terms["optimizer (AdamW, sharded)"] == 2 * adapters * 4 / 16
    assert lora_terms["optimizer (AdamW, sharded)"] < full_terms["optimizer (AdamW, sharded)"] / 50
    assert "reference policy (sharded)" not in lora_terms  # the base with the adapters off


def test_should_plan_a_ranks_share_of_each_row_when_sequences_are_split_over_sequence_parallel_ranks() -> (
    None
):
    by_count = [
        "experiment=codefu-7b-cpp",
        "policy.max_tokens_per_microbatch=null",
        "policy.micro_batch_size=4",
    ]
    plain = plan.micro_batch(config.load([*by_count, "policy.sequence_parallel_size=1"]))
    split = plan.micro_batch(config.load([*by_count, "policy.sequence_parallel_size=4"]))
    assert split.tokens * 4 == plain.tokens == 4 * 10240 and split.logit_rows * 4 == plain.logit_rows
    # with a budget, the budget is what one rank holds, whatever the degree
    cfg = config.load(["experiment=codefu-7b-cpp"])
    assert cfg.policy.sequence_parallel_size == 4 and plan.micro_batch(cfg).tokens == 10240
    shape = plan.model_shape(cfg.model.name)
    extra = plan.block_activation_bytes(shape, 10240, 2, True) - plan.block_activation_bytes(shape, 10240, 2)
    assert extra == 10240 * 2 * (2 * shape.heads + 2 * shape.kv_heads) * shape.head_dim  # the other layout


def test_should_count_one_full_tensor_beside_the_shards_and_name_the_largest_transient_when_a_rank_loads() -> (
    None
):
    cfg = config.load(["experiment=lora-gemma3-27b-gsm8k"])
    result = plan.plan(cfg, "h200", "lora-gemma3-27b-gsm8k-h200")
    loading = next(d for d in result.devices if d.role == "training GPU, loading")
    shape = result.shape
    assert shape.largest[0].endswith("embed_tokens.weight")
    assert loading.terms[plan.LOADING_TERM] == shape.largest[1] * 2  # bf16, 2.6 GiB: not the 51 GiB model
    assert "colocated engine (awake)" in loading.terms and result.fits
    out = plan.render(result)
    assert "transients (a training GPU, for a moment): gathered units" in out
    assert (
        out.splitlines()[-1].startswith("plan: fits (training GPU, loading at")
        and "margin" in out.splitlines()[-1]
    )


def test_should_count_adapters_on_the_language_model_alone_when_the_model_has_a_vision_tower() -> None:
    shape = plan.model_shape("google/gemma-3-27b-it")
    # 62 decoder layers: the SigLIP tower's 27 layers also name q_proj/k_proj/v_proj, and get no adapter
    assert len(shape.linears["q_proj"]) == 62 and len(shape.linears["down_proj"]) == 62


def test_should_count_one_tile_of_logits_not_the_whole_micro_batchs_when_the_logprob_pass_is_planned() -> (
    None
):
    from trainer.algorithms import linear_logprobs

    cfg = config.load(["experiment=gemma3-27b-gsm8k"])
    shape = plan.model_shape(cfg.model.name)
    rows = plan.micro_batch(cfg).logit_rows
    term = plan.training_terms(cfg, shape, 16)["logits"]
    whole = rows * shape.vocab * 2  # the micro-batch's bf16 logits, which the tiled pass never holds
    # one GPU tile (every position, a block of the vocabulary), eager on a GPU: Gemma 3 caps no logits, the
    # run samples at temperature 1 and reports entropy, so the forward's float32 copies peak
    work = plan.head_work(cfg)
    assert work == {"transform": (), "scaled": False, "with_entropy": True, "fused": None}
    forward, backward = linear_logprobs.tile_bytes(2, (), False, True, False)
    assert (forward, backward) == (2 + 4 + 4 + 9, 2 + 4 + 2)  # logits, float32 copy, exp, entropy's 1 + 4 + 4
    tile = linear_logprobs.tile_elements(torch.device("cuda"))
    assert term == max(tile * forward, tile * backward + rows * shape.hidden * (4 + 2))
    assert term < whole / 3  # 304 MiB against 1 GiB of bf16 logits (and their float32 copy, 2 GiB)


@pytest.mark.parametrize(
    ("model_type", "keys", "transform"),
    [
        ("gemma2", {"final_logit_softcapping": 30.0}, (("softcap", 30.0),)),
        ("granite", {"logits_scaling": 8.0}, (("mul", 8.0),)),  # divided by: the same memory as a product
        ("llama", {}, ()),
    ],
)
def test_should_plan_the_heads_transform_when_the_models_config_names_one(
    model_type, keys, transform, tmp_path
) -> None:
    from transformers import AutoConfig

    AutoConfig.for_model(model_type, **keys).save_pretrained(tmp_path)
    cfg = config.load(["experiment=tiny", f"model.name={tmp_path}", "generation.temperature=0.7"])
    work = plan.head_work(cfg)
    assert work["transform"] == transform and work["scaled"] and work["fused"] is None


def _peak_bytes(fn) -> int:
    """The most bytes the CPU allocator held at once while ``fn()`` ran, beyond what it held before: the
    profiler's record of every allocation, inductor's buffers among them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    held = peak = 0
    for _, nbytes in events:
        held += nbytes
        peak = max(peak, held)
    return peak


# (dtype, transform, temperature, entropy, fused): the runs whose tiles peak differently
TILE_CASES = [
    (torch.bfloat16, (), 0.7, True, False),  # the CPU demo's head, eager: the forward's float32 copies
    (torch.bfloat16, (("softcap", 30.0),), 1.0, False, False),  # a softcap: the backward peaks
    (torch.float32, (("mul", 2.0), ("softcap", 30.0)), 0.7, False, False),
    (torch.float32, (), 1.0, True, False),
    (torch.bfloat16, (("softcap", 30.0),), 0.7, True, True),  # fused: the logits and their gradient
    (torch.float32, (), 1.0, True, True),
]
COMPILES = pytest.mark.integration  # a fused case compiles its tiles: that starts a C++ compiler


@pytest.mark.parametrize(
    ("dtype", "transform", "temperature", "entropy", "fused"),
    [pytest.param(*c, marks=[COMPILES] if c[4] else []) for c in TILE_CASES],
    ids=[f"{str(c[0])[6:]}-{'+'.join(op for op, _ in c[1]) or 'plain'}-T{c[2]}{'-entropy' if c[3] else ''}"
         f"-{'fused' if c[4] else 'eager'}" for c in TILE_CASES],
)  # fmt: skip
def test_should_plan_the_tiled_head_within_a_quarter_of_the_peak_torch_measures_when_logprobs_are_tiled(
    dtype, transform, temperature, entropy, fused, monkeypatch
) -> None:
    """The plan's logit term against the peak the CPU allocator reaches in the tiled head's forward and in
    its backward (less the weight's gradient, which the plan counts among the gradients), on a CPU tile of
    1024 positions x 512 vocabulary entries."""
    import types

    from trainer.algorithms import linear_logprobs
    from trainer.policy import forward as policy_forward

    monkeypatch.setattr(
        policy_forward, "TILE_ABOVE_BYTES", 0
    )  # the head here is small; its tiles are checked
    rows, hidden_size, vocab = 1024, 64, 8192
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, hidden_size, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=g) * 0.2).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (rows,), generator=g)
    held: dict[str, torch.Tensor] = {}

    def forward() -> None:
        held["lp"] = linear_logprobs.linear_logprobs(hidden, weight, None, labels, temperature=temperature,
                                                     transform=transform, with_entropy=entropy, fused=fused)[0]  # fmt: skip

    def backward() -> None:
        torch.autograd.grad(held["lp"].sum(), [hidden, weight])

    forward()
    backward()  # compiled, where fused, before anything is measured
    forward()
    measured_forward = _peak_bytes(forward)
    measured_backward = _peak_bytes(backward) - vocab * hidden_size * hidden.element_size()
    measured = max(measured_forward, measured_backward)
    shape = types.SimpleNamespace(vocab=vocab, hidden=hidden_size)
    planned = plan.logit_bytes(shape, rows, hidden.element_size(), gpu=False, transform=transform,  # type: ignore[arg-type]
                               scaled=temperature != 1.0, with_entropy=entropy, fused=fused)  # fmt: skip
    assert linear_logprobs.tiles(rows, vocab, linear_logprobs.tile_elements(hidden.device)) == (1024, 512)
    print(f"planned/measured {planned / measured:.3f}")
    assert 0.75 <= planned / measured <= 1.25, (planned, measured_forward, measured_backward)


# ----- a mixture of experts: Qwen3-30B-A3B ------------------------------------------------------------

MOE = "Qwen/Qwen3-30B-A3B"
MOE_VALUES = ["qwen3-30b-a3b-math-h200", "qwen3-30b-a3b-math-b200"]


def test_should_count_the_published_active_parameters_when_qwen3_30b_a3b_is_planned() -> None:
    """Qwen's model card: 30.5B parameters, 3.3B activated. Active: the attention, the router and 8 of the
    128 experts of each of the 48 layers, the embeddings and the LM head."""
    shape = plan.model_shape(MOE)
    assert shape.moe is not None and (shape.moe.experts, shape.moe.top_k, shape.moe.layers) == (128, 8, 48)
    assert plan.active_params(shape) / 1e9 == pytest.approx(3.3, rel=0.02)
    expert = 3 * 2048 * 768  # gate, up, down of one expert
    assert shape.params - plan.active_params(shape) == 48 * (128 - 8) * expert
    assert shape.block_params > 128 * expert  # FSDP gathers a block with all its experts


@pytest.mark.parametrize("stem", MOE_VALUES)
def test_should_fit_and_size_state_refits_and_routes_on_every_expert_when_the_moe_preset_is_planned(
    stem,
) -> None:
    result = plan.plan_for(stem, [])
    assert result.fits, plan.render(result)
    cfg = config.load(["experiment=qwen3-30b-a3b-math"])
    assert cfg.policy.moe.router_replay and cfg.generation.backend == "vllm" and cfg.train_world_size == 8
    shape = result.shape
    train = next(d for d in result.devices if d.role == "training GPU")
    # float32 master weights, gradients and both AdamW moments of all 30.5B parameters, over 8 ranks
    assert train.terms["optimizer (AdamW, sharded)"] == 2 * shape.params * 4 / 8
    assert train.terms["gradients (sharded)"] == shape.params * 4 / 8
    # the routes of one micro-batch of 8192 tokens: 48 layers x 8 ids, as int64 at most
    assert train.terms[plan.ROUTES_TERM] == 8192 * 48 * 8 * 8
    share = next(d for d in result.devices if d.role == "engine's share")
    assert share.terms[plan.CAPTURE_TERM] == 16384 * 48 * 8 * 4  # vLLM's int32 capture buffer
    out = plan.render(result)
    assert "3.35B of the 30.53B parameters active per token" in out
    # every weight in bf16 (56.87 GiB) to each of the 8 colocated engines, each step
    assert plan.refit_bytes(cfg, shape) == shape.params * 2
    assert f"{shape.params * 2 / 2**30:.2f} GiB of bfloat16 per engine, x 8 engines" in out
    # 32 prompts x 16 samples x 4096 tokens, 384 bytes each
    assert plan.step_tokens(cfg) == 32 * 16 * 4096
    assert "routes of 384 B per token (48 layers x top 8 x uint8)" in out and "carries 0.75 GiB" in out
    assert out.splitlines()[-1].startswith("plan: fits")


def test_should_size_the_routes_by_layers_top_k_and_the_width_of_an_expert_id() -> None:
    import dataclasses

    shape = plan.model_shape(MOE)
    assert plan.routes_bytes_per_token(shape) == 48 * 8  # uint8: 128 experts
    wide = dataclasses.replace(shape, moe=dataclasses.replace(shape.moe, experts=512))
    assert plan.routes_bytes_per_token(wide) == 48 * 8 * 2  # uint16 beyond 256 experts
    small = config.load(
        ["experiment=qwen3-30b-a3b-math", "generation.vllm_kwargs={max_num_batched_tokens: 8192}"]
    )
    assert plan.capture_bytes(small, shape) == 8192 * 48 * 8 * 4


def test_should_carry_no_routes_when_router_replay_is_off() -> None:
    cfg = config.load(["experiment=qwen3-30b-a3b-math", "policy.moe.router_replay=false"])
    result = plan.plan(cfg, "h200", "x")
    assert all(plan.ROUTES_TERM not in d.terms and plan.CAPTURE_TERM not in d.terms for d in result.devices)
    out = plan.render(result)
    assert "router replay" not in out and "active per token" in out and "x 8 engines" in out


def test_should_keep_each_routed_copys_intermediates_when_a_moe_block_is_planned() -> None:
    """Per token and MoE layer: 8 routed copies, each its input, gate and up, act(gate), their product and the
    expert's output (2 x 2048 + 4 x 768), and the router's 128 logits with their float32 softmax."""
    shape = plan.model_shape(MOE)
    assert plan.moe_mlp_per_token(shape) == 8 * (2 * 2048 + 4 * 768) + 3 * 128
    dense = plan.block_activation_bytes(plan.model_shape("Qwen/Qwen2.5-Coder-7B-Instruct"), 1, 1)
    assert (
        dense == 4 * 3584 + (3584 + 2 * 512) + (3584 + 512) + 3584 + 4 * 18944
    )  # unchanged for a dense model


# ----- the reward model -----------------------------------------------------------------------------

SKYWORK = "Skywork/Skywork-Reward-V2-Qwen3-0.6B"
RM_PRESET = "qwen2.5-coder-7b-code-rm-b200"


def test_should_count_a_score_head_in_place_of_the_lm_head_when_a_reward_model_is_shaped_offline() -> None:
    rm = plan.model_shape(SKYWORK, classifier=True)
    causal = plan.model_shape(SKYWORK)  # Qwen3-0.6B: its LM head is the tied embeddings
    assert rm.params == causal.params + rm.hidden  # the one-label score head, no bias
    assert rm.params / 1e9 == pytest.approx(0.596, rel=0.01) and rm.layers == 28 and rm.context == 40960
    assert rm.source.startswith("config table")
    known = known_config(SKYWORK)  # what a check at start can read before any download
    assert known.architectures == ["Qwen3ForSequenceClassification"] and known.num_labels == 1
    assert known_config("no/such-model") is None


def test_should_plan_the_reward_model_on_its_group_and_say_it_fits_beside_the_policy_when_the_preset_is_planned() -> (
    None
):
    result = plan.plan_for(RM_PRESET, [])
    cfg = config.load(["experiment=qwen2.5-coder-7b-code-rm"])
    own = next(d for d in result.devices if d.role.startswith("reward model GPU"))
    rm_shape = plan.model_shape(cfg.reward_model.name, classifier=True)
    assert own.terms["reward model weights"] == rm_shape.params * 2  # bfloat16
    assert own.capacity == plan.GPU_MEMORY["b200"] and own.fits and result.fits
    (beside,) = result.alternatives
    policy_peak = max(d.total for d in result.devices if d.role.startswith("training GPU"))
    assert beside.total == pytest.approx(policy_peak + own.total) and beside.fits
    out = plan.render(result)
    assert "reward model GPU (kuberl_reward_model):" in out and "reward model: 0.60B parameters" in out
    assert "alternative: training GPU with the reward model beside the policy: fits (" in out
    assert out.splitlines()[-1].startswith("plan: fits")


def test_should_take_the_larger_of_the_token_budget_and_the_longest_sample_when_a_replica_scores() -> None:
    shape = plan.model_shape(SKYWORK, classifier=True)
    # policy.max_total_sequence_length=6144; batch-invariant passes (the default) read one sample at a time
    assert plan_rewards.reward_model_pass(config.load(["experiment=qwen2.5-coder-7b-code-rm"]), shape) == (
        6144,
        6144,
    )
    base = ["experiment=qwen2.5-coder-7b-code-rm", "reward_model.batch_invariant=false"]
    assert plan_rewards.reward_model_pass(config.load(base), shape) == (8192, 6144)
    assert plan_rewards.reward_model_pass(
        config.load([*base, "reward_model.max_tokens_per_batch=1024"]), shape
    ) == (
        6144,
        6144,
    )  # a sample longer than the budget is scored alone
    assert plan_rewards.reward_model_pass(
        config.load([*base, "reward_model.max_tokens_per_batch=1024", "reward_model.max_length=2048"]), shape
    ) == (2048, 2048)  # longer ones are not read at all
    more = plan_rewards.reward_model_terms(
        config.load([*base, "reward_model.max_tokens_per_batch=65536"]), shape, True
    )
    less = plan_rewards.reward_model_terms(config.load(base), shape, True)
    assert more["reward model activations"] == pytest.approx(8 * less["reward model activations"])


def test_should_say_it_does_not_fit_beside_the_policy_but_keep_the_verdict_when_the_policy_fills_the_gpu() -> (
    None
):
    cfg = config.load(["experiment=qwen2.5-coder-7b-code-rm"])
    shape = plan.model_shape(cfg.reward_model.name, classifier=True)
    capacity = 8 * plan.GiB
    policy = [plan.Device("training GPU", capacity, {"weights (sharded)": 7.5 * plan.GiB})]
    own, beside = plan_rewards.reward_model_devices(cfg, shape, capacity, policy)
    assert own[0].fits and not beside.fits
    result = plan.Plan("x", "8 x GPU per node", plan.model_shape("Qwen/Qwen2.5-Coder-1.5B-Instruct"),
                       policy + own, alternatives=[beside],
                       scorers=[plan_rewards.reward_model_scorer(cfg, shape)])  # fmt: skip
    out = plan.render(result)
    assert (
        result.fits
        and "alternative: training GPU with the reward model beside the policy: does not fit" in out
    )
    assert "largest term: policy at its peak; change: the reward model on a worker group of its own" in out


def test_should_note_host_memory_and_no_gpu_when_the_reward_model_runs_on_cpu_replicas() -> None:
    cfg = config.load(
        ["experiment=qwen2.5-coder-7b-code-rm", "reward_model.num_gpus=0", "reward_model.replicas=2"]
    )
    result = plan.plan(cfg, "b200", "x")
    assert not any(d.role.startswith("reward model GPU") for d in result.devices) and result.fits
    assert any(n.startswith("reward model: 2 CPU replica(s) (reward_model.num_gpus=0)") for n in result.notes)
    assert len(result.alternatives) == 1  # beside the policy is still said


@pytest.mark.integration  # writes a model
def test_should_count_every_cpu_replica_on_the_machine_when_a_cpu_experiment_uses_a_reward_model() -> None:
    overrides = ["experiment=cpu-demo", "env.reward_functions=[{name: reward_model}]", f"reward_model.name='{TINY}'",
                 "reward_model.replicas=3", "reward_model.dtype=float32"]  # fmt: skip
    cfg = config.load(overrides)
    result = plan.plan(cfg, None, "cpu-demo")
    (node,) = result.devices
    shape = plan.model_shape(TINY, classifier=True)
    assert node.terms["reward model weights x 3 replicas"] == 3 * shape.params * 4
    assert "reward model activations x 3 replicas" in node.terms and not result.alternatives


# ----- the judge: its replicas counted as the reward model's -------------------------------------------

JUDGE = "Qwen/Qwen2.5-Coder-1.5B-Instruct"  # a causal LM in the plan's table: shaped offline


def _judge_cfg(*overrides: str):
    return config.load(["experiment=qwen2.5-coder-7b-code-rm", "env.reward_functions=[{name: llm_judge}]",
                        f"judge.model={JUDGE}", "judge.dtype=bfloat16", *overrides])  # fmt: skip


def test_should_count_a_gpu_judge_on_its_own_gpu_and_say_it_fits_when_one_batch_fits() -> None:
    result = plan.plan(_judge_cfg("judge.num_gpus=1", "judge.resource=kuberl_judge"), "b200", "x")
    own = next(d for d in result.devices if d.role.startswith("judge GPU"))
    shape = plan.model_shape(JUDGE)
    assert own.role == "judge GPU (kuberl_judge)" and own.capacity == plan.GPU_MEMORY["b200"]
    assert own.terms["judge weights"] == shape.params * 2  # judge.dtype=bfloat16
    cfg = _judge_cfg()
    prompt, total = plan_rewards.judge_sequence(cfg, shape)
    question = cfg.policy.max_total_sequence_length - cfg.generation.max_new_tokens  # the policy's prompt
    template = cfg.judge.template
    rendered = len(template.encode()) + template.count("{nonce}") * (
        16 - len("{nonce}")
    )  # each nonce's 16 hex digits
    assert prompt == rendered + question + 2048 and total == prompt + 256
    assert own.terms["judge KV cache"] == 64 * total * plan.kv_bytes_per_token(
        shape, 2, 1
    )  # judge.batch_size
    assert own.fits and result.fits and [x.shape for x in result.scorers] == [shape]
    out = plan.render(result)
    assert "  judge: 1.54B parameters (28 layers, hidden 1536, a causal LM;" in out
    assert "alternative: training GPU with the judge beside the policy:" in out
    assert out.splitlines()[-1].startswith("plan: fits")


def test_should_say_it_does_not_fit_and_name_the_judges_key_when_its_batch_does_not_fit() -> None:
    result = plan.plan(_judge_cfg("judge.num_gpus=1", "judge.batch_size=1024"), "b200", "x")
    assert not result.fits
    out = plan.render(result)
    assert out.splitlines()[-1].startswith("plan: does not fit (judge GPU (any GPU node) at ")
    assert (
        "largest term: judge activations; change: a smaller judge.batch_size or judge.max_response_tokens"
        in out
    )
    fewer = plan.plan(_judge_cfg("judge.num_gpus=1", "judge.batch_size=1024", "judge.max_response_tokens=64",
                                 "judge.max_new_tokens=16", "policy.max_total_sequence_length=4608"), "b200", "x")  # fmt: skip
    assert fewer.fits


def test_should_take_vllms_share_of_a_whole_gpu_when_the_judge_runs_on_vllm() -> None:
    cfg = _judge_cfg("judge.num_gpus=1", "judge.backend=vllm")
    result = plan.plan(cfg, "h200", "x")
    capacity = plan.GPU_MEMORY["h200"]
    own = next(d for d in result.devices if d.role.startswith("judge GPU"))
    share = next(d for d in result.devices if d.role == "judge engine's share")
    assert (
        own.terms["judge engine (vLLM's share)"]
        == plan_rewards.judge_utilization(cfg) * capacity
        == 0.9 * capacity
    )
    assert (
        share.capacity == 0.9 * capacity
        and share.terms["judge weights"] == plan.model_shape(JUDGE).params * 2
    )
    assert result.fits
    (beside,) = result.alternatives  # a 0.9 share beside the policy never fits
    assert not beside.fits
    half = plan.plan(_judge_cfg("judge.num_gpus=0.5", "judge.backend=vllm"), "h200", "x")
    assert not half.fits  # vLLM's share is of the whole GPU, not of the half Ray gives it
    assert "change: judge.num_gpus=1 (vLLM takes its share of a whole GPU)" in plan.render(half)


def test_should_note_host_memory_and_no_gpu_when_the_judge_runs_on_cpu_replicas() -> None:
    result = plan.plan(_judge_cfg("judge.num_gpus=0", "judge.replicas=2"), "b200", "x")
    assert not any(d.role.startswith("judge") for d in result.devices) and result.fits
    assert any(n.startswith("judge: 2 CPU replica(s) (judge.num_gpus=0)") for n in result.notes)
    assert len(result.alternatives) == 1  # beside the policy is still said


def test_should_count_the_reward_model_and_the_judge_each_when_a_run_uses_both() -> None:
    cfg = config.load(["experiment=qwen2.5-coder-7b-code-rm", f"judge.model={JUDGE}", "judge.num_gpus=1",
                       "env.reward_functions=[{name: reward_model}, {name: llm_judge}]"])  # fmt: skip
    result = plan.plan(cfg, "b200", "x")
    roles = [d.role for d in result.devices]
    assert "reward model GPU (kuberl_reward_model)" in roles and "judge GPU (any GPU node)" in roles
    assert len(result.alternatives) == 2 and [x.what for x in result.scorers] == ["reward model", "judge"]


@pytest.mark.integration  # writes a model
def test_should_count_every_cpu_judge_replica_on_the_machine_when_a_cpu_experiment_uses_a_judge() -> None:
    cfg = config.load(["experiment=cpu-demo", "env.reward_functions=[{name: llm_judge}]", f"judge.model='{TINY}'",
                       "judge.replicas=2"])  # fmt: skip
    result = plan.plan(cfg, None, "cpu-demo")
    (node,) = result.devices
    assert node.terms["judge weights x 2 replicas"] == 2 * plan.model_shape(TINY).params * 4  # float32
    assert "judge KV cache x 2 replicas" in node.terms and not result.alternatives


def test_should_say_in_one_line_naming_the_key_when_the_judges_config_cannot_be_read() -> None:
    import os

    args = [RM_PRESET, "env.reward_functions=[{name: llm_judge}]", "judge.model=no-such-org/no-such-judge"]
    # huggingface_hub reads HF_HUB_OFFLINE on import: tests/conftest.py set it before any test imported it
    out = _cli(*args, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 2 and out.stdout == ""
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("kuberl: plan: cannot read the config of judge.model=no-such-org/no-such-judge (")
    assert line.endswith(
        "download it first (huggingface-cli download NAME config.json) or give a local directory"
    )


# ----- a vLLM engine on CPU: its packed kernels and its KV cache, as the engine sizes them ----------------


@pytest.mark.integration  # writes a model
def test_should_count_a_cpu_vllm_engines_packed_kernels_and_its_step_sized_kv_cache(monkeypatch) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    cfg = config.load(
        ["experiment=cpu-demo", "generation=vllm", f"model.name='{TINY}'", "generation.dtype=float32"]
    )
    (node,) = plan.plan(cfg, None, "cpu-demo").devices
    shape = plan.model_shape(TINY)
    engines = cfg.cluster.cpu_workers_per_node
    per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * 4
    blocks = -(-cfg.policy.max_total_sequence_length // 128)  # every sequence in whole blocks of 128 tokens
    assert (
        node.terms[f"engine KV cache x {engines}"] == engines * cfg.grpo.batch_size * blocks * 128 * per_token
    )
    assert node.terms[f"engine packed kernels x {engines}"] == node.terms[f"engine weights x {engines}"]
    cfg = config.load(["experiment=cpu-demo", "generation=vllm", f"model.name='{TINY}'",
                       "generation.vllm_kwargs={kv_cache_memory_bytes: 1000000}"])  # fmt: skip
    (node,) = plan.plan(cfg, None, "cpu-demo").devices
    assert node.terms[f"engine KV cache x {engines}"] == engines * 1000000  # the user's word, as the engine's
    (node,) = plan.plan(
        config.load(["experiment=cpu-demo", f"model.name='{TINY}'"]), None, "cpu-demo"
    ).devices
    assert not any("KV" in term for term in node.terms)  # the hf engine has no cache of its own


@pytest.mark.integration  # writes a model (the embedded SmolLM2, on first use)
def test_should_plan_a_cpu_node_with_each_processs_runtime_against_the_share_ray_lets_workers_use(
    monkeypatch,
) -> None:
    monkeypatch.setattr(plan, "_host_memory", lambda: 16 * plan.GiB)
    monkeypatch.delenv("RAY_memory_usage_threshold", raising=False)
    cfg = config.load(["experiment=cpu-demo", "generation=vllm"])
    (node,) = plan.plan(cfg, None, "cpu-demo").devices
    ranks = cfg.cluster.cpu_workers_per_node
    assert node.capacity == 16 * plan.GiB * 0.95  # Ray's memory monitor kills past 95%
    assert node.terms[f"runtime x {ranks} ranks"] == ranks * plan.CPU_RANK_RUNTIME
    assert node.terms[f"engine runtime x {ranks}"] == ranks * plan.CPU_ENGINE_RUNTIME
    assert node.terms["driver and Ray"] == plan.CPU_DRIVER
    monkeypatch.setattr(plan, "_host_memory", lambda: 8 * plan.GiB)
    (node,) = plan.plan(cfg, None, "cpu-demo").devices
    assert (
        not node.fits and node.dominant == f"activations x {ranks} ranks"
    )  # a key changes it; runtime is fixed
    monkeypatch.setenv("RAY_memory_usage_threshold", "0.5")
    assert plan.plan(cfg, None, "cpu-demo").devices[0].capacity == 4 * plan.GiB
