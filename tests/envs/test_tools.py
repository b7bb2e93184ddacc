"""The tools environment: schemas from signatures, calls run in a child process bounded in time and memory, and
every failure (a malformed call, an unknown tool, a hostile argument) an error message for the model, never a
crash or a hang. The calculator computes exactly and refuses what is not arithmetic or would not end."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from trainer.config import ConfigError
from trainer.envs import build, check
from trainer.envs.tools import ToolEnvironment, calculator, stop_processes


@pytest.fixture(autouse=True)
def _tool_processes():
    yield
    stop_processes()


def _call(name, **arguments):
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.mark.parametrize(
    "expression, result",
    [
        ("123 * 456", "56088"),
        ("(2 + 3) ** 2", "25"),
        ("7 / 2", "3.5"),
        ("-8 // 3", "-3"),
        ("10 % 4", "2"),
        ("2 ** 100", str(2**100)),
        ("1.5 * 4", "6"),
        ("999999999999 * 999999999999", str(999999999999**2)),
    ],
)
def test_should_compute_exactly_when_the_expression_is_arithmetic(expression, result):
    assert calculator(expression) == result


@pytest.mark.parametrize(
    "expression",
    [
        "9 ** 9 ** 9",
        "10 ** 1000",
        "__import__('os').system('true')",
        "().__class__",
        "x + 1",
        "1 / 0",
        "'a' * 10",
        "[1] * 10**9",
        "abs(-1)",
        "1 +",
        "(-8) ** 0.5",
        "1" * 600,
    ],
)
def test_should_refuse_with_an_error_when_the_expression_is_not_bounded_arithmetic(expression):
    with pytest.raises(ValueError):
        calculator(expression)


def test_should_offer_schemas_built_from_signatures_and_docstrings():
    env = build("tools", {"tools": ["calculator", "tests.envs.tool_funcs:lookup"]})
    (calc, lookup) = env.tools()
    assert calc["function"]["name"] == "calculator"
    assert calc["function"]["parameters"]["required"] == ["expression"]
    assert lookup["function"]["parameters"]["properties"]["count"]["type"] == "integer"
    assert lookup["function"]["parameters"]["required"] == ["key"]


@pytest.mark.integration  # calls tools in processes of their own
def test_should_take_a_given_schema_when_the_function_has_none():
    schema = {"type": "function", "function": {"name": "echo", "parameters": {"type": "object"}}}
    env = ToolEnvironment(tools=[{"function": "tests.envs.tool_funcs:undocumented", "schema": schema}])
    assert env.tools() == [schema]
    step = env.episode({}).step(_call("echo", x="hi"))
    assert step.messages == [{"role": "tool", "name": "echo", "content": "hi"}]


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({}, "tools must be a non-empty list"),
        ({"tools": []}, "tools must be a non-empty list"),
        ({"tools": ["no_such_module_x:f"]}, "tools[0]='no_such_module_x:f': cannot import"),
        ({"tools": ["calculator", "nocolon"]}, "tools[1]='nocolon'"),
        ({"tools": ["tests.envs.tool_funcs:undocumented"]}, "no schema from its signature and docstring"),
        ({"tools": ["calculator", "calculator"]}, "a second tool named 'calculator'"),
        ({"tools": [{"fn": "x"}]}, "expected {function: module:function"),
        ({"tools": ["calculator"], "tool_timeout_s": 0}, "tool_timeout_s=0"),
        ({"tools": ["calculator"], "max_calls_per_turn": 0}, "max_calls_per_turn=0"),
        ({"tools": ["calculator"], "bogus": 1}, "env.environment_kwargs for 'tools'"),
    ],
)
def test_should_refuse_bad_kwargs_in_one_line_when_the_environment_is_built(kwargs, says):
    with pytest.raises(ConfigError, match=None) as e:
        build("tools", kwargs)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_should_list_the_environments_when_the_name_is_unknown():
    with pytest.raises(ConfigError) as e:
        check("toolz")
    assert "code_feedback" in str(e.value) and "tools" in str(e.value)


@pytest.mark.integration  # calls tools in processes of their own
def test_should_run_calls_and_count_them_when_the_model_calls_tools():
    env = ToolEnvironment(tools=["calculator", "tests.envs.tool_funcs:lookup"])
    step = env.episode({}).step(
        "let me see " + _call("calculator", expression="12*34") + _call("lookup", key="ab", count=2)
    )
    assert not step.done
    assert step.messages[0] == {"role": "tool", "name": "calculator", "content": "408"}
    assert step.messages[1]["content"] == '{"key": "ab", "values": ["AB", "AB"]}'  # JSON for non-strings
    assert step.info["tool_calls"] == 2 and step.info["tool_errors"] == 0 and step.info["tool_s"] > 0


def test_should_end_the_episode_when_the_model_answers_without_a_call():
    step = ToolEnvironment(tools=["calculator"]).episode({}).step("The answer is 408.")
    assert step.done and step.messages == [] and step.reward is None


@pytest.mark.parametrize(
    "text, says",
    [
        ("<tool_call>{not json}</tool_call>", "Error: the tool call is not valid JSON"),
        (_call("nope"), "Error: there is no tool 'nope'; the tools are calculator"),
        (_call("calculator", expr="1"), "Error: TypeError"),
        (_call("calculator", expression="9**9**9"), "Error: ValueError: exponent"),
    ],
)
@pytest.mark.integration  # calls tools in processes of their own
def test_should_answer_with_an_error_message_when_a_call_fails(text, says):
    step = ToolEnvironment(tools=["calculator"]).episode({}).step(text)
    assert not step.done and step.info["tool_errors"] == 1
    (message,) = step.messages
    assert message["role"] == "tool" and message["content"].startswith(says)


@pytest.mark.integration  # calls tools in processes of their own
def test_should_run_only_max_calls_per_turn_when_a_turn_makes_more():
    env = ToolEnvironment(tools=["calculator"], max_calls_per_turn=2)
    step = env.episode({}).step("".join(_call("calculator", expression=f"{i}+1") for i in range(4)))
    assert [m["content"] for m in step.messages[:2]] == ["1", "2"]
    assert all("at most 2 tool calls" in m["content"] for m in step.messages[2:])
    assert step.info["tool_errors"] == 2


@pytest.mark.parametrize(
    "call, says",
    [
        (_call("sleepy", seconds=60), "timed out after 1s"),
        (_call("hog", megabytes=4096), "Error: MemoryError"),
        (_call("crash"), "process died"),
    ],
)
@pytest.mark.integration  # calls tools in processes of their own
def test_should_bound_a_hostile_call_and_keep_serving_when_a_tool_hangs_eats_memory_or_dies(call, says):
    env = ToolEnvironment(
        tools=[
            "calculator",
            "tests.envs.tool_funcs:sleepy",
            "tests.envs.tool_funcs:hog",
            "tests.envs.tool_funcs:crash",
        ],
        tool_timeout_s=1,
        tool_memory_mb=512,
    )
    episode = env.episode({})
    t0 = time.monotonic()
    step = episode.step(call)
    assert time.monotonic() - t0 < 10
    assert says in step.messages[0]["content"] and step.info["tool_errors"] == 1
    assert episode.step(_call("calculator", expression="2*21")).messages[0]["content"] == "42"


@pytest.mark.integration  # calls tools in processes of their own
def test_should_cut_a_long_result_and_say_so():
    env = ToolEnvironment(tools=["tests.envs.tool_funcs:lookup"], max_result_chars=40)
    (message,) = env.episode({}).step(_call("lookup", key="k", count=100)).messages
    assert message["content"].endswith("(cut at 40 characters)") and len(message["content"]) < 80


@pytest.mark.integration  # calls tools in processes of their own
def test_should_run_python_in_the_sandbox_when_the_python_tool_is_called():
    env = ToolEnvironment(tools=["python"], tool_timeout_s=20)
    (message,) = env.episode({}).step(_call("python", code="print(6 * 7)")).messages
    assert message["content"] == "42"
    (message,) = env.episode({}).step(_call("python", code="raise SystemExit('boom')")).messages
    assert "runtime error" in message["content"]


def test_should_refuse_the_python_tool_when_the_cluster_keeps_code_on_sandbox_nodes(monkeypatch):
    monkeypatch.setenv("KUBERL_SANDBOX_RESOURCE", "kuberl-sandbox")
    with pytest.raises(ConfigError, match="drop the python tool"):
        ToolEnvironment(tools=["calculator", "python"])
    assert ToolEnvironment(tools=["calculator"]).tools()


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (an exited process not yet reaped by whoever adopted it does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.parametrize("seconds, says", [(60, "Error: the call timed out after 2s"), (0, "started")])
@pytest.mark.integration  # calls tools in processes of their own
def test_should_kill_what_a_tool_started_when_its_call_times_out_or_returns(tmp_path, seconds, says):
    env = ToolEnvironment(tools=["tests.envs.tool_funcs:background"], tool_timeout_s=2)
    pid_file = tmp_path / "pid"
    (message,) = env.episode({}).step(_call("background", path=str(pid_file), seconds=seconds)).messages
    assert message["content"] == says
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10  # SIGKILL is delivered at once; the generous wait is for a busy machine
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(pid), f"the tool's background sleep (pid {pid}) outlived its call"


@pytest.mark.integration  # calls tools in processes of their own
def test_should_run_a_call_in_its_own_process_group_under_memory_cpu_and_process_limits():
    env = ToolEnvironment(
        tools=["tests.envs.tool_funcs:limits"], tool_timeout_s=7.5, tool_memory_mb=600, tool_max_processes=9
    )
    (message,) = env.episode({}).step(_call("limits")).messages
    got = json.loads(message["content"])
    assert got["pgid"] == got["pid"] == got["sid"] and got["pid"] != os.getpid()
    assert got["as"] == [600 << 20, 600 << 20]
    assert got["cpu"] == [8, 9]  # the timeout rounded up, then SIGKILL a second later
    soft, hard = got["nproc"]
    assert soft == hard and 9 < soft < 10**6  # what the uid ran at the call's start, and 9 more


@pytest.mark.integration  # calls tools in processes of their own
def test_should_end_a_call_that_computes_past_its_cpu_limit_before_its_timeout():
    env = ToolEnvironment(tools=["tests.envs.tool_funcs:spin"], tool_timeout_s=120, tool_cpu_s=1)
    t0 = time.monotonic()
    (message,) = env.episode({}).step(_call("spin")).messages
    assert time.monotonic() - t0 < 60
    assert "process died" in message["content"] and "CPU time (1s)" in message["content"]


@pytest.mark.skipif(os.geteuid() == 0, reason="the kernel does not enforce RLIMIT_NPROC for root")
def test_should_refuse_a_call_more_threads_than_its_process_limit():
    env = ToolEnvironment(tools=["tests.envs.tool_funcs:threads"], tool_max_processes=8)
    (message,) = env.episode({}).step(_call("threads", count=64)).messages
    assert message["content"].startswith("Error: RuntimeError: can't start new thread")
    (message,) = env.episode({}).step(_call("threads", count=2)).messages
    assert message["content"] == "2"
