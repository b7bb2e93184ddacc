"""Shared fixtures: a real local Ray instance and the tiny model, built once per session; and the check
that no process the session started outlives it (:mod:`tests.leftovers`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SESSION = pytest.StashKey[str]()  # this session's id in tests.leftovers.MARK


def pytest_configure(config):
    from tests.leftovers import mark_session

    config.stash[SESSION] = mark_session()  # before any test starts a process


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """Fail the suite, naming them, if processes the session started are still running."""
    from tests.leftovers import kill, leftovers

    left = leftovers(session.config.stash[SESSION])
    if not left:
        return
    kill(left)
    lines = "\n".join(f"  pid {pid}: {cmd[:200]}" for pid, cmd in sorted(left.items()))
    session.config.pluginmanager.get_plugin("terminalreporter").write_line(
        f"\nFAILED leftovers: {len(left)} process(es) started by this test session outlived it "
        f"(killed now); the test that started each must end it:\n{lines}", red=True, bold=True
    )
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session", autouse=True)
def _quiet_env(tmp_path_factory):
    from trainer.cluster import QUIET_ENV

    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    # One model cache for the whole session (and for the subprocesses tests start).
    os.environ.setdefault("KUBERL_CACHE", str(tmp_path_factory.mktemp("kuberl-cache")))


@pytest.fixture(scope="session")
def tiny_model_path(_quiet_env) -> str:
    from trainer.models import resolve_model

    return resolve_model("builtin:tiny")


@pytest.fixture(scope="session")
def ray_local():
    """A real Ray instance on this machine (CPU bookkeeping raised so several actors fit)."""
    import ray

    if not ray.is_initialized():
        # 16: a test module may hold several policy groups (1-2 bundles each) and reward actors at once.
        ray.init(address="local", num_cpus=16, num_gpus=0, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
