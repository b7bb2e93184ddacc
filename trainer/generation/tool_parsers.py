"""Tool calls in every family's format: ``env.tool_parser`` picks the parser, vLLM's own for all but Hermes.

``hermes`` (the default) is :mod:`trainer.envs.tool_calls`' parser: ``<tool_call>{json}</tool_call>``, with an
error the model reads for each call it wrote malformed, and no vLLM needed (the hf backend runs without it). Any
other name is a parser of vLLM's registry (``ToolParserManager``: ``llama3_json``, ``mistral``, ``pythonic``,
``qwen3_coder``, ``qwen3_xml``, ...), the same code vLLM's OpenAI server runs for ``--tool-call-parser``, built
as the server builds it: on the model's tokenizer and the tools offered, and called with a chat request that
carries those tools. Such a parser reads a call or, when what the model wrote is not one it can read, treats it
as the turn's text (it has no per-call error to give back): the turn then ends the episode, as the server would
answer it with no ``tool_calls``. Its logs of such misses are silenced: a policy in training writes thousands.

:func:`check` runs at start-up (an unknown name lists the valid ones, in one line); :func:`build` makes the
parser; :func:`parser_text` is the text both read. vLLM is imported only for a name other than ``hermes``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import threading
from typing import Any

from trainer.config import ConfigError
from trainer.envs.tool_calls import HERMES, HermesParser, ToolCallParser

# vLLM's loggers of tool-call parsing (its legacy parsers' modules, and the engine-based parsers' grammars)
_VLLM_PARSER_LOGGERS = ("vllm.tool_parsers", "vllm.parser")


def parser_text(tokenizer: Any, ids: list[int], ended_by_token: bool) -> str:
    """The text a tool parser reads: ``ids`` decoded with special tokens kept, since some families' call markers
    are special tokens (Mistral's ``[TOOL_CALLS]``, Llama's ``<|python_tag|>``, ``<tool_call>`` where a
    tokenizer adds it as special) and vLLM's server keeps them for its parsers too. ``ended_by_token``: the last
    id is the token that ended the turn (an EOS, a stop token id), left out as vLLM's detokenizer leaves it out;
    a parser that reads the whole turn (pythonic's list) fails on ``[f(x=1)]<|eom_id|>``."""
    return tokenizer.decode(ids[:-1] if ended_by_token and ids else ids, skip_special_tokens=False)


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def names() -> list[str]:
    """Every valid env.tool_parser: the built-in ``hermes``, then vLLM's registry (when vLLM is installed)."""
    if not vllm_available():
        return [HERMES]
    from vllm.tool_parsers import ToolParserManager

    return [HERMES, *(n for n in ToolParserManager.list_registered() if n != HERMES)]


def check(name: str) -> None:
    """ConfigError (one line) unless ``name`` is a valid env.tool_parser here."""
    if name == HERMES:
        return
    if not vllm_available():
        raise ConfigError(
            f"env.tool_parser={name} names a vLLM tool parser (only {HERMES} is built in), and vLLM is not installed here: install it "
            f"(`make setup`, or pip install 'kuberl-trainer[vllm]') or set env.tool_parser={HERMES}"
        )
    valid = names()
    if name not in valid:
        raise ConfigError(
            f"env.tool_parser={name!r} is not a tool parser; valid: {HERMES} (built in), {', '.join(valid[1:])}"
        )


def build(name: str, tokenizer: Any, tools: list[dict[str, Any]] | None) -> ToolCallParser:
    """The parser ``name`` (:func:`check`) for a model with ``tokenizer`` offered ``tools`` (OpenAI function
    schemas); ConfigError (one line) when vLLM's parser refuses this tokenizer (its call marker is not in it)."""
    check(name)
    if name == HERMES:
        return HermesParser()
    return VLLMToolParser(name, tokenizer, tools)


class VLLMToolParser:
    """One of vLLM's tool parsers as a :class:`~trainer.envs.tool_calls.ToolCallParser` (module docstring)."""

    def __init__(self, name: str, tokenizer: Any, tools: list[dict[str, Any]] | None):
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionRequest,
            ChatCompletionToolsParam,
        )
        from vllm.tool_parsers import ToolParserManager

        self.name = name
        params: list[Any] = [ChatCompletionToolsParam.model_validate(t) for t in tools or []]
        try:
            self._parser = ToolParserManager.get_tool_parser(name)(tokenizer, params)
        except (RuntimeError, ValueError, KeyError) as e:  # e.g. "could not locate the bot token"
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"env.tool_parser={name}: vLLM's parser refuses this model's tokenizer ({first}); "
                "choose the parser of the model's family"
            ) from None
        # What the server hands the parser: a chat request with the tools offered, as its parser adjusted it.
        request = ChatCompletionRequest.model_validate({"messages": [], "tools": params or None})
        self._request: Any = self._parser.adjust_request(request)
        for logger in _VLLM_PARSER_LOGGERS:
            logging.getLogger(logger).setLevel(logging.CRITICAL)
        # Episodes step in threads of their own, and a parser object may keep state between calls.
        self._lock = threading.Lock()

    def parse(self, text: str) -> tuple[list[dict[str, Any]], list[str]]:
        calls, errors, _ = self.read(text)
        return calls, errors

    def read(self, text: str) -> tuple[list[dict[str, Any]], list[str], str | None]:
        """:meth:`parse`, and the turn's content beside its calls as vLLM's parser reads it (None: none)."""
        try:
            with self._lock:
                info = self._parser.extract_tool_calls(text, self._request)
        except Exception as e:  # what the model wrote must not crash the episode: the model reads why instead
            return (
                [],
                [
                    f"the tool call could not be read by the {self.name} parser ({type(e).__name__}: {e})"[
                        :300
                    ]
                ],
                None,
            )
        if not info.tools_called:
            return [], [], info.content
        calls: list[dict[str, Any]] = []
        errors: list[str] = []
        for call in info.tool_calls:
            name, written = call.function.name, call.function.arguments
            if not name:
                errors.append(f"a tool call has no function name: {written[:200]}")
                continue
            try:
                arguments = json.loads(written) if written.strip() else {}
            except json.JSONDecodeError:
                errors.append(f"the arguments of the call to {name!r} are not JSON: {written[:200]}")
                continue
            if not isinstance(arguments, dict):
                errors.append(
                    f"the arguments of the call to {name!r} must be a JSON object, not {type(arguments).__name__}"
                )
                continue
            calls.append({"name": name, "arguments": arguments})
        return calls, errors, (info.content or "").strip() or None
