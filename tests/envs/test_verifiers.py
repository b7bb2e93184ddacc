"""verifiers environments (env.verifiers): their dataset is the run's prompts, they drive the rollouts through the
generation endpoint, the trainer trains on exactly the tokens the endpoint sampled and the environment's messages
rendered to (mask 0 on those), and their rubric's reward is the ``environment`` reward. Two environments defined in
tests/fixtures/verifiers_envs (a single-turn one and a tool one, each with its own dataset); a tiny model on CPU."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from tests.envs.helpers import ROLL_CALL, TOOLS_TEMPLATE, build_dice_model
from trainer.config import ConfigError, EndpointConfig, EnvConfig, GenerationConfig, RewardSpec, load
from trainer.envs.base import Turn, chain

pytest.importorskip("verifiers")

SUMS = "tests.fixtures.verifiers_envs.vf_sums"
DICE = "tests.fixtures.verifiers_envs.vf_dice"
TOKEN = "test-token-0123456789abcdef"

# The tools template, plus the assistant's tool calls written back as the model writes them (no spaces added):
# a later turn's prompt then begins with the earlier turn's sampled tokens.
CALLS_TEMPLATE = TOOLS_TEMPLATE.replace(
    "{%- else %}",
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{ '<|im_start|>assistant\\n' + message['content'] }}"
    "{%- for call in message['tool_calls'] %}"
    "{{ '<tool_call>' + ({'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson)"
    " + '</tool_call>' }}"
    "{%- endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- else %}",
    1,
)


def _history_template(content: str, call: str) -> str:
    """TOOLS_TEMPLATE with the assistant's turns written back as ``content`` (a Jinja expression of
    ``message['content']``) and each tool call as ``call`` (of ``c``, the call): templates that rewrite history."""
    return TOOLS_TEMPLATE.replace(
        "{%- else %}",
        "{%- elif message['role'] == 'assistant' %}"
        "{{ '<|im_start|>assistant\\n' + " + content + " }}"
        "{%- for c in message.get('tool_calls') or [] %}{{ " + call + " }}{%- endfor %}"
        "{{ '<|im_end|>\\n' }}"
        "{%- else %}",
        1,
    )


_AS_SAMPLED = "'<tool_call>' + ({'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson) + '</tool_call>'"
# Qwen3's template drops an earlier turn's reasoning (before the last user turn; DeepSeek-R1's, before every turn).
THINK_TEMPLATE = _history_template("message['content'].split('</think>')[-1].lstrip('\\n')", _AS_SAMPLED)
# Qwen2.5's and Qwen3's write a call back on lines of its own: not the ids the model sampled.
SPACED_TEMPLATE = _history_template(
    "message['content']",
    "'<tool_call>\\n{\"name\": \"' + c['function']['name'] + '\", \"arguments\": ' "
    "+ (c['function']['arguments'] | tojson) + '}\\n</tool_call>'",
)


# ----- one sample per episode: the prefix rule ---------------------------------------------------------------
def test_should_join_turns_into_one_sample_with_the_environment_masked_when_each_prompt_extends_the_last():
    turns = [Turn([1, 2], [3, 4], [-0.1, -0.2], "stop"), Turn([1, 2, 3, 4, 9, 9], [5], [-0.5], "stop")]
    s = chain(turns)
    assert (s.prompt_ids, s.response_ids) == ([1, 2], [3, 4, 9, 9, 5])
    assert s.response_mask == [1, 1, 0, 0, 1]
    assert s.response_logprobs == [-0.1, -0.2, 0.0, 0.0, -0.5]
    assert s.turns == 2


def test_should_end_the_sample_before_a_turn_and_say_why_once_when_its_prompt_rewrote_an_earlier_turn(
    monkeypatch, caplog
):
    import trainer.envs.base as base

    monkeypatch.setattr(base, "_dropped_logged", False)
    turns = [
        Turn([1, 2], [3, 4], [-0.1, -0.2], "stop"),
        Turn([1, 2, 3, 7, 9], [5], [-0.5], "stop"),  # the template wrote the model's turn otherwise
        Turn([1, 2, 3, 7, 9, 5, 9], [6], [-0.6], "stop"),
    ]
    with caplog.at_level("WARNING", logger="trainer.envs.base"):
        s = chain(turns)
        assert chain(turns).turns == 1  # every episode of a run may drop: the reason is said once
    assert (s.response_ids, s.response_mask, s.turns) == ([3, 4], [1, 1], 1)
    (record,) = [r for r in caplog.records if r.name == "trainer.envs.base"]
    assert "turn 2 of 3 is not trained on, nor the 1 after it" in record.getMessage()
    assert "at token 3 of 4" in record.getMessage() and "turns_dropped" in record.getMessage()


# ----- configuration ---------------------------------------------------------------------------------------
VF_RUN = [
    "experiment=tiny",
    f"env.verifiers.id={SUMS}",
    "data.name=verifiers",
    "generation.placement=disaggregated",
    "generation.endpoint.enabled=true",
    "env.reward_functions=[{name: environment, weight: 1.0}]",
]


@pytest.mark.parametrize(
    "change, message",
    [
        (
            ["generation.endpoint.enabled=false"],
            "set generation.placement=disaggregated and generation.endpoint",
        ),
        (["data.name=arithmetic"], "set data.name=verifiers"),
        (["env.reward_functions=[{name: arithmetic}]"], "add {name: environment, weight: 1.0}"),
        (["grpo.max_rollout_turns=2"], "leave env.environment null and grpo.max_rollout_turns=1"),
        (["grpo.val_period=5"], "set grpo.val_period=0"),
        (["data.system_prompt=be brief"], "unset data.system_prompt, data.prompt_template and data.few_shot"),
        (
            ["data.few_shot=[{question: '1 + 1', answer: '2'}]"],
            "unset data.system_prompt, data.prompt_template",
        ),
        (["env.verifiers.id=null"], "data.name=verifiers takes its prompts from a verifiers environment"),
    ],
)
def test_should_refuse_in_one_line_when_a_verifiers_run_is_misconfigured(change, message):
    with pytest.raises(ConfigError, match=message.replace("{", r"\{").replace(".", r"\.")) as e:
        load(VF_RUN + change)
    assert "\n" not in str(e.value)


def test_should_refuse_in_one_line_when_the_environment_module_is_not_there():
    from trainer.envs.verifiers_env import check

    with pytest.raises(ConfigError, match="no module 'no_such_env_here'"):
        check("no-such-env-here")


# ----- rollouts through a real endpoint --------------------------------------------------------------------
@pytest.fixture(scope="module")
def dice_model(tmp_path_factory):
    """The dice model (a random tiny Llama whose vocabulary holds the whole call to the die as one token) with
    CALLS_TEMPLATE, tilted to write that call: residual dimension 0 is held at 10 in every layer and the call's
    embedding is one higher there, so its logit leads every other token's by about 8 (p ~ 0.96)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_dice_model(str(tmp_path_factory.mktemp("dice-model")))
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = CALLS_TEMPLATE
    tok.save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight  # tied: also lm_head
        emb[:, 0] = 10.0
        emb[tok.convert_tokens_to_ids(ROLL_CALL), 0] = 11.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engine(dice_model):
    from trainer.generation.hf import HFGenerationEngine
    from trainer.models import load_model, load_tokenizer

    tok = load_tokenizer(dice_model)
    engine = HFGenerationEngine(load_model(dice_model, "float32"), tok, batch_size=4)
    yield engine, tok
    engine.shutdown()


@pytest.fixture
def serve(engine, monkeypatch):
    """Start an endpoint over the module's engine (``max_model_len``: its sequence budget); shut down after."""
    from trainer.generation.endpoint import ChatEndpoint

    monkeypatch.setenv("KUBERL_TEST_ENDPOINT_TOKEN", TOKEN)
    started = []

    def start(max_model_len: int = 512):
        eng, tok = engine
        ep_cfg = EndpointConfig(
            enabled=True, port=0, bind="127.0.0.1", token_env="KUBERL_TEST_ENDPOINT_TOKEN"
        )
        gen = GenerationConfig(max_new_tokens=6, placement="disaggregated", endpoint=ep_cfg)
        ep = ChatEndpoint(eng, tok, gen, "dice", max_model_len=max_model_len)
        started.append(ep)
        ep.start()
        return ep, tok

    yield start
    for ep in started:
        ep.shutdown()


def _driven(env_id, args, endpoint, n, stop=(), max_new_tokens=6):
    """The environment's rollouts of its first two examples through ``endpoint``, scored; and the examples."""
    from trainer.envs.verifiers_env import VerifiersEnvironment
    from trainer.generation.base import SamplingParams
    from trainer.loop.rollout import finish, generate_by_environment
    from trainer.rewards.runner import RewardRunner

    ep, _ = endpoint
    env = VerifiersEnvironment(env_id, args)
    host, port = ep.address
    env.connect([f"http://{host}:{port}/v1"], TOKEN, "dice", 4)
    examples = env.examples()[:2]
    rewards = RewardRunner(EnvConfig([RewardSpec("environment")], reward_timeout_s=60))
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, stop_strings=list(stop))
    pending = generate_by_environment(env, rewards, examples, n, params)
    return finish(pending, rewards), examples, ep.drain_requests()


def _check_token_exact(rollout, records):
    """Walk the trained sequence: every stretch of mask 1 is a completion the endpoint sampled for exactly the
    tokens before it (its logprobs beside it), every stretch of mask 0 is environment tokens the next request's
    prompt held after them. Returns the environment's stretches."""
    sampled = {}
    for rec in records:
        (choice,) = rec["choices"]
        sampled.setdefault(tuple(rec["prompt_token_ids"]), []).append(choice)
    full = rollout.prompt_ids + rollout.response_ids
    mask = [0] * len(rollout.prompt_ids) + rollout.response_mask
    logprobs = [0.0] * len(rollout.prompt_ids) + rollout.response_logprobs
    pos, glue = len(rollout.prompt_ids), []
    while pos < len(full):
        if mask[pos] == 0:
            end = next((i for i in range(pos, len(full)) if mask[i] == 1), len(full))
            glue.append(full[pos:end])
            assert tuple(full[:end]) in sampled, "environment tokens that no request's prompt held"
            assert logprobs[pos:end] == [0.0] * (end - pos)
            pos = end
            continue
        # A group's requests share their prompt and may sample the same ids; batched in one engine call, their
        # logprobs differ in the last bits. The trained stretch is one of them, ids and logprobs alike.
        candidates = sampled.get(tuple(full[:pos]), [])
        match = next(
            (
                c
                for c in candidates
                if full[pos : pos + len(c["token_ids"])] == c["token_ids"]
                and logprobs[pos : pos + len(c["token_ids"])] == c["logprobs"]
            ),
            None,
        )
        assert match is not None, (
            f"the tokens at {pos} (with their logprobs) are no completion the endpoint sampled for what precedes them"
        )
        candidates.remove(match)
        end = pos + len(match["token_ids"])
        assert mask[pos:end] == [1] * (end - pos)
        pos = end
    return glue


def test_should_train_on_the_tokens_the_endpoint_sampled_with_a_tool_turn_masked_when_the_env_calls_tools(
    serve, ray_local
):
    endpoint = serve()
    _, tok = endpoint
    rollouts, examples, records = _driven(DICE, {"max_turns": 2}, endpoint, n=2, stop=["</tool_call>"])
    # the environment's dataset is the prompts: its rows' messages, in order
    assert [ex["messages"] for ex in examples] == [
        [{"role": "user", "content": f"roll the die, then say its face ({i})"}] for i in range(2)
    ]
    assert len(rollouts) == 4 and [r.example["id"] for r in rollouts][::2] == [ex["id"] for ex in examples]
    roll = tok.convert_tokens_to_ids(ROLL_CALL)
    tool_turns = 0
    for r in rollouts:
        glue = _check_token_exact(r, records)
        assert any(rec["prompt_token_ids"] == r.prompt_ids for rec in records)  # the endpoint's own rendering
        if r.turns == 2:  # the model called the die: its result came back as a tool turn, and it went on
            tool_turns += 1
            (between,) = glue
            text = tok.decode(between)
            assert "<tool_response>" in text and any(f"\n{face}\n" in text for face in "123456"), text
            assert r.response_ids[: r.response_ids.index(between[0])][-1] == roll
        assert r.env_info["turns_dropped"] == 0.0  # the template wrote each call back as it was sampled
        # the rubric's score, and ToolEnv's own count of the calls, came back with the rollout
        assert r.reward.scores["environment"] in (0.0, 1.0)
        assert (
            r.env_info["total_tool_calls"] >= r.turns - 1
            and r.env_info["roll_calls"] == r.env_info["total_tool_calls"]
        )
    assert tool_turns >= 1, "the tilted model never called the die"


def test_should_pay_the_rubric_reward_into_the_advantages_when_the_env_is_single_turn(serve, ray_local):
    endpoint = serve()
    from trainer.algorithms import core_algos
    from trainer.loop.rollout import rewards_of

    rollouts, examples, records = _driven(SUMS, {"num_examples": 4}, endpoint, n=4)
    assert [ex["ground_truth"] for ex in examples] == ["0", "1"]  # its answers are the ground truth
    assert all(r.turns == 1 and r.response_mask == [1] * len(r.response_ids) for r in rollouts)
    for r in rollouts:
        _check_token_exact(r, records)
    # exact (weight 1) + digits (weight 0.5): the rubric's weighted sum, as the environment reward
    rewards = torch.tensor([x.total for x in rewards_of(rollouts)])
    for r, total in zip(rollouts, rewards.tolist()):
        expected = r.env_info["exact"] + 0.5 * r.env_info["digits"]
        assert total == pytest.approx(expected) and math.isfinite(total)
    advantages = core_algos.compute_advantages(rewards, 4, estimator="mean", normalize_std=False)
    grouped = rewards.view(2, 4)
    assert torch.allclose(advantages.view(2, 4), grouped - grouped.mean(dim=1, keepdim=True))


def test_should_end_a_rollout_within_the_sequence_budget_when_its_next_turn_would_not_fit(serve, ray_local):
    from trainer.data.prompts import encode_prompt
    from trainer.envs.verifiers_env import VerifiersEnvironment

    _, tok = serve()
    env = VerifiersEnvironment(DICE, {"max_turns": 5})
    first = encode_prompt(tok, env.examples()[0]["messages"], {}, env.tools())
    budget = (
        len(first) + 6 + 20
    )  # the first turn fits; a second, after a tool's answer (~70 tokens), does not
    rollouts, _, records = _driven(DICE, {"max_turns": 5}, serve(budget), n=2, stop=["</tool_call>"])
    called = [
        r for r in rollouts if r.response_ids and r.response_ids[-1] == tok.convert_tokens_to_ids(ROLL_CALL)
    ]
    assert called, "the tilted model never called the die"
    for r in rollouts:
        assert r.turns == 1 and len(r.prompt_ids) + len(r.response_ids) <= budget
        _check_token_exact(r, records)
    for r in called:  # the endpoint refused the next turn: the rollout ended there, as an error of verifiers'
        assert r.env_info["errors"] == 1.0


# ----- a chat template that rewrites the model's earlier turns ----------------------------------------------
class Scripted:
    """An engine that writes ``turns[k]`` in the turn after ``k`` tool results (the ``<tool_response>``s its prompt
    holds), its ids as the tokenizer makes them (``eos`` after the last turn's), each id's logprob its own."""

    def __init__(self, tok, turns: list[str]):
        self.tok, self.turns = tok, turns

    def ids(self, k: int) -> list[int]:
        ids = self.tok(self.turns[k], add_special_tokens=False)["input_ids"]
        return ids + [self.tok.eos_token_id] if k == len(self.turns) - 1 else ids

    def logprobs(self, k: int) -> list[float]:
        return [-(k + 1) - i / 64 for i in range(len(self.ids(k)))]

    def generate(self, prompts, n, params):
        from trainer.generation.base import Completion

        out = []
        for prompt in prompts:
            k = self.tok.decode(prompt).count("<tool_response>")
            ids = self.ids(k)
            assert len(ids) <= params.max_new_tokens
            text = self.tok.decode(ids, skip_special_tokens=True)
            out.append([Completion(ids, self.logprobs(k), text, "stop") for _ in range(n)])
        return out


@pytest.fixture
def serve_scripted(dice_model, monkeypatch):
    """An endpoint over a :class:`Scripted` engine, its tokenizer's chat template ``template``."""
    from trainer.generation.endpoint import ChatEndpoint
    from trainer.models import load_tokenizer

    monkeypatch.setenv("KUBERL_TEST_ENDPOINT_TOKEN", TOKEN)
    started = []

    def start(template: str, turns: list[str]):
        tok = load_tokenizer(dice_model)
        tok.chat_template = template
        ep_cfg = EndpointConfig(
            enabled=True, port=0, bind="127.0.0.1", token_env="KUBERL_TEST_ENDPOINT_TOKEN"
        )
        gen = GenerationConfig(max_new_tokens=48, placement="disaggregated", endpoint=ep_cfg)
        engine = Scripted(tok, turns)
        ep = ChatEndpoint(engine, tok, gen, "dice", max_model_len=4096)
        started.append(ep)
        ep.start()
        return ep, tok, engine

    yield start
    for ep in started:
        ep.shutdown()


@pytest.mark.parametrize(
    "template, turns",
    [
        (THINK_TEMPLATE, ["<think>roll it</think>" + ROLL_CALL, "<think>once more</think>" + ROLL_CALL, "<think>so</think>4"]),
        (SPACED_TEMPLATE, ["i roll" + ROLL_CALL, ROLL_CALL, "it is 4"]),
    ],
    ids=["think-stripped", "call-respaced"],
)  # fmt: skip
def test_should_keep_every_turn_of_an_episode_token_exact_when_the_template_rewrites_the_models_earlier_turns(
    serve_scripted, ray_local, template, turns
):
    from trainer.data.prompts import encode_prompt
    from trainer.envs.verifiers_env import VerifiersEnvironment

    ep, tok, engine = serve_scripted(template, turns)
    rollouts, examples, records = _driven(
        DICE, {"max_turns": 3}, (ep, tok), n=2, stop=["</tool_call>"], max_new_tokens=48
    )
    tools = VerifiersEnvironment(DICE, {"max_turns": 3}).tools()
    # What the template writes after a tool call the model sampled (no end-of-turn token: the stop string ended
    # it), for each face the die may show: the only tokens of the sample that are not the engine's.
    glue = [
        tok(
            f"<|im_end|>\n<|im_start|>user\n<tool_response>\n{face}\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n",
            add_special_tokens=False,
        )["input_ids"]
        for face in "123456"
    ]
    assert len(rollouts) == 4
    for r, ex in zip(rollouts, [e for e in examples for _ in range(2)]):
        assert (r.turns, r.env_info["turns"], r.env_info["turns_dropped"]) == (3, 3.0, 0.0)
        assert r.prompt_ids == encode_prompt(tok, ex["messages"], {}, tools)
        pos, tokens, mask, logprobs = 0, [], [], []
        for k in range(3):
            tokens += engine.ids(k)
            mask += [1] * len(engine.ids(k))
            logprobs += engine.logprobs(k)
            pos = len(tokens)
            if k < 2:
                between = next(g for g in glue if r.response_ids[pos : pos + len(g)] == g)
                tokens += between
                mask += [0] * len(between)
                logprobs += [0.0] * len(between)
        assert r.response_ids == tokens and r.response_mask == mask and r.response_logprobs == logprobs
        _check_token_exact(r, records)
        assert r.env_info["total_tool_calls"] == 2.0
    # every later turn's prompt was built from the ids sampled before it, none rendered whole
    assert (ep.continued, ep.unmatched) == (8, 0)
    assert sum(rec["extends"] is not None for rec in records) == 8
    # the template did rewrite them: rendered whole, a later turn's prompt would not hold the sampled ids
    later = next(rec for rec in records if rec["extends"] is not None)
    whole = encode_prompt(tok, later["messages"], {}, tools)
    assert whole != later["prompt_token_ids"]


# ----- the acceptance: a few steps through the real entry point ---------------------------------------------
STEPS = 3


@pytest.mark.slow
def test_should_train_a_few_steps_when_the_environment_is_a_verifiers_one(trainer_env, tmp_path):
    from tests.conftest import REPO

    # A Ray instance of the run's own; no endpoint token in the environment: the driver makes one for the run and
    # hands it to the generation actors and to the verifiers harness it drives.
    env = {k: v for k, v in trainer_env.items() if k not in ("RAY_ADDRESS", "KUBERL_ENDPOINT_TOKEN")}
    logs = tmp_path / "logs"
    proc = subprocess.run(
        [
            sys.executable, "-m", "trainer", "experiment=tiny",
            f"env.verifiers.id={SUMS}", "env.verifiers.args={num_examples: 6}", "data.name=verifiers",
            "env.reward_functions=[{name: environment, weight: 1.0}, {name: arithmetic, weight: 0.5}]",
            "generation.placement=disaggregated", "generation.endpoint.enabled=true",
            "generation.endpoint.port=0",
            # one step stale: the environment runs the next batch in the producer thread while the policy trains
            "grpo.async.max_staleness=1",
            f"grpo.max_num_steps={STEPS}", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4",
            "generation.max_new_tokens=2", "cluster.cpu_workers_per_node=1", "checkpointing.enabled=false",
            f"logger.log_dir={logs}",
        ],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = list((logs / "tiny").iterdir())
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    scalars = {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert len(scalars["train/reward_mean"]) == STEPS
    # the rubric's reward as the environment entry, beside ours by weight
    for step in range(STEPS):
        rubric = scalars["train/verifiers/exact"][step] + 0.5 * scalars["train/verifiers/digits"][step]
        assert scalars["train/reward/environment"][step] == pytest.approx(rubric, abs=1e-5)
        assert scalars["train/reward_mean"][step] == pytest.approx(
            scalars["train/reward/environment"][step] + 0.5 * scalars["train/reward/arithmetic"][step],
            abs=1e-5,
        )
    assert scalars["train/verifiers/turns"] == [1.0] * STEPS
    assert max(scalars["train/staleness_max"]) <= 1.0
    rows = [json.loads(line) for line in (run_dir / "train_data_step1.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all(r["prompt"].endswith("=") or "=" in r["prompt"] for r in rows)
