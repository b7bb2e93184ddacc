"""Tool calls in the model's text, Hermes style (Qwen2.5, Hermes, SmolLM3 and most open chat templates).

A call is a JSON object between ``<tool_call>`` and ``</tool_call>``::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "123 * 456"}}
    </tool_call>

:func:`parse_tool_calls` finds every call in a turn and returns the well-formed ones and, for each
malformed one, an error meant for the model (it is sent back as the tool's answer, so the model can fix
its call; the run never fails on what the model wrote). A call the model left open (its turn ended, or a
stop string cut it, before ``</tool_call>``) is its first JSON object after ``<tool_call>``.

:func:`render_tools` writes the tools' schemas into a system prompt in the same format, for a chat template
that has no ``tools=`` support of its own (:func:`takes_tools` tells; :func:`offer_tools` adds that prompt to a
conversation); :func:`content_of` is the turn's text without its calls (an
OpenAI-style assistant message's ``content``).

Other families write their calls otherwise (Llama 3's bare JSON, Mistral's ``[TOOL_CALLS]``, Qwen3-Coder's XML,
pythonic lists): ``env.tool_parser`` names one of vLLM's parsers for them
(:mod:`trainer.generation.tool_parsers`), handed to the environment as a :class:`ToolCallParser`; this module's
parser is the default, ``hermes``. Either reads a turn decoded with its special tokens kept, since some families'
markers are special tokens (:attr:`trainer.generation.base.Completion.raw_text`).
"""

from __future__ import annotations

import json
import re
from typing import Any, Protocol

OPEN, CLOSE = "<tool_call>", "</tool_call>"
HERMES = "hermes"  # env.tool_parser's default: the parser below
_CALL = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)
_SHOWN = 200  # characters of a malformed call quoted back to the model


def _quote(body: str) -> str:
    body = body.strip()
    return body if len(body) <= _SHOWN else body[:_SHOWN] + "..."


def _one(body: str, closed: bool) -> tuple[dict[str, Any] | None, str | None]:
    """One call's JSON -> ({name, arguments}, None) or (None, the error for the model). A call left open
    ends at its JSON object: what follows is the model's text, not part of the call."""
    try:
        if closed:
            obj = json.loads(body)
        else:
            obj, _ = json.JSONDecoder().raw_decode(body.lstrip())
    except json.JSONDecodeError as e:
        return None, f"the tool call is not valid JSON ({e.msg} at character {e.pos}): {_quote(body)}"
    if not isinstance(obj, dict):
        return (
            None,
            f'a tool call must be a JSON object {{"name": ..., "arguments": {{...}}}}: {_quote(body)}',
        )
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None, f'the tool call has no "name" string: {_quote(body)}'
    args = obj.get("arguments", obj.get("parameters", {}))
    # Some models write the arguments as a JSON string, as OpenAI's API carries them.
    if isinstance(written := args, str):
        try:
            args = json.loads(written) if written.strip() else {}
        except json.JSONDecodeError:
            return None, f'the "arguments" of the call to {name!r} are not a JSON object: {_quote(written)}'
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return (
            None,
            f'the "arguments" of the call to {name!r} must be a JSON object, not {type(args).__name__}',
        )
    return {"name": name, "arguments": args}, None


def parse_tool_calls(text: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The calls in ``text``, in order: (calls as ``{"name", "arguments"}``, one error per malformed call).
    A stray ``</tool_call>`` with no opening marker is an error too: the model meant a call."""
    calls, errors = [], []
    for match in _CALL.finditer(text):
        call, error = _one(match.group(1), match.group(0).endswith(CLOSE))
        if call is not None:
            calls.append(call)
        else:
            errors.append(error or "malformed tool call")
    if not calls and not errors and CLOSE in text:
        errors.append(f"a tool call must start with {OPEN} and end with {CLOSE}")
    return calls, errors


class ToolCallParser(Protocol):
    """The tool calls in one model turn, in one family's format."""

    name: str  # env.tool_parser's value

    def parse(self, text: str) -> tuple[list[dict[str, Any]], list[str]]:
        """``text`` (a turn decoded with special tokens kept) -> (calls as ``{"name", "arguments"}`` with
        ``arguments`` a dict, one error per call the model wrote but could not be read, meant for the model)."""
        ...


class HermesParser:
    """:func:`parse_tool_calls` as a :class:`ToolCallParser`: env.tool_parser=hermes, the default."""

    name = HERMES

    def parse(self, text: str) -> tuple[list[dict[str, Any]], list[str]]:
        return parse_tool_calls(text)


def content_of(text: str) -> str:
    """``text`` without its tool calls (what an assistant message's ``content`` holds beside ``tool_calls``)."""
    return _CALL.sub("", text).strip()


def takes_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders ``tools=`` itself (it reads a ``tools`` variable)."""
    template = tokenizer.chat_template
    if isinstance(template, dict):  # named templates: the default one renders plain chats
        template = template.get("default", "")
    return "tools" in (template or "")


def offer_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with :func:`render_tools`'s prompt in their system turn (after its own text, or a new one)."""
    prompt = render_tools(tools)
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def render_tools(tools: list[dict[str, Any]]) -> str:
    """A system prompt offering ``tools`` (OpenAI function schemas) in the call format parsed here, for a
    chat template without ``tools=`` support."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You can call functions to help answer the user. The functions are listed, one JSON schema a line, "
        f"between <tools> and </tools>:\n<tools>\n{listed}\n</tools>\n"
        "To call a function, write a JSON object with its name and arguments between "
        f'{OPEN} and {CLOSE}, for example:\n{OPEN}\n{{"name": "<function name>", "arguments": '
        f"{{<arguments as a JSON object>}}}}\n{CLOSE}\nThe result comes back in the next turn. "
        "When you have the answer, write it without a tool call."
    )
