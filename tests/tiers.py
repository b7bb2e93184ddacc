"""The suite's two tiers, by cost: what ``tests/conftest.py`` marks ``integration``, and what the fast tier
(``make test-fast``, ``pytest --tier=fast``) refuses.

A test is integration-tier when it starts Ray, loads or writes a model, starts vLLM, runs the GRPO loop or
starts a program of its own (a Python interpreter pays seconds of imports before its first line; a sandboxed
program, a compiler or a ``make`` target is no cheaper). It is marked so when one of its fixtures, anywhere
in its closure, says it starts one of those (:func:`starts`), when it is marked ``slow`` (a real loop or
cluster) or ``gpu``, or when it carries the mark itself (the test, or its module's ``pytestmark``: what
starts one of those without a fixture). The rest is the fast tier: config, algorithms, rewards, data, chart
renders (``helm`` and the few programs as cheap, :data:`FAST_PROGRAMS`), parsers.

No list says which tests are fast: the fast tier runs with :func:`install` in place, and a test that starts
one of those things anyway fails there, in one line that says what it started and how to move it, instead
of quietly making the fast tier slow; so does one that starts nothing but takes more CPU time than
:data:`FAST_CPU_BUDGET_S`. ``make test`` runs both tiers without the guards, as before.
"""

from __future__ import annotations

import multiprocessing.process
import os
import resource
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeVar

import pytest

MARKER = "integration"
F = TypeVar("F", bound=Callable)

# What a fixture starts, on the fixture (:func:`starts`): a test that requests it, or requests a fixture
# that does, is integration-tier.
_STARTS = "_kuberl_starts"
# Marked so already: slow runs a real loop or a real cluster, gpu needs what only a GPU node has.
INTEGRATION_MARKERS = ("slow", "gpu")
# The programs a fast-tier test may start, each a fraction of a second: the chart renders' helm and promtool;
# shell scripts (a rendered start-up script, a fake kubectl a test writes) and kubectl; git; and the probes
# libraries run on the way (the platform module's `file` and `uname`, which vLLM's import calls, and
# ctypes.util.find_library's `ldconfig`).
FAST_PROGRAMS = ("helm", "promtool", "bash", "sh", "kubectl", "git", "file", "uname", "ldconfig")


# The most CPU time a fast-tier test may take, its set-up included (this process's and the programs' it
# waited for): beyond it the test fails (:func:`over_budget`). On a 2-core AVX512-BF16 EPYC the fast tier's
# tests take at most 4.5 s each, most under 0.1 s; a test over the budget belongs to the integration tier
# even if it starts nothing (a sweep that composes the config two hundred times).
FAST_CPU_BUDGET_S = 10.0


def cpu_seconds() -> float:
    """CPU time so far of this process and of the programs it waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def over_budget(cpu_s: float) -> str | None:
    """The one-line failure of a fast-tier test that took ``cpu_s`` of CPU time; None within the budget."""
    if cpu_s <= FAST_CPU_BUDGET_S:
        return None
    return (
        f"this test took {cpu_s:.1f} s of CPU time, over the fast tier's {FAST_CPU_BUDGET_S:.0f} s a test: it is "
        f"integration-tier, not for `make test-fast`; mark it @pytest.mark.{MARKER} (tests/tiers.py)"
    )


def starts(what: str) -> Callable[[F], F]:
    """Declare what a fixture starts (``"starts Ray"``), under its ``@pytest.fixture``: every test that
    requests it, directly or through another fixture, is integration-tier."""

    def declare(func: F) -> F:
        setattr(func, _STARTS, what)
        return func

    return declare


def integration_reason(fixtures: Mapping[str, Callable], markers: Iterable[str]) -> str | None:
    """Why a test is integration-tier, from its fixture closure (name: the fixture's function) and its
    markers; None if it is fast-tier."""
    markers = set(markers)
    if MARKER in markers:
        return "marked integration"
    for name, func in fixtures.items():
        what = getattr(func, _STARTS, None)
        if what:
            return f"its fixture {name} {what}"
    for name in INTEGRATION_MARKERS:
        if name in markers:
            return f"marked {name}"
    return None


def refuse(what: str, fix: str = "") -> None:
    """Fail the running test in one line: it is integration-tier and ran in the fast tier."""
    pytest.fail(
        f"this test {what}: it is integration-tier, not for `make test-fast`; {fix + ', or ' if fix else ''}"
        f"mark it @pytest.mark.{MARKER} (tests/tiers.py)",
        pytrace=False,
    )


def command_starts(args: str | bytes | os.PathLike | Sequence, shell: bool = False) -> str | None:
    """What a command line starts that the fast tier refuses (a trainer run, a Ray cluster, any program but
    :data:`FAST_PROGRAMS`); None if nothing."""
    if isinstance(args, (str, bytes, os.PathLike)):
        args = os.fsdecode(args)
        argv = shlex.split(args) if shell else [args]
    else:
        argv = [os.fsdecode(a) if isinstance(a, (bytes, os.PathLike)) else str(a) for a in args]
    if not argv:
        return None
    program = os.path.basename(argv[0])
    if program in FAST_PROGRAMS:
        return None
    if program == "ray" and argv[1:2] == ["start"]:
        return "starts Ray (`ray start`)"
    if argv[0] == sys.executable or program.startswith("python"):
        module = argv[argv.index("-m") + 1 :][:1] if "-m" in argv else []
        if module == ["trainer"]:
            return "runs the trainer (`python -m trainer`)"
        if module == ["pytest"]:
            return "runs a test session of its own (`python -m pytest`)"
        if "-c" in argv and "ray.init(" in "".join(argv[argv.index("-c") + 1 :][:1]):
            return "starts Ray (`python -c` with ray.init)"
        return "starts a Python interpreter (seconds of imports)"
    return f"starts a process (`{program}`)"


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make starting Ray, loading or writing a model, starting vLLM, running the loop or starting a process
    fail the test that does it (:func:`refuse`). A test's own monkeypatch of one of these (a fake vLLM
    start) still wins: it is set later and undone first."""
    import ray
    from transformers import PreTrainedModel

    from trainer.generation.vllm_engine import VLLMGenerationEngine
    from trainer.loop import grpo

    def ray_init(*args, **kwargs):
        refuse("starts Ray (ray.init)", "take the ray_local or trainer_env fixture")

    def from_pretrained(cls, *args, **kwargs):
        refuse(f"loads a model ({cls.__name__}.from_pretrained)", "take the tiny_model_path fixture")

    def save_pretrained(self, *args, **kwargs):
        refuse(f"writes a model ({type(self).__name__}.save_pretrained)", "take the tiny_model_path fixture")

    def vllm_start(self, *args, **kwargs):
        refuse(
            "starts vLLM (VLLMGenerationEngine)",
            "fake its _start as tests/generation/test_vllm_sleep.py does",
        )

    def loop_run(*args, **kwargs):
        refuse("runs the GRPO loop (trainer.loop.grpo.run)", "take the trainer_env fixture")

    popen_init = subprocess.Popen.__init__

    def popen(self, args, *rest, **kwargs):
        what = command_starts(args, kwargs.get("shell", False))
        if what:
            refuse(what)
        popen_init(self, args, *rest, **kwargs)

    def process_start(self):
        refuse(f"starts a process (multiprocessing {type(self).__name__})")

    monkeypatch.setattr(ray, "init", ray_init)
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(from_pretrained))
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", save_pretrained)
    monkeypatch.setattr(VLLMGenerationEngine, "_start", vllm_start)
    monkeypatch.setattr(grpo, "run", loop_run)
    monkeypatch.setattr(subprocess.Popen, "__init__", popen)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", process_start)
