"""Run model-written code isolated or not at all: bubblewrap with a seccomp filter, here or in the sandbox service.

- ``limits``: :class:`Limits` (CPU seconds, memory, output, processes) and the run verdicts.
- ``backends``: picks ``bwrap`` once per process and says so; the ``rlimit`` fallback only when asked for by
  name (``KUBERL_SANDBOX=rlimit-without-isolation``).
- ``seccomp``: the syscall filter (ptrace, mount, unshare, keyctl, bpf, ... fail with EPERM).
- ``executor``: compiles (C++) and runs a program once per stdin input, each run in a fresh child and
  directory inside one sandbox; never hangs, never raises on the program.
- ``remote``: :func:`run_tests`, what callers use: the executor here, or with ``KUBERL_SANDBOX_URL`` set, the
  release's sandbox service (batched, retried; a call that fails for good is LOST, never an exception).
- ``server`` and ``wire``: that service (``python -m trainer.sandbox.server``) and its JSON.
- ``parallel``: :func:`map_bounded` spreads calls over the Ray cluster's CPUs (or local threads),
  at most N at a time.
"""

from trainer.sandbox.executor import BatchResult, RunResult
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
from trainer.sandbox.remote import run_tests

__all__ = [
    "BatchResult",
    "COMPILE_LIMITS",
    "ERROR",
    "LOST",
    "Limits",
    "OK",
    "OUTPUT_LIMIT",
    "RUNTIME_ERROR",
    "RunResult",
    "TIMEOUT",
    "run_tests",
]
