"""The sandbox service's JSON: programs with their tests and limits in, verdicts out (server and client share it).

A request (``POST /v1/run``) is ``{"programs": [PROGRAM, ...]}``; each PROGRAM holds what
:func:`trainer.sandbox.executor.run_tests` takes::

    {"language": "python" | "cpp", "source": str, "inputs": [str, ...],
     "limits": LIMITS | null, "compile_limits": LIMITS | null, "output_caps": [int, ...] | null,
     "stop_on": [verdict, ...], "python_mode": "fork" | "exec"}

    LIMITS = {"time_s": float, "wall_s": float | null, "memory_mb": int, "stack_mb": int | null,
              "output_bytes": int, "max_processes": int, "max_open_files": int}   (any subset: the rest default)

Inputs are text; bytes that are not UTF-8 travel as lone surrogates (``surrogateescape``, which JSON escapes as
``\\udcXX``) and arrive as the same bytes. The answer (200) is ``{"results": [RESULT, ...]}``, one per program in
order, each what ``run_tests`` returned::

    RESULT = {"runs": [RUN, ...], "compile": RUN | null, "error": str | null, "backend": str, "wall_s": float}
    RUN = {"status": verdict, "returncode": int | null, "stdout_b64": str, "stderr_b64": str,
           "cpu_s": float, "wall_s": float}

Anything else is ``{"error": "<one line>"}`` with a 4xx or 5xx status. :func:`program_from_json` checks a
program against the server's :class:`Caps` and raises :class:`BadRequest` naming the field and the limit.
"""

from __future__ import annotations

import base64
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from trainer.sandbox.executor import LANGUAGES, BatchResult, RunResult
from trainer.sandbox.limits import (
    COMPILE_LIMITS,
    ERROR,
    LOST,
    OK,
    OUTPUT_LIMIT,
    RUNTIME_ERROR,
    TIMEOUT,
    Limits,
)

RUN_PATH = "/v1/run"
HEALTH_PATH = "/healthz"
TOKEN_ENV = "KUBERL_SANDBOX_TOKEN"  # the bearer token, in the server's pod and in its callers'
TOKEN_FILE_ENV = "KUBERL_SANDBOX_TOKEN_FILE"  # or a file holding it (a mounted Secret)
MIN_TOKEN_CHARS = 16
VERDICTS = (OK, RUNTIME_ERROR, TIMEOUT, OUTPUT_LIMIT, ERROR, LOST)
LIMIT_FIELDS = {f.name for f in dataclasses.fields(Limits)}


class BadRequest(ValueError):
    """A request the server refuses (400 or 413): one line naming what and which limit."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Caps:
    """What one request may ask of the server (each refusal names the field and the cap)."""

    max_programs: int = 64  # programs per request
    max_tests: int = 512  # inputs per program
    max_time_s: float = 60.0  # CPU seconds per test, and the compile's
    max_wall_s: float = 120.0  # wall seconds per test, and the compile's
    max_memory_mb: int = 8192
    max_output_bytes: int = 64 << 20
    max_processes: int = 256
    max_open_files: int = 1024


@dataclass(frozen=True)
class Program:
    """One program of a request: ``run_tests``'s arguments."""

    language: str
    source: str
    inputs: list[str]
    limits: Limits = Limits()
    compile_limits: Limits = COMPILE_LIMITS
    output_caps: list[int] | None = None
    stop_on: tuple[str, ...] = ()
    python_mode: str = "fork"

    def kwargs(self) -> dict:
        return {
            "output_caps": self.output_caps,
            "compile_limits": self.compile_limits,
            "stop_on": self.stop_on,
            "python_mode": self.python_mode,
        }

    def budget_s(self) -> float:
        """The longest the executor may take on it (its own overall deadline, ``executor.run_tests``)."""
        budget = 15.0 + len(self.inputs) * (self.limits.wall + 0.5)
        return budget + (self.compile_limits.wall if self.language == "cpp" else 0.0)


def _limits_json(limits: Limits) -> dict:
    return dataclasses.asdict(limits)


def program_to_json(p: Program) -> dict:
    return {
        "language": p.language,
        "source": p.source,
        "inputs": list(p.inputs),
        "limits": _limits_json(p.limits),
        "compile_limits": _limits_json(p.compile_limits),
        "output_caps": None if p.output_caps is None else [int(c) for c in p.output_caps],
        "stop_on": list(p.stop_on),
        "python_mode": p.python_mode,
    }


def _number(where: str, value: Any, integer: bool = False) -> float:
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok or not math.isfinite(value):
        raise BadRequest(f"{where}={value!r} must be {'an integer' if integer else 'a number'}")
    return value


def _show(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _limits(where: str, raw: Any, default: Limits, caps: Caps) -> Limits:
    if raw is None:
        return default
    if not isinstance(raw, dict):
        raise BadRequest(f"{where} must be an object of {', '.join(sorted(LIMIT_FIELDS))}")
    unknown = sorted(set(raw) - LIMIT_FIELDS)
    if unknown:
        raise BadRequest(f"{where}.{unknown[0]} is not a limit; limits are {', '.join(sorted(LIMIT_FIELDS))}")
    integers = {"memory_mb", "stack_mb", "output_bytes", "max_processes", "max_open_files"}
    values: dict[str, Any] = {
        k: (v if v is None and k in ("wall_s", "stack_mb") else _number(f"{where}.{k}", v, k in integers))
        for k, v in raw.items()
    }
    try:
        limits = dataclasses.replace(default, **values)
    except (TypeError, ValueError) as e:
        raise BadRequest(f"{where}: {e}") from None
    for field, cap, value in (
        ("time_s", caps.max_time_s, limits.time_s),
        ("wall_s", caps.max_wall_s, limits.wall),
        ("memory_mb", caps.max_memory_mb, limits.memory_mb),
        ("stack_mb", caps.max_memory_mb, limits.stack_mb or 0),
        ("output_bytes", caps.max_output_bytes, limits.output_bytes),
        ("max_processes", caps.max_processes, limits.max_processes),
        ("max_open_files", caps.max_open_files, limits.max_open_files),
    ):
        if value > cap:
            raise BadRequest(f"{where}.{field}={_show(value)} is over this server's limit of {_show(cap)}")
        if value <= 0 and field != "stack_mb":
            raise BadRequest(f"{where}.{field}={_show(value)} must be > 0")
    return limits


def program_from_json(where: str, raw: Any, caps: Caps) -> Program:
    """Check one request program against ``caps``; BadRequest names the field and the limit."""
    if not isinstance(raw, dict):
        raise BadRequest(f"{where} must be an object with language, source and inputs")
    known = {f.name for f in dataclasses.fields(Program)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise BadRequest(f"{where}.{unknown[0]} is not a field; fields are {', '.join(sorted(known))}")
    language = raw.get("language")
    if language not in LANGUAGES:
        raise BadRequest(f"{where}.language={language!r}: expected one of {', '.join(LANGUAGES)}")
    source = raw.get("source")
    if not isinstance(source, str):
        raise BadRequest(f"{where}.source must be a string")
    inputs = raw.get("inputs")
    if not isinstance(inputs, list) or not all(isinstance(x, str) for x in inputs):
        raise BadRequest(f"{where}.inputs must be a list of strings")
    if len(inputs) > caps.max_tests:
        raise BadRequest(
            f"{where}.inputs has {len(inputs)} tests, over this server's limit of {caps.max_tests}"
        )
    caps_list = raw.get("output_caps")
    if caps_list is not None:
        if not isinstance(caps_list, list) or len(caps_list) != len(inputs):
            raise BadRequest(f"{where}.output_caps must be null or one integer per input")
        caps_list = [int(_number(f"{where}.output_caps[{i}]", c, True)) for i, c in enumerate(caps_list)]
    stop_on = raw.get("stop_on") or []
    if not isinstance(stop_on, list) or not all(s in VERDICTS for s in stop_on):
        raise BadRequest(f"{where}.stop_on must be a list of verdicts ({', '.join(VERDICTS)})")
    mode = raw.get("python_mode", "fork")
    if mode not in ("fork", "exec"):
        raise BadRequest(f"{where}.python_mode={mode!r}: expected fork or exec")
    return Program(
        language,
        source,
        inputs,
        _limits(f"{where}.limits", raw.get("limits"), Limits(), caps),
        _limits(f"{where}.compile_limits", raw.get("compile_limits"), COMPILE_LIMITS, caps),
        caps_list,
        tuple(stop_on),
        mode,
    )


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _run_json(r: RunResult) -> dict:
    return {
        "status": r.status,
        "returncode": r.returncode,
        "stdout_b64": _b64(r.stdout),
        "stderr_b64": _b64(r.stderr),
        "cpu_s": r.cpu_s,
        "wall_s": r.wall_s,
    }


def result_to_json(b: BatchResult) -> dict:
    return {
        "runs": [_run_json(r) for r in b.runs],
        "compile": None if b.compile is None else _run_json(b.compile),
        "error": b.error,
        "backend": b.backend,
        "wall_s": b.wall_s,
    }


def _run_from_json(raw: dict) -> RunResult:
    status = raw["status"]
    if status not in VERDICTS:
        raise ValueError(f"unknown verdict {status!r}")
    rc = raw.get("returncode")
    return RunResult(
        status,
        None if rc is None else int(rc),
        base64.b64decode(raw.get("stdout_b64") or "", validate=True),
        base64.b64decode(raw.get("stderr_b64") or "", validate=True),
        float(raw.get("cpu_s") or 0.0),
        float(raw.get("wall_s") or 0.0),
    )


def result_from_json(raw: Any, n_inputs: int) -> BatchResult:
    """A RESULT back into a BatchResult; ValueError (or KeyError, TypeError) when it is not one."""
    runs = [_run_from_json(r) for r in raw["runs"]]
    if len(runs) > n_inputs:
        raise ValueError(f"{len(runs)} runs for {n_inputs} inputs")
    runs += [RunResult(LOST) for _ in range(n_inputs - len(runs))]
    compiled = raw.get("compile")
    error = raw.get("error")
    return BatchResult(
        runs,
        None if compiled is None else _run_from_json(compiled),
        None if error is None else str(error),
        str(raw.get("backend") or ""),
        float(raw.get("wall_s") or 0.0),
    )
