"""MLflow: one MLflow run per kuberl run, in the experiment ``logger.mlflow.experiment`` (default:
``MLFLOW_EXPERIMENT_NAME``, else the kuberl experiment's name), continued on resume.

The tracking URI is ``logger.mlflow.tracking_uri`` or ``MLFLOW_TRACKING_URI``: a server (``http://...``),
a SQLite database (``sqlite:////path/mlflow.db``) or, kept for existing set-ups, a ``file:`` directory.
The client API is used throughout (no ``mlflow.start_run`` global state). The config is logged as
parameters (flattened; MLflow's parameters are immutable, so a resumed run adds new keys and keeps the
first value of a changed one, saying so) and as ``config.json``; each step's rollout table is a
``rollouts/step_N.json`` table artifact (``MlflowClient.log_table``, shown in MLflow's artifact view).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from trainer.tracking import TrackerError, mlflow_uri

MAX_PARAM_VALUE = 6000  # MLflow's limit on a parameter's value (characters)
PARAMS_PER_BATCH = 100  # and on parameters per log_batch


class MlflowTracker:
    name = "mlflow"

    def __init__(
        self,
        cfg,
        run_dir,
        run_name: str,
        config: Mapping[str, Any],
        resume_step: int,
        run_id: str | None = None,
    ):
        uri = mlflow_uri(cfg.logger)
        scheme = urlparse(uri).scheme
        if scheme == "file" or (not scheme and uri):
            # MLflow 3 refuses its file store unless asked; naming a file: URI is asking.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow import MlflowClient

        experiment = (
            cfg.logger.mlflow.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or cfg.experiment_name
        )
        try:
            self.client = MlflowClient(tracking_uri=uri)
            self.run_id = self._start(experiment, run_name, run_id, cfg, scheme)
        except TrackerError:
            raise
        except Exception as e:  # MlflowException, a refused connection, a locked database: one line
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TrackerError(
                f"logger.backends has mlflow, but the MLflow run did not start ({uri}): {first}"
            ) from None
        self._log_config(config, resumed=run_id == self.run_id)

    def _start(self, experiment: str, run_name: str, run_id: str | None, cfg, scheme: str) -> str:
        if run_id is not None:
            try:
                run = self.client.get_run(run_id)
            except Exception:  # deleted, or another store: a new run says so rather than failing the resume
                print(
                    f"kuberl: mlflow: run {run_id} of the checkpoint is not in this store; starting a new one",
                    flush=True,
                )
            else:
                self.client.update_run(run.info.run_id, status="RUNNING")
                return run.info.run_id
        found = self.client.get_experiment_by_name(experiment)
        if found is not None:
            experiment_id = found.experiment_id
        else:
            location = cfg.logger.mlflow.artifact_location
            if location is None and scheme in (
                "sqlite",
                "file",
                "",
            ):  # a local store: artifacts beside the logs
                location = Path(cfg.logger.log_dir).resolve().joinpath("mlflow-artifacts").as_uri()
            experiment_id = self.client.create_experiment(experiment, artifact_location=location)
        run = self.client.create_run(
            experiment_id, run_name=run_name, tags={"kuberl.experiment": cfg.experiment_name}
        )
        return run.info.run_id

    def _log_config(self, config: Mapping[str, Any], resumed: bool) -> None:
        from mlflow.entities import Param

        params = {k[:250]: str(v)[:MAX_PARAM_VALUE] for k, v in config.items()}
        if resumed:
            logged = self.client.get_run(self.run_id).data.params
            changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v)
            if changed:
                print(
                    f"kuberl: mlflow: parameters cannot change within a run; keeping the first values of "
                    f"{', '.join(changed)}",
                    flush=True,
                )
            params = {k: v for k, v in params.items() if k not in logged}
        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[i : i + PARAMS_PER_BATCH])
        if not resumed:
            self.client.log_dict(self.run_id, dict(config), "config.json")

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def table(self, step: int, rows: list[dict[str, Any]]) -> None:
        if rows:
            data = {c: [row[c] for row in rows] for c in rows[0]}
            self.client.log_table(self.run_id, data=data, artifact_file=f"rollouts/step_{step}.json")

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
