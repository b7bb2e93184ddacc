"""Code rewards: run the model's program on the problem's stdin/stdout tests inside the sandbox.

``ground_truth`` is ``{"inputs": [stdin, ...], "outputs": [expected stdout, ...]}``, optionally with
``time_limit_s`` and ``memory_limit_mb`` (the problem's own limits win over the config's defaults).

- ``code_unit_tests`` (Python): reward = fraction of tests passed, or 1/0 with ``all_or_nothing``.
- ``cpp_contest`` (C++, ``g++ -O2 -std=c++17``): -1 when there is no code or it cannot run, -0.5 on a
  compile error (a compile timeout or a compile bomb included), 0 when a test exceeds the time limit,
  else the fraction of tests passed.

Both extract the last fenced block of the right language from the final answer (after ``</think>``
when the model reasons first; a response cut off while still thinking has no answer). Outputs are
compared token by token, so whitespace and line breaks do not matter, with a relative tolerance for
expected tokens that are decimals. When a problem has more than ``max_tests`` tests a fixed subset is
run, drawn from a seed derived from the tests themselves, so every response in a GRPO group is
judged on the same tests. Expected outputs never enter the sandbox, and nothing the program does
makes these functions raise or hang: the sandbox bounds every step in time.

Each returns a :class:`~trainer.rewards.registry.Score` whose answer is the extracted program (its first
characters) and whose note says what happened: no block, a compile error, or how many tests passed and
how the first failing one failed. An output counts only from a program that exited cleanly: the right
answer followed by a crash, extra lines, a second guess (``3 or 4``), look-alike digits (``３``) or a
decimal where an integer is expected (``3.0`` for ``3``) all fail the test.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import re
from typing import Any

from trainer.rewards.answer import clip
from trainer.rewards.registry import Score, register
from trainer.sandbox import ERROR, LOST, OK, TIMEOUT, Limits, run_tests
from trainer.sandbox.limits import COMPILE_LIMITS

log = logging.getLogger(__name__)

PYTHON_TAGS = ("python", "py", "python3")
CPP_TAGS = ("cpp", "c++", "cc", "cxx")
_FENCE = re.compile(r"```([^\n`]*)\n(.*?)```", re.S)
_DECIMAL = re.compile(r"^[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?$")


def final_answer(response: str) -> str:
    """The part of a response after its reasoning: after the last ``</think>``, if it ever thinks."""
    if response is None:
        return ""
    if "</think>" in response:
        return response.rsplit("</think>", 1)[1]
    if "<think>" in response:
        return ""  # cut off mid-thought: no answer yet
    return response


def extract_code(response: str, tags: tuple[str, ...]) -> str | None:
    """The last fenced block tagged with one of ``tags``, else the last untagged one, else None."""
    tagged, untagged = None, None
    for info, body in _FENCE.findall(final_answer(response)):
        lang = info.strip().split()[0].lower() if info.strip() else ""
        if not body.strip():
            continue
        if lang in tags:
            tagged = body
        elif not lang:
            untagged = body
    return tagged if tagged is not None else untagged


def outputs_match(got: str, expected: str, float_tolerance: float = 1e-6) -> bool:
    """Token-wise equality; decimal expected tokens also match within ``float_tolerance`` (relative)."""
    g, e = got.split(), expected.split()
    if g == e:
        return True
    if len(g) != len(e) or not float_tolerance:
        return False
    for a, b in zip(g, e, strict=True):
        if a == b:
            continue
        if not (_DECIMAL.match(a) and _DECIMAL.match(b) and "." in b):
            return False
        fa, fb = float(a), float(b)
        if not math.isclose(fa, fb, rel_tol=float_tolerance, abs_tol=float_tolerance):
            return False
    return True


def _tests(ground_truth: Any) -> tuple[list[str], list[str], dict]:
    """Validate the ground truth (our data, not the model's: a bad one raises, naming the problem)."""
    gt = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    if not isinstance(gt, dict) or "inputs" not in gt or "outputs" not in gt:
        raise ValueError("code reward: ground_truth must be a dict with 'inputs' and 'outputs' lists")
    inputs, outputs = list(gt["inputs"]), list(gt["outputs"])
    if len(inputs) != len(outputs) or not inputs:
        raise ValueError(f"code reward: {len(inputs)} test inputs for {len(outputs)} outputs")
    return [str(x) for x in inputs], [str(x) for x in outputs], gt


def select_tests(inputs: list[str], max_tests: int | None, seed: int = 0) -> list[int]:
    """Indices of the tests to run: all of them, or ``max_tests`` fixed by the tests' own content."""
    n = len(inputs)
    if not max_tests or n <= max_tests:
        return list(range(n))
    digest = hashlib.sha256("\x00".join(inputs).encode("utf-8", "surrogateescape")).digest()
    rng = random.Random(int.from_bytes(digest[:8], "little") ^ seed)
    return sorted(rng.sample(range(n), int(max_tests)))


def _caps(expected: list[str], output_limit_mb: float) -> list[int]:
    # An output several times longer than the expected one cannot match: stop it early.
    limit = int(output_limit_mb * (1 << 20))
    return [min(limit, 4 * len(e.encode("utf-8", "surrogateescape")) + (64 << 10)) for e in expected]


def _passed(batch, expected: list[str], float_tolerance: float) -> list[bool]:
    return [
        r.status == OK and outputs_match(r.stdout.decode("utf-8", "replace"), e, float_tolerance)
        for r, e in zip(batch.runs, expected, strict=True)
    ]


def _tally(batch, passed: list[bool], n: int) -> str:
    """``3/4 tests passed; test 2: wrong answer`` for the report (tests never run count as failed: lost)."""
    note = f"{sum(passed)}/{n} tests passed"
    for i, (run, ok) in enumerate(zip(batch.runs, passed)):
        if not ok:
            return f"{note}; test {i + 1}: {'wrong answer' if run.status == OK else run.status.replace('_', ' ')}"
    return note


def _no_code(tags: tuple[str, ...], response: str) -> str:
    if response is not None and "<think>" in response and "</think>" not in response:
        return "cut off while thinking (no </think>)"
    return f"no ```{tags[0]} block"


@register("code_unit_tests")
def code_unit_tests(
    ground_truth: Any,
    response: str,
    *,
    all_or_nothing: bool = False,
    max_tests: int | None = None,
    time_limit_s: float = 2.0,
    memory_limit_mb: int = 512,
    output_limit_mb: float = 16,
    float_tolerance: float = 1e-6,
    python_mode: str = "fork",
    seed: int = 0,
    backend: str | None = None,
    **_: Any,
) -> Score:
    """Fraction of the (sampled) tests a Python program passes; 1/0 with ``all_or_nothing``."""
    inputs, outputs, gt = _tests(ground_truth)
    code = extract_code(response, PYTHON_TAGS)
    if code is None:
        return Score(0.0, False, None, _no_code(PYTHON_TAGS, response))
    idx = select_tests(inputs, max_tests, seed)
    expected = [outputs[i] for i in idx]
    limits = Limits(
        time_s=float(gt.get("time_limit_s") or time_limit_s),
        memory_mb=int(gt.get("memory_limit_mb") or memory_limit_mb),
        output_bytes=int(output_limit_mb * (1 << 20)),
        stack_mb=64,  # deep recursion is common in contest Python; the default 8 MiB crashes it
    )
    batch = run_tests(
        "python",
        code,
        [inputs[i] for i in idx],
        limits,
        output_caps=_caps(expected, output_limit_mb),
        stop_on=("timeout", "runtime_error", "output_limit") if all_or_nothing else (),
        python_mode=python_mode,
        backend=backend,
    )
    if batch.error and all(r.status in (ERROR, LOST) for r in batch.runs):
        log.debug("code_unit_tests: the program never ran (%s)", batch.error)
    passed = _passed(batch, expected, float_tolerance)
    n_ok = sum(passed)
    correct = n_ok == len(idx)
    note = _tally(batch, passed, len(idx))
    if all_or_nothing:
        return Score(1.0 if correct else 0.0, correct, clip(code), note)
    return Score(n_ok / len(idx), correct, clip(code), note)


@register("cpp_contest")
def cpp_contest(
    ground_truth: Any,
    response: str,
    *,
    max_tests: int | None = None,
    time_limit_s: float = 2.0,
    memory_limit_mb: int = 256,
    compile_timeout_s: float = 10.0,
    output_limit_mb: float = 16,
    float_tolerance: float = 1e-6,
    seed: int = 0,
    backend: str | None = None,
    **_: Any,
) -> Score:
    """-1 no code / cannot run, -0.5 compile error, 0 any timeout, else the fraction of tests passed."""
    inputs, outputs, gt = _tests(ground_truth)
    code = extract_code(response, CPP_TAGS)
    if code is None:
        return Score(-1.0, False, None, _no_code(CPP_TAGS, response))
    idx = select_tests(inputs, max_tests, seed)
    expected = [outputs[i] for i in idx]
    memory = int(gt.get("memory_limit_mb") or memory_limit_mb)
    limits = Limits(
        time_s=float(gt.get("time_limit_s") or time_limit_s),
        memory_mb=memory + 64,  # the C++ runtime's own mappings, on top of the problem's limit
        stack_mb=min(memory, 256),  # judges give the stack the whole memory limit; recursion needs it
        output_bytes=int(output_limit_mb * (1 << 20)),
    )
    batch = run_tests(
        "cpp",
        code,
        [inputs[i] for i in idx],
        limits,
        output_caps=_caps(expected, output_limit_mb),
        compile_limits=COMPILE_LIMITS.with_(time_s=compile_timeout_s, wall_s=compile_timeout_s * 1.5),
        stop_on=(TIMEOUT,),  # one timeout already decides the reward
        backend=backend,
    )
    if batch.compile is None or batch.compile.status == ERROR:
        log.warning(
            "cpp_contest: the compiler could not run: %s",
            batch.error or (batch.compile.stderr[-300:] if batch.compile else "no compile result"),
        )
        return Score(-1.0, False, clip(code), "the compiler could not run")
    if batch.compile.status != OK:
        return Score(-0.5, False, clip(code), f"does not compile ({batch.compile.status.replace('_', ' ')})")
    if all(r.status in (ERROR, LOST) for r in batch.runs):
        return Score(-1.0, False, clip(code), "the program could not run")
    passed = _passed(batch, expected, float_tolerance)
    if any(r.status == TIMEOUT for r in batch.runs):
        return Score(0.0, False, clip(code), _tally(batch, passed, len(idx)))
    n_ok = sum(passed)
    return Score(n_ok / len(idx), n_ok == len(idx), clip(code), _tally(batch, passed, len(idx)))


SANDBOXED = ("code_unit_tests", "cpp_contest")  # the entries of env.reward_functions that run model code


class SandboxComponent:
    """The sandbox the code rewards run model code in, as a run component (:mod:`trainer.components`): chosen
    and probed once at start, and said once in the driver's log (:func:`trainer.sandbox.backends.resolve`); a
    sandbox that cannot work here stops the run there, in one line."""

    name = "sandbox"

    def check(self) -> None:
        return None

    def start(self) -> None:
        from trainer.sandbox.backends import resolve

        resolve()

    def wait_ready(self) -> None:
        return None

    def describe(self) -> str | None:
        return None

    def shutdown(self, graceful: bool = True) -> None:
        return None


def sandbox_component(cfg: Any) -> SandboxComponent | None:
    """The sandbox, when an entry of ``env.reward_functions`` runs model code."""
    return SandboxComponent() if any(s.name in SANDBOXED for s in cfg.env.reward_functions) else None
