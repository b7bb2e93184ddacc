"""Multi-turn code episodes: execution feedback becomes the next user turn, only the model's tokens
carry loss, and the final attempt is what gets rewarded."""

from __future__ import annotations

import pytest
import ray

from trainer.config import EnvConfig, RewardSpec
from trainer.data.prompts import TurnEncoder, encode_prompt
from trainer.envs.code_feedback import CodeFeedback
from trainer.generation.base import Completion, SamplingParams
from trainer.loop.rollout import finish, generate_episodes
from trainer.models import load_tokenizer
from trainer.rewards.runner import RewardRunner

pytestmark = pytest.mark.slow

WRONG = "```python\nprint(int(input()) * 2)\n```"
RIGHT = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
TESTS = {"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]}


def generate_multi_turn(generator, rewards, feedback, turns, examples, n, params, max_turns, max_context):
    """The run's code loop: the ``code_feedback`` environment over a feedback runner."""
    env = CodeFeedback.from_runner(feedback)
    return generate_episodes(generator, rewards, env, turns, examples, n, params, max_turns, max_context)


class ScriptedGenerator:
    """A generation engine that answers from a script: (turn index) -> text. A prompt's turn is the number of
    the model's attempts it already holds (the assistant turns its chat template opened, less the one to
    write), not the number of calls: episodes that step apart reach the engines in calls of their own."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.prompts = tokenizer, script, []

    @property
    def turns(self) -> int:
        """How many turns were asked for: 1 + the latest turn any prompt reached."""
        return 1 + max(self._turn(p) for p in self.prompts)

    def _turn(self, prompt) -> int:
        return self.tokenizer.decode(prompt).count("<|im_start|>assistant") - 1

    def submit(self, prompts, n, params):
        self.prompts += prompts
        out = []
        for prompt in prompts:
            text = self.script[self._turn(prompt)]
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            out.append([Completion(ids, [0.0] * len(ids), text, "stop") for _ in range(n)])
        return [(ray.put(out), list(range(len(prompts))))]


@pytest.fixture()
def setup(ray_local, tiny_model_path):
    tok = load_tokenizer(tiny_model_path)
    env = EnvConfig([RewardSpec("code_unit_tests")], reward_timeout_s=60, feedback="code_unit_tests")
    messages = [{"role": "user", "content": "read a and b, print a+b"}]
    example = {"messages": messages, "ground_truth": TESTS, "prompt_ids": encode_prompt(tok, messages, {})}
    return tok, env, example


def test_should_feed_back_the_failing_test_and_reward_the_final_attempt_when_retrying(setup):
    tok, env, example = setup
    gen = ScriptedGenerator(tok, [WRONG, RIGHT, WRONG])
    rewards = RewardRunner(env)
    pending = generate_multi_turn(
        gen,
        rewards,
        RewardRunner(env, feedback=True),
        TurnEncoder(tok, {}),
        [example],
        2,
        SamplingParams(max_new_tokens=64),
        3,
        4096,
    )
    (a, b) = finish(pending, rewards)
    assert gen.turns == 2  # both episodes passed on the second attempt: no third turn
    for r in (a, b):
        assert r.turns == 2 and r.reward.total == 1.0 and r.reward.correct
        # second-turn context = prompt + first attempt + feedback; the feedback names the failing test
        transcript = tok.decode(r.response_ids)
        assert "failed a test" in transcript and "expected output" in transcript.lower()
        model = [t for t, m in zip(r.response_ids, r.response_mask) if m]
        first = tok(WRONG, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        second = tok(RIGHT, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert model == first + second  # only the model's own tokens carry loss
        assert 0 in r.response_mask
    assert all(p[: len(example["prompt_ids"])] == example["prompt_ids"] for p in gen.prompts[1:])


def test_should_stop_at_the_turn_limit_and_score_the_last_attempt(setup):
    tok, env, example = setup
    gen = ScriptedGenerator(tok, [WRONG, WRONG])
    rewards = RewardRunner(env)
    pending = generate_multi_turn(
        gen,
        rewards,
        RewardRunner(env, feedback=True),
        TurnEncoder(tok, {}),
        [example],
        2,
        SamplingParams(max_new_tokens=64),
        2,
        4096,
    )
    results = finish(pending, rewards)
    assert gen.turns == 2 and all(r.turns == 2 and r.reward.total == 0.0 for r in results)


def test_should_complete_and_log_rewards_when_tiny_model_runs_multi_turn_on_code(tmp_path, trainer_env):
    import json

    from tests.conftest import REPO
    from tests.tiny_run import run_in_process

    proc = run_in_process(
        [
            "experiment=tiny",
            "data.name=nemotron_code",
            f"data.path={REPO / 'tests/fixtures/code/nemotron_code_sample.jsonl'}",
            "rewards=code_unit_tests",
            "grpo.max_rollout_turns=2",
            "grpo.num_prompts_per_step=2",
            "grpo.num_generations_per_prompt=4",
            "grpo.max_num_steps=2",
            "generation.max_new_tokens=16",
            "policy.max_total_sequence_length=1024",
            "cluster.cpu_workers_per_node=1",
            f"logger.log_dir={tmp_path / 'logs'}",
            f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
        ],
        trainer_env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (run_dir,) = list((tmp_path / "logs" / "tiny").iterdir())
    rows = [json.loads(line) for line in (run_dir / "train_data_step2.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all("code_unit_tests" in r["rewards"] for r in rows)
    assert all(r["turns"] == 2 for r in rows)  # a random model never passes: every episode retries
    assert all(r["answer_note"] for r in rows)  # the code reward says what it judged: no block, or the tally
