"""Run logging: the trackers of ``logger.backends``, one jsonl of rollouts per step, one console line per step.

Files go under ``logger.log_dir/<experiment>/<run>/``. A resumed run passes its earlier run name and the
trackers' run ids from its checkpoint (:meth:`RunLogger.run_ids`), so TensorBoard appends to the same
directory and W&B and MLflow continue the same runs: each shows one continuous curve.

The trackers (:mod:`trainer.tracking`) start here, and one that cannot is a one-line error before the
first step. One that fails later (a tracking server gone, a full disk) is a warning naming it and the
step, and the others keep logging: a run that trains is never stopped by its metrics.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainer.config import Config
from trainer.tracking import Tracker, open_trackers, table_rows
from trainer.tracking.ray_gauges import RayGauges


def new_run_name() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"


class RunLogger:
    def __init__(
        self,
        cfg: Config,
        run_name: str | None = None,
        resume_step: int = 0,
        run_ids: Mapping[str, str] | None = None,
    ):
        self.cfg = cfg
        self.run_name = run_name or cfg.logger.run_name or new_run_name()
        self.run_dir = Path(cfg.logger.log_dir) / cfg.experiment_name / self.run_name
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.trackers: list[Tracker] = open_trackers(cfg, self.run_dir, self.run_name, resume_step, run_ids)
        # Progress as Prometheus gauges through Ray, whatever the backends: the chart's alerts read them.
        self.gauges = RayGauges(cfg.experiment_name, self.run_name)

    def describe(self) -> str:
        """Where the metrics go, for the start-up line: ``tensorboard, wandb run 1a2b3c, mlflow run 9f8e...``."""
        return (
            ", ".join(t.name + (f" run {t.run_id}" if t.run_id else "") for t in self.trackers)
            or "no tracker"
        )

    def run_ids(self) -> dict[str, str]:
        """Each tracker's run id, for the checkpoint: a resumed run continues these runs."""
        return {t.name: t.run_id for t in self.trackers if t.run_id is not None}

    def _each(self, what: str, step: int, call) -> None:
        for tracker in self.trackers:
            try:
                call(tracker)
            except Exception as e:  # never stop a training run over its metrics; the other trackers go on
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                print(
                    f"kuberl: warning: {tracker.name}: logging the {what} of step {step} failed "
                    f"({type(e).__name__}: {first[:200]}); the other backends keep logging",
                    flush=True,
                )

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self._each("scalars", step, lambda t: t.scalars(step, values))

    def rollouts(self, step: int, rows: list[dict[str, Any]]) -> None:
        """The step's rollouts: all of them to the jsonl, the first ``logger.num_table_rows`` to each tracker."""
        table = table_rows(rows, self.cfg.logger.num_table_rows)
        if table:
            self._each("rollout table", step, lambda t: t.table(step, table))
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
        if (
            "perf/trained_tokens_per_s" in m
        ):  # throughput of both halves, training's MFU, the largest rank's peak
            line += f" | tok/s gen {m['perf/generated_tokens_per_s']:.0f}, train {m['perf/trained_tokens_per_s']:.0f}"
            line += f" | MFU {m['perf/mfu']:.1%}" if "perf/mfu" in m else ""
            line += f" | mem {m['perf/peak_memory_gib_max']:.1f} GiB"
        if self.cfg.grpo.async_.max_staleness >= 1:  # how stale the batch was, and the policy's idle time
            line += (
                f" | stale {m['train/staleness_max']:.0f}, waited "
                f"{m['timing/generation_wait_s'] + m['timing/weight_push_wait_s']:.1f}s"
            )
        if "train/dynamic_sampling_rounds" in m:
            line += f" | {m['train/dynamic_sampling_rounds']:.0f} rounds, {m['train/dynamic_sampling_prompts']:.0f} prompts"
        if "train/tool_calls_mean" in m:  # a tool environment: how much the model leaned on its tools
            line += (
                f" | turns {m['train/turns_mean']:.1f}, tool calls {m['train/tool_calls_mean']:.2f}/sample "
                f"({m['train/tool_call_rate']:.0%} called, {m['train/tool_errors']:.0f} errors, {m['timing/tool_s']:.1f}s)"
            )
        if "val/accuracy" in m:
            line += f" | val {m['val/accuracy']:.3f}"
        print(line, flush=True)

    def close(self, failed: bool = False) -> None:
        for tracker in self.trackers:
            try:
                tracker.close(failed)
            except Exception as e:  # the run's own outcome matters more than a tracker's goodbye
                print(
                    f"kuberl: warning: {tracker.name}: closing failed ({type(e).__name__}: {e})", flush=True
                )
