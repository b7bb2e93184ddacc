"""Run logging: TensorBoard scalars, one jsonl of rollouts per step, one console line per step.

Everything goes under ``logger.log_dir/<experiment>/<run>/``. A resumed run passes its earlier run
name and keeps appending to the same directory, so TensorBoard shows one continuous curve.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from trainer.config import Config


def new_run_name() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"


class RunLogger:
    def __init__(self, cfg: Config, run_name: str | None = None, resume_step: int = 0):
        self.cfg = cfg
        self.run_name = run_name or cfg.logger.run_name or new_run_name()
        self.run_dir = Path(cfg.logger.log_dir) / cfg.experiment_name / self.run_name
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.writer = None
        if cfg.logger.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # On resume, steps logged after the checkpoint are hidden: they are about to be redone.
            purge = resume_step + 1 if run_name else None
            self.writer = SummaryWriter(log_dir=str(self.run_dir), purge_step=purge)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is None:
            return
        for key, value in values.items():
            self.writer.add_scalar(key, float(value), step)
        self.writer.flush()

    def rollouts(self, step: int, rows: list[dict[str, Any]]) -> None:
        if not self.cfg.logger.save_rollouts:
            return
        path = self.run_dir / f"train_data_step{step}.jsonl"
        tmp = path.with_suffix(".jsonl.tmp")
        with open(tmp, "w") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.replace(tmp, path)

    def console(self, step: int, m: dict[str, float]) -> None:
        total = self.cfg.grpo.max_num_steps
        line = (
            f"step {step:>4}/{total} | reward {m['train/reward_mean']:.3f} "
            f"[{m['train/reward_min']:.2f}, {m['train/reward_max']:.2f}] | "
            f"len {m['train/mean_generation_length']:.1f} | loss {m['train/loss']:+.4f} | "
            f"{m['timing/step_s']:.1f}s (gen {m['timing/generation_s']:.1f}, train {m['timing/train_s']:.1f})"
        )
        if self.cfg.grpo.async_.max_staleness >= 1:  # how stale the batch was, and the policy's idle time
            line += (f" | stale {m['train/staleness_max']:.0f}, waited "
                     f"{m['timing/generation_wait_s'] + m['timing/weight_push_wait_s']:.1f}s")
        if "train/dynamic_sampling_rounds" in m:
            line += f" | {m['train/dynamic_sampling_rounds']:.0f} rounds, {m['train/dynamic_sampling_prompts']:.0f} prompts"
        if "val/accuracy" in m:
            line += f" | val {m['val/accuracy']:.3f}"
        print(line, flush=True)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
