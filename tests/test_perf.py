"""trainer.perf: the FLOPs formula against a hand count, the GPU peak table, peak memory readings."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from trainer import perf

from .conftest import REPO

# SmolLM2-135M(-Instruct)'s config.json: hidden 576, intermediate 1536, 30 layers, 9 query heads and 3
# key/value heads of 64, vocabulary 49152, tied embeddings.
#
# Matmul parameters per layer, by hand:
#   q_proj 576 x 576 = 331,776      k_proj 576 x 192 = 110,592      v_proj 576 x 192 = 110,592
#   o_proj 576 x 576 = 331,776      gate, up, down 3 x 576 x 1536 = 2,654,208
#   sum 3,538,944; x 30 layers = 106,168,320
# LM head (the tied embedding, multiplied by every token's last hidden state): 576 x 49152 = 28,311,552
# N = 106,168,320 + 28,311,552 = 134,479,872 (the model's 134,515,008 parameters less 61 RMSNorm weight
# vectors of 576, which no matmul uses: 35,136)
SMOLLM2_N = 134_479_872
# One 64-token sample, forward and backward:
#   linear layers: 6 x N x 64 = 6 x 134,479,872 x 64 = 51,640,270,848
#   attention: 12 x 30 layers x 9 heads x 64 head_dim x (64 x 65 / 2 = 2080 causal pairs)
#            = 207,360 x 2080 = 431,308,800
#   total 52,071,579,648
SMOLLM2_64_TOKENS = 52_071_579_648


def smollm2() -> perf.ModelFlops:
    return perf.ModelFlops.of(
        hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3, head_dim=64, vocab=49152
    )


def test_should_match_the_hand_count_when_counting_smollm2_135m_training_flops() -> None:
    m = smollm2()
    assert m.matmul_params == SMOLLM2_N
    assert m.training([64]) == SMOLLM2_64_TOKENS
    # Samples add up; attention grows with each sample's own pairs, not the batch's.
    assert m.training([64, 64]) == 2 * SMOLLM2_64_TOKENS
    assert m.training([128]) > 2 * SMOLLM2_64_TOKENS
    # A frozen base (LoRA) computes no weight gradients: 4N per token, attention unchanged.
    assert m.training([64], frozen_base=True) == 4 * SMOLLM2_N * 64 + 431_308_800


def test_should_count_the_lm_head_only_on_the_positions_it_projects() -> None:
    """The policy projects only the positions that predict a response token (trainer.policy.batch): a
    sample of 48 prompt and 16 response tokens pays the head 16 times, not 64."""
    m = smollm2()
    head = 576 * 49152
    assert m.head_params == head
    assert m.training([64], projected=16) == SMOLLM2_64_TOKENS - 6 * head * 48
    assert m.training([64], projected=64) == m.training([64])
    assert (
        m.training([64], frozen_base=True, projected=16) == 4 * SMOLLM2_N * 64 + 431_308_800 - 4 * head * 48
    )


def test_should_count_the_matmul_parameters_of_every_linear_when_the_shape_comes_from_the_model(
    tiny_model_path,
) -> None:
    """The formula against the model itself (trainer.plan builds it on the meta device): N is exactly
    the weights of its nn.Linear layers, the LM head included."""
    from trainer.models.shape import model_shape

    shape = model_shape(tiny_model_path)
    # shape.linears are the decoder's (LoRA's targets); the LM head is the one linear beside them
    linears = sum(i * o for pairs in shape.linears.values() for i, o in pairs) + shape.hidden * shape.vocab
    assert perf.ModelFlops.from_shape(shape).matmul_params == linears


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H200", 989.4),
        ("NVIDIA B200", 2250),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA L4", 121),
        ("NVIDIA L40S", 362.05),
    ],
)
def test_should_find_the_bf16_peak_when_the_gpu_is_in_the_table(name: str, tflops: float) -> None:
    assert perf.gpu_peak_flops(name) == pytest.approx(tflops * 1e12)


def test_should_have_no_table_peak_when_the_gpu_is_unknown() -> None:
    assert perf.gpu_peak_flops("NVIDIA GeForce GTX 1080") is None


def test_should_measure_a_cpu_peak_once_when_asked_twice() -> None:
    peak, source = perf.device_peak_flops(torch.device("cpu"), "float32")
    assert peak > 1e8 and "measured matmul" in source
    assert perf.device_peak_flops(torch.device("cpu"), None)[0] == peak  # cached: measured once


def test_should_report_the_interval_peak_when_memory_is_freed_between_readings() -> None:
    """In a fresh process with glibc's default malloc, so that the freed block leaves the resident set (a
    test session's process may keep freed memory: trainer.cluster's keep_freed_memory settings)."""
    code = (
        "import torch\n"
        "from trainer import perf\n"
        "cpu = torch.device('cpu')\n"
        "perf.peak_memory_bytes(cpu)\n"  # start an interval
        "block = torch.ones(64 * 2**20, dtype=torch.uint8)\n"  # 64 MiB, touched
        "del block\n"
        "print(perf.peak_memory_bytes(cpu), perf.peak_memory_bytes(cpu))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    first, second = map(float, out.stdout.split())
    assert first > 0 and second > 0
    assert first - second > 32 * 2**20  # the second interval never held the block


def test_should_divide_by_time_and_peak_when_computing_mfu() -> None:
    assert perf.mfu(50.0, 2.0, 100.0) == pytest.approx(0.25)
    assert perf.mfu(50.0, 2.0, 0.0) == 0.0
