"""What the environment tests share: a tools-capable chat template of our own (Hermes style), a tiny model
whose character vocabulary can write tool calls, and environments and generators for tests."""

from __future__ import annotations

import random
from typing import Any

import ray

from trainer.envs.base import Step
from trainer.envs.tools import calculator
from trainer.models.tiny import DEFAULT_VOCAB_CHARS

# Enough characters to write and read a Hermes call: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
TOOL_VOCAB_CHARS = DEFAULT_VOCAB_CHARS + '<>{}[]"_!#'

# Tools in a system turn, tool results inside <tool_response> in a user turn (consecutive results share one),
# as Hermes-style templates lay them out; written here, for these tests.
TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{ 'you can call these tools:\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"
    '{{ \'\\n</tools>\\ncall one as <tool_call>{"name": name, "arguments": {...}}</tool_call><|im_end|>\\n\' }}'
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{%- endif %}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tools_model(out_dir: str, **kwargs: Any) -> str:
    """A tiny random Llama (trainer.models.tiny) whose tokenizer can write tool calls and has TOOLS_TEMPLATE."""
    from transformers import AutoTokenizer

    from trainer.models.tiny import build_tiny_model

    build_tiny_model(out_dir, vocab_chars=TOOL_VOCAB_CHARS, **kwargs)
    tok = AutoTokenizer.from_pretrained(out_dir)
    tok.chat_template = TOOLS_TEMPLATE
    tok.save_pretrained(out_dir)
    return out_dir


class ToolEveryTurn:
    """An environment that answers every model turn with a calculator result (the turn's length squared),
    until ``turns`` turns: a random model never writes a call, and a multi-turn episode must still happen."""

    name = "tool_every_turn"

    def __init__(self, turns: int = 3):
        self.turns = turns

    def tools(self) -> list[dict[str, Any]] | None:
        from transformers.utils import get_json_schema

        return [get_json_schema(calculator)]

    def episode(self, example: dict[str, Any]) -> _Episode:
        return _Episode(self.turns)


class _Episode:
    def __init__(self, turns: int):
        self.left = turns

    def step(self, text: str) -> Step:
        self.left -= 1
        if self.left <= 0:
            return Step([], done=True, reward=1.0)
        return Step(
            [tool_message(text)], done=False, info={"tool_calls": 1.0, "tool_errors": 0.0, "tool_s": 0.0}
        )

    def close(self) -> None:
        pass


def tool_message(text: str) -> dict[str, Any]:
    return {"role": "tool", "name": "calculator", "content": calculator(f"{len(text)}**2")}


class RecordingGenerator:
    """A generator over one engine in this process that records every call: (prompts, n, completions)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def submit(self, prompts, n, params):
        out = self.engine.generate(prompts, n, params)
        self.calls.append(([list(p) for p in prompts], n, out))
        return [(ray.put(out), list(range(len(prompts))))]


# The whole call to the die as one token of its own, so that a random tiny model writes it often enough to learn.
ROLL_CALL = '<tool_call>{"name": "roll", "arguments": {}}</tool_call>'


def build_dice_model(out_dir: str) -> str:
    """The tools model (:func:`build_tools_model`) with ROLL_CALL added to its vocabulary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    build_tools_model(out_dir)
    tok = AutoTokenizer.from_pretrained(out_dir)
    tok.add_tokens([ROLL_CALL])
    model = AutoModelForCausalLM.from_pretrained(out_dir)
    model.resize_token_embeddings(len(tok))
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


class DiceTools:
    """The tools environment with one tool, a die (``roll``), scoring its own episodes: half for an answer after
    a call that ran, half more when the answer is the digit the die last showed. Only the tool's reply holds
    that digit.

    The die is seeded, so a run repeats: each episode rolls with a generator of its own, drawn from ``seed``
    in the order the rollout loop opens episodes (a fixed order). The call still runs through the tool
    server; its reply's digit is the episode's roll, in place of the server's unseeded one."""

    name = "dice"

    def __init__(self, seed: int = 0, **kwargs: Any):
        from trainer.envs.tools import ToolEnvironment

        self.tools_env = ToolEnvironment(tools=["tests.envs.tool_funcs:roll"], **kwargs)
        self.dice = random.Random(seed)

    def tools(self) -> list[dict[str, Any]] | None:
        return self.tools_env.tools()

    def episode(self, example: dict[str, Any]) -> _DiceEpisode:
        return _DiceEpisode(self.tools_env.episode(example), random.Random(self.dice.getrandbits(64)))

    def close(self) -> None:
        self.tools_env.close()


class _DiceEpisode:
    def __init__(self, inner, die: random.Random):
        self.inner, self.die, self.shown = inner, die, None

    def step(self, text: str) -> Step:
        step = self.inner.step(text)
        for message in step.messages:
            if not message["content"].startswith("Error"):
                message["content"] = self.shown = str(self.die.randrange(10))
        # Scored at every step: the loop keeps the last one's, also when it cuts the episode at its turn limit.
        # Half for answering after a call that ran (a call in the last turn is no answer), half for the digit.
        answered = step.done and self.shown is not None
        step.reward = 0.5 * answered + 0.5 * (answered and text.strip() == self.shown)
        return step

    def close(self) -> None:
        self.inner.close()
