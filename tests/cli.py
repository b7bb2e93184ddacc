"""A command's ``main(argv)`` run in this process, as a test would run ``python -m MODULE ARGV``.

A new interpreter pays seconds of imports (torch, transformers, Ray, Hydra) before the first line of the
command runs; a test that checks a one-line error or a printed table needs the command, not the process.
:func:`run_main` gives it what the process gave it: an environment of its own, the repository as its
working directory, and its stdout, stderr and exit status back as a ``CompletedProcess``; afterwards the
environment, the working directory and the root logger are as they were. Warnings and log records that a
fresh interpreter would print on stderr land in the captured stderr, so a test that counts stderr's lines
sees them. A test that needs the process itself (signals, leftovers, a clean import state, Ray attached to
the process) still starts one. :func:`no_cluster_env` is the environment the submit commands and the
make targets around them are tested in: no cluster anywhere.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# What a fresh interpreter does not print (Python's default warning filters).
_QUIET_WARNINGS = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)


def no_cluster_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This environment with no cluster anywhere (no RAY_ADDRESS, no kube context) and a private state dir,
    for the submit commands and the make targets around them; ``extra`` on top."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "EXP", "NAMESPACE")}
    env.update(KUBERL_STATE_DIR=str(tmp_path / "state"), KUBECONFIG=str(tmp_path / "no-kubeconfig"))
    env.update(extra)
    return env


def run_main(
    main: Callable[[list[str]], int | None],
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    cwd: Path = REPO,
) -> subprocess.CompletedProcess:
    """``main(argv)`` with ``env`` as the whole environment (None: this one), from ``cwd``; its exit status
    is what it returns or the code of the ``SystemExit`` it raises (argparse's), as the process's would be."""
    saved_env, saved_cwd = dict(os.environ), Path.cwd()
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    out, err = io.StringIO(), io.StringIO()
    # A process without logging set up prints WARNING and above on stderr (logging.lastResort).
    stderr_log = logging.StreamHandler(err)
    stderr_log.setLevel(logging.WARNING)
    try:
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        os.chdir(cwd)
        root.addHandler(stderr_log)
        with (
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
            warnings.catch_warnings(record=True) as caught,
        ):
            warnings.simplefilter("default")
            try:
                code = main(list(argv))
            except SystemExit as e:
                if isinstance(e.code, str):  # sys.exit("message"): printed, status 1
                    print(e.code, file=err)
                code = e.code if isinstance(e.code, int) else (1 if e.code else 0)
        for w in caught:
            if not issubclass(w.category, _QUIET_WARNINGS):
                err.write(warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line))
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return subprocess.CompletedProcess(list(argv), code or 0, out.getvalue(), err.getvalue())


def refuse_ray(monkeypatch) -> None:
    """For ``python -m trainer`` runs that must stop before Ray starts: should one get that far, the test
    fails there, instead of a run attaching Ray to the test's process for the rest of the session. The
    driver's heap freeze (trainer.heap.settle) is skipped too: it is the driver's, not the test process's."""
    from trainer import cluster, heap

    def init_ray(cfg) -> None:
        raise AssertionError("the run got as far as starting Ray; it should have stopped before")

    monkeypatch.setattr(cluster, "init_ray", init_ray)
    monkeypatch.setattr(heap, "settle", lambda *modules: None)
