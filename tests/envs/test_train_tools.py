"""Multi-turn tool episodes through the real entry point: a tiny model learns a task only a tool can do, and
tool episodes train on both engines and both placements with the engine's tokens (the trainer's recomputed
logprobs agree with the engine's: a trained sequence that was not the sampled one would not)."""

from __future__ import annotations

import json

import pytest

from tests.envs.helpers import build_dice_model
from tests.tiny_run import needs_vllm, read_scalars, train_tiny

pytestmark = pytest.mark.slow

TOOLS_RUN = (
    "grpo.max_rollout_turns=3",
    "env.environment=tests.envs.helpers:ToolEveryTurn",
    "policy.max_total_sequence_length=1024",  # the calculator's schema in the system prompt (ChatML has no tools)
    "generation.max_new_tokens=4",
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4",
    "grpo.max_num_steps=2",
    # Every sample trained on, whatever its advantage: the engine-trainer gap below is measured on the trained
    # tokens, and groups that all scored alike would otherwise leave none (the gap then goes unreported).
    "policy.skip_zero_advantage=false",
)


def _check_tool_run(run_dir, scalars):
    assert scalars["train/turns_mean"] == [3.0, 3.0]  # the environment answers twice, the third turn ends it
    assert scalars["train/tool_calls_mean"] == [2.0, 2.0]
    assert scalars["train/tool_errors"] == [0.0, 0.0] and "timing/tool_s" in scalars
    rows = [json.loads(line) for line in (run_dir / "train_data_step2.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and all(
        r["turns"] == 3 and r["transcript"].count("<|im_start|>tool") == 2 for r in rows
    )


def test_should_train_on_tool_episodes_when_the_hf_engine_generates(trainer_env, tmp_path):
    _, run_dir = train_tiny(trainer_env, tmp_path, *TOOLS_RUN)
    scalars = read_scalars(run_dir)
    _check_tool_run(run_dir, scalars)
    assert max(scalars["train/gen_logprob_abs_diff"]) < 1e-3  # float32 on both sides, the same tokens


@pytest.mark.vllm
@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_should_train_on_tool_episodes_when_vllm_generates(trainer_env, tmp_path, placement):
    needs_vllm()
    _, run_dir = train_tiny(
        trainer_env, tmp_path, *TOOLS_RUN, "generation.backend=vllm", f"generation.placement={placement}"
    )
    scalars = read_scalars(run_dir)
    _check_tool_run(run_dir, scalars)
    assert max(scalars["train/gen_logprob_abs_diff"]) < 0.05  # vLLM's kernels, on the tokens it sampled


@pytest.mark.parametrize("backend", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_should_learn_to_call_the_tool_when_only_the_tool_knows_the_answer(trainer_env, tmp_path, backend):
    if backend == "vllm":
        needs_vllm()
    model = build_dice_model(str(tmp_path / "dice-model"))
    stdout, run_dir = train_tiny(
        trainer_env,
        tmp_path,
        f"generation.backend={backend}",
        f"model.name={model}",
        "grpo.max_rollout_turns=2",
        "env.environment=tests.envs.helpers:DiceTools",
        "env.reward_functions=[{name:environment,weight:1.0}]",
        "data.prompt_template='roll the die and say what it shows: {question}'",
        "policy.max_total_sequence_length=512",
        "grpo.num_prompts_per_step=8",
        "grpo.max_num_steps=30",
        # At tiny's 1e-2 one of three runs learned to call and answer, then stopped calling at all in one step.
        "policy.learning_rate=5e-3",
    )
    scalars = read_scalars(run_dir)
    rewards, calls = scalars["train/reward_mean"], scalars["train/tool_call_rate"]
    print("reward", [round(r, 3) for r in rewards], "\ncall rate", [round(c, 3) for c in calls])
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    # A 2-core EPYC, last 3 steps against the first 3: hf 0.01 -> 0.42, calls 2% -> 83%; vLLM 0.01 -> 0.41,
    # calls 2% -> 82%. The die is seeded (DiceTools), so a run repeats to the last digit: two vLLM runs side
    # by side, and hf with ATEN_CPU_CAPABILITY=avx2 and without, gave the same curves. Unseeded, one vLLM run
    # in five stopped calling in its last two steps. Mostly the half for answering after a call: copying the
    # digit comes later. A model that never learned to call stays near 0.01 and 2%.
    assert last > first + 0.1, f"reward did not rise: {first:.3f} -> {last:.3f} ({rewards})"
    assert sum(calls[-3:]) / 3 > sum(calls[:3]) / 3 + 0.3
