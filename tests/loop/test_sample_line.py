"""The console's sample line says what the reward paid for: the answer it judged, or why there was none."""

from __future__ import annotations

import pytest

from trainer.loop.grpo import sample_line


@pytest.mark.parametrize(
    ("row", "line"),
    [
        (
            {"response": "13 + 7 = \\boxed{20}", "reward": 1.0, "extracted_answer": "20", "answer_note": "\\boxed{}"},
            "'13 + 7 = \\\\boxed{20}' -> reward 1.00, answer '20' (\\boxed{})",
        ),
        (
            {"response": "\\boxed{13+7}", "reward": 0.0, "extracted_answer": "13+7",
             "answer_note": "\\boxed{}: restates the question instead of answering it"},
            "'\\\\boxed{13+7}' -> reward 0.00, answer '13+7' (\\boxed{}: restates the question instead of answering it)",
        ),
        (
            {"response": "13 + 7 equals **\\boxed{}.", "reward": 0.0, "extracted_answer": None,
             "answer_note": "empty \\boxed{}"},
            "'13 + 7 equals **\\\\boxed{}.' -> reward 0.00, no answer: empty \\boxed{}",
        ),
        ({"response": "x", "reward": 0.5, "extracted_answer": None, "answer_note": ""}, "'x' -> reward 0.50, no answer"),
    ],
)
def test_should_show_the_extracted_answer_when_printing_a_sample(row, line):
    assert sample_line(row) == line


def test_should_clip_the_response_and_the_answer_when_they_are_long():
    row = {"response": "y" * 500, "reward": 1.0, "extracted_answer": "9" * 100, "answer_note": "after '='"}
    assert sample_line(row) == f"{'y' * 160!r} -> reward 1.00, answer {'9' * 60!r} (after '=')"
