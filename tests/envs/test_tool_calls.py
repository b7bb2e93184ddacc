"""Hermes-style tool calls: well-formed ones parsed, malformed ones turned into errors for the model."""

from __future__ import annotations

import json

import pytest

from trainer.envs.tool_calls import content_of, parse_tool_calls, render_tools


def test_should_parse_every_call_in_order_when_a_turn_makes_several():
    text = (
        'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>\n'
        '<tool_call>{"name": "lookup", "arguments": {"key": "a", "n": 2}}</tool_call>'
    )
    calls, errors = parse_tool_calls(text)
    assert errors == []
    assert calls == [
        {"name": "calculator", "arguments": {"expression": "2*3"}},
        {"name": "lookup", "arguments": {"key": "a", "n": 2}},
    ]
    assert content_of(text) == "Let me compute."


def test_should_read_an_unclosed_call_to_the_end_when_the_turn_stopped_inside_it():
    calls, errors = parse_tool_calls(
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n'
    )
    assert calls == [{"name": "calculator", "arguments": {"expression": "1+1"}}] and errors == []


def test_should_accept_arguments_written_as_a_json_string_when_a_model_follows_openais_wire_format():
    calls, errors = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert calls == [{"name": "f", "arguments": {"x": 1}}] and errors == []


def test_should_find_no_call_and_no_error_when_the_model_just_answers():
    assert parse_tool_calls("The answer is 42.") == ([], [])


@pytest.mark.parametrize(
    "body, says",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"arguments": {}}', 'no "name"'),
        ('{"name": "", "arguments": {}}', 'no "name"'),
        ('{"name": "f", "arguments": [1]}', "must be a JSON object, not list"),
        ('{"name": "f", "arguments": "nope"}', "are not a JSON object"),
        ("", "not valid JSON"),
    ],
)
def test_should_return_an_error_for_the_model_when_a_call_is_malformed(body, says):
    calls, errors = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert calls == [] and len(errors) == 1 and says in errors[0]


def test_should_keep_the_good_calls_when_one_of_them_is_malformed():
    calls, errors = parse_tool_calls('<tool_call>{"name": "a"}</tool_call><tool_call>{oops}</tool_call>')
    assert calls == [{"name": "a", "arguments": {}}] and len(errors) == 1


def test_should_call_a_closing_marker_without_an_opening_one_an_error():
    assert parse_tool_calls('{"name": "a"}</tool_call>')[1]


def test_should_quote_a_long_malformed_call_only_in_part():
    (error,) = parse_tool_calls("<tool_call>{" + "x" * 10_000 + "</tool_call>")[1]
    assert len(error) < 400


def test_should_list_each_schema_and_the_call_format_when_rendering_tools_into_a_prompt():
    schema = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}
    text = render_tools([schema])
    assert json.dumps(schema) in text and "<tool_call>" in text and "</tool_call>" in text
    # the example call in the prompt is in the format the parser reads
    example = text[text.index("<tool_call>") :]
    assert "<function name>" in example
