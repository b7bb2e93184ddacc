"""The engine contract on a compiled vLLM CPU engine (``generation.enforce_eager=false``, inductor).

A compiled CPU engine must be the first vLLM engine in its process (see ``_engines_started`` in
:mod:`trainer.generation.vllm_engine`), and this test session has started others, so the contract's
``vllm-compiled`` cases run in a fresh pytest process of their own. The guard itself is tested here too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.config import GenerationConfig

pytestmark = [pytest.mark.vllm, pytest.mark.integration]  # a pytest session of its own

CONTRACT = Path(__file__).with_name("test_engine_contract.py")


def test_should_pass_the_engine_contract_when_vllm_is_compiled(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(CONTRACT),
            "-k",
            "vllm-compiled",
        ],
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    tail = out.stdout[-3000:] + out.stderr[-2000:]
    assert out.returncode == 0, tail
    assert " passed" in out.stdout and "skipped" not in out.stdout.splitlines()[-1], tail


def test_should_refuse_a_compiled_cpu_engine_when_another_engine_ran_in_the_process(
    tiny_model_path, monkeypatch
):
    from trainer.generation import vllm_engine

    monkeypatch.setattr(vllm_engine, "_engines_started", 1)
    with pytest.raises(RuntimeError, match="generation.enforce_eager=false: on CPU a compiled"):
        vllm_engine.VLLMGenerationEngine(
            tiny_model_path, GenerationConfig(enforce_eager=False), "float32", seed=0, max_model_len=256
        )
