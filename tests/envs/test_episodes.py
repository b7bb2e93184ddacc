"""Multi-turn episodes through the rollout loop: what the trainer trains on is exactly what the engine sampled
and what the environment appended, token for token; only the model's tokens carry loss; tool calls are parsed,
run and answered inside the template's own markers; each sample's turns go on without waiting for the others."""

from __future__ import annotations

import time

import pytest
import torch

from tests.envs.helpers import RecordingGenerator, ToolEveryTurn, build_tools_model, tool_message
from trainer.config import EnvConfig, RewardSpec
from trainer.data.prompts import TurnEncoder, encode_prompt
from trainer.envs.tools import ToolEnvironment, stop_processes
from trainer.generation.base import Completion, SamplingParams
from trainer.loop.rollout import finish, generate_episodes, turn_seed
from trainer.rewards.runner import RewardRunner

MESSAGES = [{"role": "user", "content": "what is 12*34?"}]


@pytest.fixture(autouse=True)
def _tool_processes():
    yield
    stop_processes()  # the tools' fork server belongs to the test that ran a call


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tools_model(str(tmp_path_factory.mktemp("tools-model")))


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def _example(tok, tools, gt="408"):
    return {"messages": MESSAGES, "ground_truth": gt, "prompt_ids": encode_prompt(tok, MESSAGES, {}, tools)}


def _rewards(*specs):
    return RewardRunner(
        EnvConfig([RewardSpec(*s) for s in specs] or [RewardSpec("arithmetic")], reward_timeout_s=60)
    )


def check_token_exact(rollout, calls, turns: TurnEncoder, expected_messages):
    """Walk the trained sequence (prompt + response): every model turn is a completion the engine sampled for
    exactly the tokens before it (mask 1, its logprobs), and every stretch between is the glue of the
    environment's messages for that turn (mask 0, logprob 0). ``expected_messages(text)``: what the
    environment answers to a turn's text."""
    sampled: dict[tuple[int, ...], list[Completion]] = {}
    for prompts, _, out in calls:
        for prompt, group in zip(prompts, out):
            sampled.setdefault(tuple(prompt), []).extend(group)
    full = rollout.prompt_ids + rollout.response_ids
    mask = [0] * len(rollout.prompt_ids) + rollout.response_mask
    logprobs = [0.0] * len(rollout.prompt_ids) + rollout.response_logprobs
    pos, turn_texts = len(rollout.prompt_ids), []
    while pos < len(full):
        candidates = sampled.get(tuple(full[:pos]), [])
        match = next((c for c in candidates if full[pos : pos + len(c.token_ids)] == c.token_ids), None)
        assert match is not None, (
            f"the tokens at {pos} are no completion the engine sampled for what precedes them"
        )
        candidates.remove(match)  # each sample is trained on once
        end = pos + len(match.token_ids)
        assert mask[pos:end] == [1] * len(match.token_ids)
        assert logprobs[pos:end] == match.logprobs  # the engine's, for importance sampling
        turn_texts.append(match.text)
        pos = end
        if pos == len(full):
            break
        glue = turns.continuation(
            rollout.example["messages"],
            expected_messages(match.raw_text if match.raw_text is not None else match.text),
            match.token_ids,
        )
        assert full[pos : pos + len(glue)] == glue, "the environment's tokens are not its messages' glue"
        assert mask[pos : pos + len(glue)] == [0] * len(glue) and set(logprobs[pos : pos + len(glue)]) <= {
            0.0
        }
        pos += len(glue)
    assert len(turn_texts) == rollout.turns
    return turn_texts


def _engine(backend, model_path, tokenizer):
    if backend == "hf":
        from transformers import AutoModelForCausalLM

        from trainer.generation.hf import HFGenerationEngine

        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        return HFGenerationEngine(model, tokenizer, batch_size=16)
    from trainer.config import GenerationConfig
    from trainer.generation.vllm_engine import VLLMGenerationEngine

    return VLLMGenerationEngine(
        model_path, GenerationConfig(enforce_eager=True), "float32", seed=0, max_model_len=1024, threads=1
    )


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_should_train_on_exactly_the_sampled_and_appended_tokens_when_episodes_use_tools(
    backend, ray_local, model_path, tokenizer
):
    env = ToolEveryTurn(turns=3)
    tools = env.tools()
    turns = TurnEncoder(tokenizer, {}, tools)
    engine = _engine(backend, model_path, tokenizer)
    try:
        gen = RecordingGenerator(engine)
        rewards = _rewards()
        params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3)
        pending = generate_episodes(
            gen, rewards, env, turns, [_example(tokenizer, tools)] * 2, 3, params, 3, 1024
        )
        rollouts = finish(pending, rewards)
    finally:
        getattr(engine, "shutdown", lambda: None)()
    assert len(rollouts) == 6 and all(r.turns == 3 for r in rollouts)
    assert "<tools>" in tokenizer.decode(rollouts[0].prompt_ids)  # the tools were offered in the first prompt
    for r in rollouts:
        check_token_exact(r, gen.calls, turns, lambda text: [tool_message(text)])
        transcript = tokenizer.decode(r.prompt_ids + r.response_ids)
        assert transcript.count("<tool_response>") == 2  # the template's own markers around each result
        assert r.env_info["tool_calls"] == 2.0


class _SeedRecorder(RecordingGenerator):
    """A recording generator that keeps each call's sampling parameters too."""

    def __init__(self, engine):
        super().__init__(engine)
        self.params: list[SamplingParams] = []

    def submit(self, prompts, n, params):
        self.params.append(params)
        return super().submit(prompts, n, params)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_should_sample_every_turn_again_alike_when_episodes_are_run_again_with_the_same_seed(
    backend, ray_local, model_path, tokenizer
):
    env = ToolEveryTurn(turns=3)
    tools = env.tools()
    turns = TurnEncoder(tokenizer, {}, tools)
    engine = _engine(backend, model_path, tokenizer)

    def run(seed):
        gen, rewards = _SeedRecorder(engine), _rewards()
        params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=seed)
        pending = generate_episodes(
            gen, rewards, env, turns, [_example(tokenizer, tools)] * 2, 3, params, 3, 1024
        )
        return [r.response_ids for r in finish(pending, rewards)], gen

    try:
        first, gen = run(3)
        again, _ = run(3)
        other, _ = run(4)
    finally:
        getattr(engine, "shutdown", lambda: None)()
    assert again == first  # every turn of every episode, whichever calls timing grouped the later turns into
    assert other != first
    # The later turns went with a seed per prompt, each (prompt, sample, turn) its own.
    later = gen.params[1:]
    assert later and all(p.seed is None and p.seeds is not None for p in later)
    seeds = [s for p in later for s in p.seeds]
    assert len(seeds) == 6 * 2 and len(set(seeds)) == len(seeds)
    # Two samples whose first turns were alike (vLLM draws both prompts' sample j from seed + j) go on apart.
    firsts = {}
    for rows, out in zip([[0, 1, 2], [3, 4, 5]], gen.calls[0][2]):
        for row, c in zip(rows, out):
            firsts.setdefault(tuple(c.token_ids), []).append(row)
    alike = [rows for rows in firsts.values() if len(rows) > 1]
    assert alike or backend == "hf"  # the hf engine draws a call's rows from one stream: none alike
    for rows in alike:
        assert len({tuple(first[row]) for row in rows}) == len(rows)


def test_should_give_each_later_turn_its_own_seed_when_derived_from_the_steps():
    seeds = {
        turn_seed(seed, prompt, sample, turn)
        for seed in (0, 1, 2)
        for prompt in range(4)
        for sample in range(4)
        for turn in (1, 2, 3)
    }
    assert len(seeds) == 3 * 4 * 4 * 3 and all(0 <= s < 2**62 for s in seeds)
    assert turn_seed(1, 2, 3, 1) == turn_seed(1, 2, 3, 1)


CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'


class ScriptedEngine:
    """An engine that writes a script by turn (the number of assistant turns already in the prompt)."""

    def __init__(self, tokenizer, script, delay=None):
        self.tok, self.script, self.delay = tokenizer, script, delay or {}

    def generate(self, prompts, n, params):
        out = []
        for p in prompts:
            text = self.tok.decode(p)
            turn = text.count("<|im_start|>assistant") - 1
            key = (text.count("tag-slow") > 0, turn)
            if key in self.delay:
                time.sleep(self.delay[key])
            reply = self.script[turn]
            ids = self.tok(reply, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            out.append([Completion(ids, [-0.5] * len(ids), reply.lower(), "stop") for _ in range(n)])
        return out


@pytest.mark.slow
def test_should_run_the_call_answer_in_the_templates_markers_and_score_the_final_answer(ray_local, tokenizer):
    env = ToolEnvironment(tools=["calculator"])
    tools = env.tools()
    turns = TurnEncoder(tokenizer, {}, tools)
    gen = RecordingGenerator(ScriptedEngine(tokenizer, [CALL, "408"]))
    rewards = _rewards(("arithmetic",))
    pending = generate_episodes(
        gen, rewards, env, turns, [_example(tokenizer, tools)], 2, SamplingParams(max_new_tokens=128), 4, 2048
    )
    for r in finish(pending, rewards):
        assert r.turns == 2 and r.reward.total == 1.0 and r.env_info["tool_calls"] == 1.0
        assert r.env_info["tool_errors"] == 0.0
        texts = check_token_exact(r, gen.calls, turns, lambda text: env.episode({}).step(text).messages)
        assert texts == [CALL.lower(), "408"]
        transcript = tokenizer.decode(r.prompt_ids + r.response_ids)
        assert (
            "<tool_response>\n408\n</tool_response>" in transcript
        )  # the calculator's result, in the markers
        model = [t for t, m in zip(r.response_ids, r.response_mask) if m]
        assert tokenizer.decode(model) == CALL.lower() + "<|im_end|>" + "408" + "<|im_end|>"


@pytest.mark.slow
def test_should_answer_a_malformed_call_with_an_error_and_let_the_model_try_again(ray_local, tokenizer):
    env = ToolEnvironment(tools=["calculator"])
    tools = env.tools()
    gen = RecordingGenerator(ScriptedEngine(tokenizer, ["<tool_call>{oops</tool_call>", CALL, "408"]))
    rewards = _rewards(("arithmetic",))
    pending = generate_episodes(
        gen,
        rewards,
        env,
        TurnEncoder(tokenizer, {}, tools),
        [_example(tokenizer, tools)],
        2,
        SamplingParams(max_new_tokens=128),
        4,
        2048,
    )
    for r in finish(pending, rewards):
        assert r.turns == 3 and r.reward.total == 1.0
        assert r.env_info["tool_calls"] == 2.0 and r.env_info["tool_errors"] == 1.0
        assert "not valid json" in tokenizer.decode(r.response_ids)


@pytest.mark.slow
def test_should_end_the_episode_at_the_turn_limit_and_when_the_token_budget_is_spent(ray_local, tokenizer):
    env = ToolEnvironment(tools=["calculator"])
    tools = env.tools()
    turns = TurnEncoder(tokenizer, {}, tools)
    example = _example(tokenizer, tools)
    rewards = _rewards(("arithmetic",))
    gen = RecordingGenerator(ScriptedEngine(tokenizer, [CALL] * 5))
    (r,) = finish(
        generate_episodes(
            gen, rewards, env, turns, [example], 1, SamplingParams(max_new_tokens=100), 3, 4096
        ),
        rewards,
    )
    assert r.turns == 3 and r.reward.total == 0.0  # the last turn was a call, not an answer
    budget = len(example["prompt_ids"]) + 2 * 100 + 150  # room for two turns, not three
    gen = RecordingGenerator(ScriptedEngine(tokenizer, [CALL] * 5))
    (r,) = finish(
        generate_episodes(
            gen, rewards, env, turns, [example], 1, SamplingParams(max_new_tokens=100), 9, budget
        ),
        rewards,
    )
    assert r.turns == 2 and len(r.prompt_ids) + len(r.response_ids) <= budget


class _Timed(ToolEnvironment):
    """The calculator, with an episode that takes ``slow_s`` per step on the prompts tagged slow."""

    def __init__(self, slow_s):
        super().__init__(tools=["calculator"])
        self.slow_s = slow_s

    def episode(self, example):
        inner, slow = super().episode(example), "tag-slow" in example["messages"][0]["content"]

        class _Ep:
            def step(_, text):
                if slow:
                    time.sleep(self.slow_s)
                return inner.step(text)

            def close(_):
                pass

        return _Ep()


@pytest.mark.slow
def test_should_start_a_samples_next_turn_without_waiting_for_a_slow_episode(ray_local, tokenizer):
    env = _Timed(slow_s=4.0)
    tools = env.tools()
    fast = _example(tokenizer, tools)
    slow_messages = [{"role": "user", "content": "tag-slow: what is 12*34?"}]
    slow = {
        **fast,
        "messages": slow_messages,
        "prompt_ids": encode_prompt(tokenizer, slow_messages, {}, tools),
    }
    gen = RecordingGenerator(ScriptedEngine(tokenizer, [CALL, CALL, "408"]))
    rewards = _rewards(("arithmetic",))
    pending = generate_episodes(
        gen,
        rewards,
        env,
        TurnEncoder(tokenizer, {}, tools),
        [fast, slow],
        1,
        SamplingParams(max_new_tokens=128),
        4,
        4096,
    )
    results = finish(pending, rewards)
    assert all(r.turns == 3 and r.reward.total == 1.0 for r in results)
    # The fast episode's three turns went while the slow one's first tool step was running (lock-step rounds
    # would have waited for it at every turn): the fast sample's later turns were calls of their own.
    fast_turns = [c for c in gen.calls[1:] if len(c[0]) == 1 and "tag-slow" not in tokenizer.decode(c[0][0])]
    assert len(fast_turns) == 2
