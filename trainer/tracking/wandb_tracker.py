"""Weights & Biases: one W&B run per kuberl run, continued on resume.

Project, entity and group come from ``logger.wandb`` (or W&B's own ``WANDB_PROJECT``, ``WANDB_ENTITY``), the run's name is the kuberl run's, the API key
from the environment (``WANDB_API_KEY``, which the chart fills from its Secret), and ``WANDB_MODE=offline``
(or ``logger.wandb.mode``) writes the run under the run directory for a later ``wandb sync``. Files go
to ``<run dir>/wandb/``. Scalars are logged at the trainer's step; a resumed run continues the same
W&B run (``id``, ``resume="allow"``), where W&B keeps the first values of steps that are redone after
the checkpoint (it accepts no step below its last one). The rollout table is a ``wandb.Table`` per step.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from trainer.tracking import TrackerError, wandb_mode

INIT_TIMEOUT_S = 60  # an online start that hangs longer is a one-line error, not a stuck run


class WandbTracker:
    name = "wandb"

    def __init__(
        self,
        cfg,
        run_dir,
        run_name: str,
        config: Mapping[str, Any],
        resume_step: int,
        run_id: str | None = None,
    ):
        import wandb

        w = cfg.logger.wandb
        mode = wandb_mode(cfg.logger)
        try:
            self.run = wandb.init(
                project=w.project or os.environ.get("WANDB_PROJECT") or "kuberl",
                entity=w.entity,
                group=w.group or cfg.experiment_name,
                name=run_name,
                id=run_id,
                resume="allow" if run_id else None,
                dir=str(run_dir),
                config=dict(config),
                mode=mode,
                settings=wandb.Settings(init_timeout=INIT_TIMEOUT_S, silent=True),
            )
        except Exception as e:  # wandb's errors (auth, network, a bad entity) as one line
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TrackerError(
                f"logger.backends has wandb, but the W&B run did not start ({mode}): {first}"
            ) from None
        self.run_id = self.run.id
        self._wandb = wandb

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log({k: float(v) for k, v in values.items()}, step=step)

    def table(self, step: int, rows: list[dict[str, Any]]) -> None:
        if rows:
            columns = list(rows[0])
            table = self._wandb.Table(columns=columns, data=[[row[c] for c in columns] for row in rows])
            self.run.log({"rollouts": table}, step=step)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)
