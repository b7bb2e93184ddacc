"""The GPU suite (``make test-gpu``): what a machine with CUDA GPUs runs as it is, marker ``gpu``.

Every test needs some of: CUDA GPUs (one, or two), transformers, vLLM, Ray and Hydra. A missing piece
skips the test with a one-line reason, so the suite collects and skips cleanly on a CPU machine (``make
test`` includes it) and runs what fits on a GPU node whose image lacks some of them. The FSDP2, hf-engine
and NCCL-broadcast tests need only torch (and transformers for a model); processes are plain
subprocesses, not Ray actors.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from trainer.ports import free_port as _pick

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session", autouse=True)
def _quiet_env(tmp_path_factory):
    """The suite-wide one (tests/conftest.py), without Ray: ``trainer.cluster`` imports it, and a GPU node's
    Python may have torch alone."""
    try:
        from trainer.cluster import QUIET_ENV
    except ImportError:  # no ray
        QUIET_ENV = {"TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"}
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("KUBERL_CACHE", str(tmp_path_factory.mktemp("kuberl-cache")))


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(n: int) -> pytest.MarkDecorator:
    """Skip (one line, at the test) unless this machine has ``n`` CUDA GPUs."""
    have = gpus()
    if have == 0:
        reason = "no CUDA GPU here (torch.cuda.is_available() is False)"
    else:
        reason = f"needs {n} CUDA GPUs, this machine has {have}"
    return pytest.mark.skipif(have < n, reason=reason)


def need(module: str, why: str):
    """The module, or a one-line skip naming it and what needs it."""
    return pytest.importorskip(module, reason=f"{module} is not installed: {why}")


def free_port() -> int:
    return _pick("127.0.0.1")  # outside the ephemeral range (trainer.ports)
