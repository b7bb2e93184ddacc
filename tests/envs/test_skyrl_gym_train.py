"""A SkyRL-gym environment trains through the real entry point: a few steps of the tiny model on SkyRL's
multi-turn GSM8K environment, its prompts from a dataset in SkyRL's own format, its rewards the environment's."""

from __future__ import annotations

import json
import math

import pytest

from tests.tiny_run import run_in_process
from trainer.models.tiny import DEFAULT_VOCAB_CHARS, build_tiny_model

pytest.importorskip("skyrl_gym")
pytestmark = pytest.mark.slow

STEPS = 3


def _scalars(run_dir) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_should_train_a_few_steps_when_the_environment_is_skyrl_gym(trainer_env, tmp_path) -> None:
    model = build_tiny_model(str(tmp_path / "model"), vocab_chars=DEFAULT_VOCAB_CHARS + "#")  # "#### 3"
    rows = [
        {
            "data_source": "arithmetic",
            "prompt": [{"role": "user", "content": f"{a}+{b}=?"}],
            "env_class": "gsm8k_multi_turn",
            "reward_spec": {"method": "rule", "ground_truth": str(a + b)},
            "extra_info": {"index": 3 * a + b},
        }
        for a in range(3)
        for b in range(3)
    ]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    logs = tmp_path / "logs"
    proc = run_in_process(
        [
            "experiment=tiny",
            f"model.name={model}",
            "data.name=skyrl_gym", f"data.path={data}",
            "env.environment=skyrl_gym",
            # the environment's two turns, and a third the loop never reaches: the environment scores every episode
            "env.environment_kwargs={env_class: gsm8k_multi_turn, extras: {max_turns: 2}}",
            "grpo.max_rollout_turns=3",
            "env.reward_functions=[{name: environment, weight: 1.0}]",
            f"grpo.max_num_steps={STEPS}", "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4",
            "generation.max_new_tokens=6", "policy.max_total_sequence_length=320",
            "cluster.cpu_workers_per_node=1", "checkpointing.enabled=false",
            f"logger.log_dir={logs}",
        ],
        trainer_env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = list((logs / "tiny").iterdir())
    scalars = _scalars(run_dir)
    rewards = scalars["train/reward_mean"]
    assert len(rewards) == STEPS and all(math.isfinite(r) for r in rewards)
    assert scalars["train/reward/environment"] == rewards  # the one reward: the environment's own
    # a first answer that is not right gets the environment's instruction and a second turn (the random model
    # never writes "#### n": its rewards are 0, and every episode takes the environment's two turns)
    assert all(1.0 < t <= 2.0 for t in scalars["train/turns_mean"])
    assert all(s >= 0 for s in scalars["train/env/step_s"])
    assert "train/env/errors" not in scalars  # no step failed
    rows = [json.loads(line) for line in (run_dir / "train_data_step1.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and all(r["rewards"]["environment"] >= 0 for r in rows)
    # between the turns, SkyRL's own instruction for the last one, in the transcript the trainer trained on
    assert all("final numeric answer in the exact format" in r["transcript"] for r in rows)
    assert all(r["answer_note"] == f"environment reward {r['reward']:g}" for r in rows)
