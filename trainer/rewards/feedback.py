"""Execution feedback for multi-turn rollouts (``grpo.max_rollout_turns > 1``).

A feedback function ``(ground_truth, response, **kwargs) -> str | None`` returns the next user turn
after a failing attempt, or ``None`` when the attempt passed and the episode ends. The code feedback
runs the program on the problem's tests in the sandbox, like ``code_unit_tests``, and reports the
first failing test's input, expected output and actual output.

:func:`configure` picks the run's feedback (``env.feedback``; by default the first reward's, when it
has one) and checks it, on the driver before the run starts anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainer.config import ConfigError, EnvConfig
from trainer.rewards import code
from trainer.sandbox import OK, Limits, run_tests

FeedbackFn = Callable[..., "str | None"]
FEEDBACK: dict[str, FeedbackFn] = {}

_MAX_CHARS = 400  # per field: enough to see the mistake, not enough to flood the context


def _clip(text: str) -> str:
    text = text if len(text) <= _MAX_CHARS else text[:_MAX_CHARS] + "... (truncated)"
    return text.rstrip("\n") or "(empty)"


def code_unit_tests_feedback(
    ground_truth: Any,
    response: str,
    *,
    max_tests: int | None = None,
    time_limit_s: float = 2.0,
    memory_limit_mb: int = 512,
    seed: int = 0,
    backend: str | None = None,
    **_: Any,
) -> str | None:
    inputs, outputs, gt = code._tests(ground_truth)
    program = code.extract_code(response, code.PYTHON_TAGS)
    if program is None:
        return "Your answer has no ```python code block. Write the complete program in one ```python block."
    idx = code.select_tests(inputs, max_tests, seed)
    limits = Limits(
        time_s=float(gt.get("time_limit_s") or time_limit_s),
        memory_mb=int(gt.get("memory_limit_mb") or memory_limit_mb),
        output_bytes=1 << 20,
        stack_mb=64,
    )
    batch = run_tests(
        "python", program, [inputs[i] for i in idx], limits, stop_on=("timeout",), backend=backend
    )
    for i, run in zip(idx, batch.runs):
        actual = run.stdout.decode("utf-8", "replace")
        if run.status == OK and code.outputs_match(actual, outputs[i]):
            continue
        what = "wrong answer" if run.status == OK else run.status.replace("_", " ")
        detail = (
            f"\nError output:\n{_clip(run.stderr.decode('utf-8', 'replace'))}"
            if run.status != OK and run.stderr
            else ""
        )
        return (
            f"Your program failed a test ({what}).\nInput:\n{_clip(inputs[i])}\nExpected output:\n"
            f"{_clip(outputs[i])}\nYour output:\n{_clip(actual)}{detail}\nFix the program and write it again "
            "in one ```python block."
        )
    return None


FEEDBACK["code_unit_tests"] = code_unit_tests_feedback


def get(name: str) -> FeedbackFn:
    if name not in FEEDBACK:
        raise KeyError(f"no execution feedback for {name!r}; available: {', '.join(sorted(FEEDBACK))}")
    return FEEDBACK[name]


def configure(env: EnvConfig, max_rollout_turns: int) -> None:
    """A multi-turn run (``max_rollout_turns > 1``) needs feedback: ``env.feedback`` null takes the first
    reward's, with that reward's kwargs, when it has one; a name without feedback is a ConfigError."""
    if max_rollout_turns <= 1:
        return
    first = env.reward_functions[0]
    if env.feedback is None and first.name in FEEDBACK:
        env.feedback, env.feedback_kwargs = first.name, dict(first.kwargs)
    if env.feedback not in FEEDBACK:
        raise ConfigError(
            f"grpo.max_rollout_turns={max_rollout_turns} needs execution feedback: env.feedback={env.feedback!r}; "
            f"available: {', '.join(sorted(FEEDBACK))}"
        )
