"""What a step reports (trainer.step_report). perf_metrics: the step's perf/ scalars from the samples
trained on, the train time and each rank's readings (hand-computed). sample_line: the console's line
says what the reward paid for: the answer it judged, or why there was none.
"""

from __future__ import annotations

import pytest

from trainer.config import load
from trainer.perf import ModelFlops
from trainer.step_report import perf_metrics, sample_line

GiB = 2**30
# A toy model: N = 1000 matmul parameters, 2 layers x 2 heads x 4 head_dim.
FLOPS = ModelFlops(matmul_params=1000, layers=2, heads=2, head_dim=4)


def ranks(*gib: float, peak: float = 1e6) -> list[dict]:
    return [{"peak_memory_bytes": g * GiB, "peak_flops": peak, "peak_source": "test"} for g in gib]


def test_should_divide_the_models_flops_by_train_time_and_every_ranks_peak_when_computing_mfu() -> None:
    cfg = load(["experiment=tiny"])
    out = perf_metrics(cfg, [3, 5], 2.0, ranks(1.5, 2.5), FLOPS)
    # tokens 8; linear 6 x 1000 x 8 = 48,000; attention 12 x 2 x 2 x 4 x (6 + 15 pairs) = 4,032
    assert out["perf/trained_tokens_per_s"] == 4.0
    assert out["perf/mfu"] == pytest.approx(52_032 / 2.0 / 2e6)
    assert out["perf/train_tflops_per_s_per_rank"] == pytest.approx(52_032 / 2.0 / 2 / 1e12)
    assert out["perf/peak_memory_gib/rank_0"] == 1.5 and out["perf/peak_memory_gib/rank_1"] == 2.5
    assert out["perf/peak_memory_gib_max"] == 2.5


def test_should_count_four_n_per_token_when_the_base_is_frozen_under_lora() -> None:
    cfg = load(["experiment=tiny", "policy.lora.rank=4"])
    out = perf_metrics(cfg, [3, 5], 1.0, ranks(1.0), FLOPS)
    assert out["perf/mfu"] == pytest.approx((4 * 1000 * 8 + 4_032) / 1e6)


def test_should_report_throughput_and_memory_without_mfu_when_the_models_shape_is_unknown() -> None:
    out = perf_metrics(load(["experiment=tiny"]), [], 1.0, ranks(1.0), None)
    assert out == {
        "perf/trained_tokens_per_s": 0.0,
        "perf/peak_memory_gib/rank_0": 1.0,
        "perf/peak_memory_gib_max": 1.0,
    }


@pytest.mark.parametrize(
    ("row", "line"),
    [
        (
            {
                "response": "13 + 7 = \\boxed{20}",
                "reward": 1.0,
                "extracted_answer": "20",
                "answer_note": "\\boxed{}",
            },
            "'13 + 7 = \\\\boxed{20}' -> reward 1.00, answer '20' (\\boxed{})",
        ),
        (
            {
                "response": "\\boxed{13+7}",
                "reward": 0.0,
                "extracted_answer": "13+7",
                "answer_note": "\\boxed{}: restates the question instead of answering it",
            },
            "'\\\\boxed{13+7}' -> reward 0.00, answer '13+7' (\\boxed{}: restates the question instead of answering it)",
        ),
        (
            {
                "response": "13 + 7 equals **\\boxed{}.",
                "reward": 0.0,
                "extracted_answer": None,
                "answer_note": "empty \\boxed{}",
            },
            "'13 + 7 equals **\\\\boxed{}.' -> reward 0.00, no answer: empty \\boxed{}",
        ),
        (
            {"response": "x", "reward": 0.5, "extracted_answer": None, "answer_note": ""},
            "'x' -> reward 0.50, no answer",
        ),
    ],
)
def test_should_show_the_extracted_answer_when_printing_a_sample(row, line):
    assert sample_line(row) == line


def test_should_clip_the_response_and_the_answer_when_they_are_long():
    row = {"response": "y" * 500, "reward": 1.0, "extracted_answer": "9" * 100, "answer_note": "after '='"}
    assert sample_line(row) == f"{'y' * 160!r} -> reward 1.00, answer {'9' * 60!r} (after '=')"
