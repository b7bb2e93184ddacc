"""Shared fixtures: a real local Ray instance and the tiny model, built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


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
        ray.init(num_cpus=16, num_gpus=0, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
