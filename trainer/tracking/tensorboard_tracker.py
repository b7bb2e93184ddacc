"""TensorBoard: scalars and, as text, the config and each step's rollout table, in the run's own directory.

On resume the event files of the same directory continue, and the steps logged after the checkpoint
are hidden (``purge_step``): they are about to be redone, so the curve stays one line.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _cell(value: Any) -> str:
    """A markdown table cell: one line, pipes escaped."""
    text = f"{value:.3f}" if isinstance(value, float) else "" if value is None else str(value)
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ⏎ ")


def markdown_table(rows: list[dict[str, Any]]) -> str:
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


class TensorBoardTracker:
    name = "tensorboard"
    run_id = None  # the run directory is the run: a resumed run passes its name, not an id

    def __init__(
        self,
        cfg,
        run_dir,
        run_name: str,
        config: Mapping[str, Any],
        resume_step: int,
        run_id: str | None = None,
    ):
        from torch.utils.tensorboard import SummaryWriter

        resumed = resume_step > 0
        self.writer = SummaryWriter(log_dir=str(run_dir), purge_step=resume_step + 1 if resumed else None)
        if not resumed:
            self.writer.add_text(
                "config", markdown_table([{"key": k, "value": v} for k, v in config.items()]), 0
            )

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, float(value), step)
        self.writer.flush()

    def table(self, step: int, rows: list[dict[str, Any]]) -> None:
        if rows:
            self.writer.add_text("rollouts", markdown_table(rows), step)
            self.writer.flush()

    def close(self, failed: bool = False) -> None:
        self.writer.close()
