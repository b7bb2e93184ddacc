"""The ``tools`` environment: the model calls functions between its turns and reads their results.

``env.environment: tools`` with ``env.environment_kwargs``:

- ``tools``: a list of ``calculator`` / ``python`` (the built-ins below), ``module:function``, or
  ``{function: module:function, schema: {...}}`` for a function whose signature and docstring do not
  make a schema. Otherwise the schema (OpenAI function format) comes from the signature and Google-style
  docstring, by transformers' ``get_json_schema``, and is offered to the model through the chat template's
  own ``tools=`` (:mod:`trainer.data.prompts`).
- ``max_calls_per_turn`` (4): calls beyond it in one turn are answered with an error, not run.
- ``tool_timeout_s`` (5): wall-clock seconds per call; ``tool_memory_mb`` (1024): address space per call;
  ``tool_cpu_s`` (null: the timeout, rounded up): CPU seconds per process of a call; ``tool_max_processes``
  (64): processes and threads a call may add.
- ``max_result_chars`` (1000): a longer result is cut, and says so.

After each model turn the episode parses its calls, Hermes-style (:mod:`trainer.envs.tool_calls`) unless
``env.tool_parser`` names another family's format (the run hands the environment that parser,
:meth:`ToolEnvironment.use_tool_parser`), runs them and answers with one ``tool`` message per call, a malformed
or unknown call included (its error is the message, so the model can fix it). A turn with no call is the model's answer and ends the episode; the
rollout loop also ends it at ``grpo.max_rollout_turns`` or when the sample's token budget is spent.

Each call runs in a child process forked from a clean server process (multiprocessing's ``forkserver``:
no threads of the driver come along), in a process group of its own, under memory, CPU-time and
process-count limits (``RLIMIT_AS``, ``RLIMIT_CPU``, ``RLIMIT_NPROC``), and its whole group is killed when the
call ends, at its timeout or with its answer: a process the tool started (a ``sleep`` in the background) does
not outlive the call, and an argument that makes a tool loop, hang, fork or eat memory costs that call an error
message, never the run. There is no in-process path: a tool always runs in its child. ``RLIMIT_NPROC`` counts
the threads of the whole uid, so the limit is what the uid runs at the call's start plus
``tool_max_processes``; the kernel does not enforce it for root (a container running as root bounds a fork bomb
by the call's timeout and the group kill only). A tool that leaves its process group itself (``setsid``) is not
followed: tools are the run's own code, only their arguments are the model's. The
``python`` tool runs the model's code in the sandbox (:mod:`trainer.sandbox`), isolated like the code
rewards' programs: in the release's sandbox service when the chart gives one (``KUBERL_SANDBOX_URL``, in a pod
without the Ray token), else on the driver's node; a cluster of the earlier chart, with a sandbox group of Ray
workers (``KUBERL_SANDBOX_RESOURCE``: code must run on its nodes only), refuses it.
"""

from __future__ import annotations

import ast
import importlib
import json
import math
import multiprocessing
import operator
import os
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

from trainer.config import ConfigError
from trainer.envs import register
from trainer.envs.base import Step
from trainer.envs.tool_calls import HermesParser, ToolCallParser

# ----- built-in tools ---------------------------------------------------------------------------------

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_MAX_DIGITS = 100  # operands and results: a calculator, not a bignum engine (10**10**10 must not run)
_MAX_EXPONENT = 1000
_MAX_CHARS = 500


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, (int, float))
        and not isinstance(node.value, bool)
    ):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large (at most {_MAX_EXPONENT})")
        if (
            isinstance(node.op, ast.Pow)
            and abs(left) > 1
            and abs(right) * math.log10(abs(left)) > _MAX_DIGITS
        ):
            raise ValueError(f"the result would have more than {_MAX_DIGITS} digits")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, complex):
            raise ValueError("the result is not a real number")
        if isinstance(value, int) and abs(value) >= 10**_MAX_DIGITS:
            raise ValueError(f"the result has more than {_MAX_DIGITS} digits")
        return value
    raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, not {ast.unparse(node)!r}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly: integers and decimals with + - * / // % ** and parentheses.

    Args:
        expression: The expression to evaluate, for example "123 * 456" or "(2 + 3) ** 2".
    """
    if len(expression) > _MAX_CHARS:
        raise ValueError(f"the expression is longer than {_MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    try:
        value = _evaluate(tree)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    if isinstance(value, float):
        return repr(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)
    return str(value)


def python(code: str) -> str:
    """Run a Python program in a sandbox and return what it prints (standard output, then any error).

    Args:
        code: The complete program; it reads no input and must print its results.
    """
    from trainer.sandbox import OK, Limits, run_tests

    run = run_tests("python", code, [""], Limits(time_s=3.0, memory_mb=512, output_bytes=1 << 16)).runs[0]
    out = run.stdout.decode("utf-8", "replace")
    if run.status != OK:
        err = run.stderr.decode("utf-8", "replace").strip().splitlines()
        out += f"\n[{run.status.replace('_', ' ')}]" + (f" {err[-1]}" if err else "")
    return out.strip() or "(no output)"


BUILTIN_TOOLS = {"calculator": f"{__name__}:calculator", "python": f"{__name__}:python"}

# ----- running a call in a child process --------------------------------------------------------------


def _count_tasks(uid: int) -> int:
    """Threads of ``uid`` on this machine (what RLIMIT_NPROC counts)."""
    n = 0
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and entry.stat().st_uid == uid:
                n += len(os.listdir(f"/proc/{entry.name}/task"))
        except OSError:  # gone meanwhile
            pass
    return n


def _call(target: str, arguments: dict[str, Any], limits: tuple[int, int, int], conn) -> None:
    """In the child: a process group of its own, the limits (memory MiB, CPU seconds, processes), then import
    and call the tool, send back (ok, text)."""
    import resource

    os.setsid()  # first: whatever the tool starts is in the group the parent kills whole
    memory_mb, cpu_s, processes = limits
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    # The kernel sends SIGXCPU at the soft limit and SIGKILL at the hard one.
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    nproc = _count_tasks(os.getuid()) + processes  # per uid: what runs already, and this many more
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    try:
        module, attr = target.split(":")
        result = getattr(importlib.import_module(module), attr)(**arguments)
        text = result if isinstance(result, str) else json.dumps(result, default=str)
        conn.send((True, text))
    except BaseException as e:  # the tool's error is the model's answer
        conn.send((False, traceback.format_exception_only(type(e), e)[-1].strip()))
    finally:
        conn.close()


_CONTEXT: Any = None
_PRELOAD: list[str] = [__name__]  # imported once by the fork server, so a call does not import its tool again


def _context():
    """The forkserver context; its server starts at the first call with the tools' modules preloaded."""
    global _CONTEXT
    if _CONTEXT is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(_PRELOAD))
        _CONTEXT = ctx
    return _CONTEXT


def stop_processes() -> None:
    """End the fork server (and multiprocessing's resource tracker beside it), if this process started them;
    a later call starts them again. Their owner is whoever owns the environment (:meth:`ToolEnvironment.close`)."""
    global _CONTEXT
    if _CONTEXT is None:
        return
    from multiprocessing import forkserver, resource_tracker

    # The standard library's own way to stop them (private: it has no public one, and no stub names it).
    forkserver._forkserver._stop()  # type: ignore[attr-defined]  # private, unstubbed: see above
    resource_tracker._resource_tracker._stop()  # type: ignore[attr-defined]  # private, unstubbed: see above
    _CONTEXT = None


def run_tool(
    target: str,
    arguments: dict[str, Any],
    timeout_s: float,
    memory_mb: int,
    cpu_s: int | None = None,
    max_processes: int = 64,
) -> tuple[bool, str]:
    """Call ``target`` (``module:function``) with ``arguments`` in a child process, its own process group killed
    whole when the call ends: (ok, result or error). ``cpu_s``: CPU seconds per process (None: the timeout,
    rounded up); ``max_processes``: processes and threads the call may add (RLIMIT_NPROC, module docstring)."""
    cpu = cpu_s if cpu_s is not None else max(1, math.ceil(timeout_s))
    ctx = _context()
    recv, send = ctx.Pipe(duplex=False)
    limits = (memory_mb, cpu, max_processes)
    proc = ctx.Process(target=_call, args=(target, arguments, limits, send), daemon=True)
    proc.start()
    send.close()
    try:
        if recv.poll(timeout_s):
            try:
                return recv.recv()
            except (EOFError, OSError):
                pass  # the child died before it answered
        else:
            return False, f"the call timed out after {timeout_s:g}s"
    finally:
        recv.close()
        _end_group(proc)
    return False, (
        f"the tool's process died (exit code {proc.exitcode}); it may have run out of memory, "
        f"CPU time ({cpu}s) or processes ({max_processes})"
    )


def _end_group(proc) -> None:
    """Kill the call's process group, then the child itself (in case it had not made its group yet), and the
    group once more (a process it started in that moment). The group's id stays the child's pid while any
    member lives, so it names no one else."""
    for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
        try:
            kill()
        except (ProcessLookupError, PermissionError):
            pass
    proc.join(timeout=5)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ----- the environment --------------------------------------------------------------------------------


def _resolve(entry: Any, index: int) -> tuple[str, dict[str, Any]]:
    """One ``tools`` entry -> (module:function, its schema); ConfigError naming the entry when it fails."""
    key = f"env.environment_kwargs.tools[{index}]"
    schema = None
    if isinstance(entry, dict):
        unknown = set(entry) - {"function", "schema"}
        if unknown or "function" not in entry:
            raise ConfigError(f"{key}={entry!r}: expected {{function: module:function, schema: {{...}}}}")
        entry, schema = entry["function"], entry.get("schema")
    if not isinstance(entry, str):
        raise ConfigError(
            f"{key}={entry!r}: expected a built-in ({', '.join(BUILTIN_TOOLS)}) or module:function"
        )
    target = BUILTIN_TOOLS.get(entry, entry)
    module, _, attr = target.partition(":")
    if not module or not attr:
        raise ConfigError(
            f"{key}={entry!r}: expected a built-in ({', '.join(BUILTIN_TOOLS)}) or module:function"
        )
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{key}={entry!r}: cannot import it ({type(e).__name__}: {e})") from None
    if schema is None:
        from transformers.utils import get_json_schema

        try:
            schema = get_json_schema(fn)
        except Exception as e:  # no docstring, an undocumented argument, a type it cannot express
            raise ConfigError(
                f"{key}={entry!r}: no schema from its signature and docstring ({str(e).splitlines()[0]}); "
                "document every argument (Google style, Args:) or give {function: ..., schema: {...}}"
            ) from None
    if not isinstance(schema, dict) or not isinstance(schema.get("function", {}).get("name"), str):
        raise ConfigError(
            f"{key}: the schema must be an OpenAI function schema {{type: function, function: {{name, ...}}}}"
        )
    return target, schema


class ToolEpisode:
    def __init__(self, env: ToolEnvironment):
        self.env = env

    def step(self, text: str) -> Step:
        env = self.env
        calls, errors = env.parser.parse(text)
        if not calls and not errors:
            return Step([], done=True)
        messages: list[dict[str, Any]] = []
        failed, t0 = len(errors), time.monotonic()
        for error in errors:
            messages.append({"role": "tool", "content": f"Error: {error}"})
        for i, call in enumerate(calls):
            name = call["name"]
            if i >= env.max_calls_per_turn:
                ok, out = False, f"not run: at most {env.max_calls_per_turn} tool calls per turn"
            elif name not in env.targets:
                ok, out = False, f"there is no tool {name!r}; the tools are {', '.join(env.targets)}"
            else:
                ok, out = run_tool(
                    env.targets[name],
                    call["arguments"],
                    env.tool_timeout_s,
                    env.tool_memory_mb,
                    env.tool_cpu_s,
                    env.tool_max_processes,
                )
            if len(out) > env.max_result_chars:
                out = out[: env.max_result_chars] + f"... (cut at {env.max_result_chars} characters)"
            failed += not ok
            messages.append({"role": "tool", "name": name, "content": out if ok else f"Error: {out}"})
        info = {"tool_calls": float(len(calls) + len(errors)), "tool_errors": float(failed)}
        info["tool_s"] = time.monotonic() - t0
        return Step(messages, done=False, info=info)

    def close(self) -> None:
        pass


@register("tools")
class ToolEnvironment:
    """Functions the model may call between its turns (module docstring)."""

    name = "tools"

    def __init__(
        self,
        tools: list[Any] | None = None,
        max_calls_per_turn: int = 4,
        tool_timeout_s: float = 5.0,
        tool_memory_mb: int = 1024,
        max_result_chars: int = 1000,
        tool_cpu_s: int | None = None,
        tool_max_processes: int = 64,
    ):
        if not tools or not isinstance(tools, (list, tuple)):
            raise ConfigError(
                "env.environment_kwargs.tools must be a non-empty list of tools "
                f"({', '.join(BUILTIN_TOOLS)}, module:function or {{function, schema}}), got {tools!r}"
            )
        for key, value in (
            ("max_calls_per_turn", max_calls_per_turn),
            ("tool_memory_mb", tool_memory_mb),
            ("tool_max_processes", tool_max_processes),
            ("tool_cpu_s", 1 if tool_cpu_s is None else tool_cpu_s),
        ):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"env.environment_kwargs.{key}={value!r} must be an integer >= 1")
        if not isinstance(max_result_chars, int) or max_result_chars < 16:
            raise ConfigError(
                f"env.environment_kwargs.max_result_chars={max_result_chars!r} must be an integer >= 16"
            )
        if not isinstance(tool_timeout_s, (int, float)) or not 0 < tool_timeout_s < math.inf:
            raise ConfigError(
                f"env.environment_kwargs.tool_timeout_s={tool_timeout_s!r} must be a number of seconds > 0"
            )
        self.targets: dict[str, str] = {}
        self.schemas: list[dict[str, Any]] = []
        for i, entry in enumerate(tools):
            target, schema = _resolve(entry, i)
            name = schema["function"]["name"]
            if name in self.targets:
                raise ConfigError(f"env.environment_kwargs.tools[{i}]: a second tool named {name!r}")
            self.targets[name] = target
            if target.split(":")[0] not in _PRELOAD:
                _PRELOAD.append(target.split(":")[0])
            self.schemas.append(schema)
        # Imported here: the fork server preloads this module, and every call's process forks from it (no Ray).
        from trainer.rewards.runner import SANDBOX_RESOURCE_ENV

        if "python" in self.targets and os.environ.get(SANDBOX_RESOURCE_ENV, "").strip():
            # Fail closed: on a cluster with a sandbox group the model's code runs only on its nodes, and tool
            # calls run beside the driver.
            raise ConfigError(
                f"env.environment_kwargs.tools: the python tool runs the model's code beside the driver, and this "
                f"cluster keeps such code on its sandbox nodes ({SANDBOX_RESOURCE_ENV} is set); drop the python tool"
            )
        self.max_calls_per_turn, self.tool_timeout_s = max_calls_per_turn, float(tool_timeout_s)
        self.tool_memory_mb, self.max_result_chars = tool_memory_mb, max_result_chars
        self.tool_cpu_s, self.tool_max_processes = tool_cpu_s, tool_max_processes
        self.parser: ToolCallParser = HermesParser()

    def use_tool_parser(self, parser: ToolCallParser) -> None:
        """Read the model's calls with ``parser`` (env.tool_parser, built for these tools) instead of Hermes'."""
        self.parser = parser

    def tools(self) -> list[dict[str, Any]] | None:
        return self.schemas

    def episode(self, example: dict[str, Any]) -> ToolEpisode:
        return ToolEpisode(self)

    def close(self) -> None:
        """End the processes the calls forked from (the run, at its end)."""
        stop_processes()
