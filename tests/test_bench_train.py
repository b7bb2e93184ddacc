"""`make bench-train` at the smallest size, as a new user runs it: the benchmark is part of the product, and it
once crashed in torch's FSDPMemTracker (the policy never calls the root module's forward, where the tracker
opens its record) without a test noticing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import REPO

pytestmark = pytest.mark.slow


def test_should_run_bench_train_with_its_memory_pass_and_print_the_table() -> None:
    out = subprocess.run(
        [sys.executable, "bench/bench_train.py", "--prompts", "1", "--group", "2", "--max-response", "32",
         "--repeats", "1", "--layouts", "packed", "--no-profile", "--memory"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    lines = out.stdout.splitlines()
    assert any(line.startswith("packed ") and "%" in line for line in lines), out.stdout  # tokens/s, MFU
    assert any("peak of live tensors in a step" in line for line in lines), out.stdout


def test_should_time_a_cpu_rows_batched_attention_beside_sdpa_per_sample_on_the_same_step() -> None:
    """bf16 on a CPU, the rows' attention as the trainer runs it (like-length samples batched) and as it ran
    before (sdpa per sample), taking turns: the same loss, and the ratio printed."""
    out = subprocess.run(
        [sys.executable, "bench/bench_train.py", "--prompts", "1", "--group", "4", "--max-response", "32",
         "--repeats", "1", "--layouts", "packed", "--no-profile", "--no-memory", "--param-dtype", "bfloat16",
         "--attention", "batched,per-sample"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    # the table's rows: name, first s, median s, min s, tokens/s, MFU, loss, grad gap
    table = [cells for cells in map(str.split, lines) if len(cells) == 8 and cells[5].endswith("%")]
    losses = {cells[0]: cells[6] for cells in table}
    assert set(losses) == {"packed/batched", "packed/per-sample"}, out.stdout
    assert len(set(losses.values())) == 1, out.stdout  # the same step, to the printed digits
    assert any(line.startswith("packed/batched / packed/per-sample tokens/s") for line in lines), out.stdout


def test_should_turn_a_bench_row_that_did_not_run_into_one_line_naming_its_error() -> None:
    """`make bench BENCH_VLLM=1`: TRL's own vLLM crashed at its first weight sync on vLLM's CPU build and the
    whole bench exited before its table; now that row is one line of the table and the others print."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_grpo", REPO / "bench" / "bench_grpo.py")
    bench_grpo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_grpo)
    error = RuntimeError(
        "trl+vllm exited with 1; its log (/tmp/run/trl+vllm.log) ends:\n"
        '    File "trl/trainer/grpo_trainer.py", line 1234, in _move_model_to_vllm\n'
        "    AttributeError: 'Parameter' object has no attribute 'weight_loader'"
    )
    assert bench_grpo.why_failed(error) == (
        "trl+vllm exited with 1: AttributeError: 'Parameter' object has no attribute 'weight_loader'"
    )
    assert bench_grpo.why_failed(RuntimeError("kuberl exited with 3")) == "kuberl exited with 3"
