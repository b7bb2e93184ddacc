"""Experiment trackers: where a run's scalars, config and rollout tables go besides the console and the jsonl.

``logger.backends`` lists them, any combination of ``tensorboard`` (the default), ``wandb`` and ``mlflow``,
as NeMo-RL's ``logger.*_enabled`` and verl's ``trainer.logger`` list do. Each backend is a
:class:`Tracker` of a few methods, in a module of its own that imports its library only when the run
uses it, and every backend gets the same things: each step's scalars, the run's composed config
flattened to dotted keys (``policy.learning_rate``), and a table of the step's rollouts (prompt,
response, reward, the answer the reward judged and why).

A resumed run continues the same tracker runs: each tracker's :attr:`Tracker.run_id` goes into the
checkpoint's metadata (``training_info.json``, ``tracker_runs``) and comes back to :func:`open_trackers`.

Failing at the right time: what can be known before anything starts (a library that is not installed,
no API key, a tracking server that does not answer) is :func:`check`'s one line, raised as a
:class:`TrackerError` before Ray or a model starts; a tracker that fails once the run trains is a
warning from :class:`trainer.logger.RunLogger`, and the others keep logging.
"""

from __future__ import annotations

import importlib
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from trainer.config import TRACKERS, LoggerConfig

# name -> (module, class); the module is imported only when the backend is used.
BACKENDS = {
    "tensorboard": ("trainer.tracking.tensorboard_tracker", "TensorBoardTracker"),
    "wandb": ("trainer.tracking.wandb_tracker", "WandbTracker"),
    "mlflow": ("trainer.tracking.mlflow_tracker", "MlflowTracker"),
}
assert tuple(BACKENDS) == TRACKERS  # the config validates names against TRACKERS

# The rollout table's columns: enough to read what the reward paid for.
TABLE_COLUMNS = ("step", "prompt", "response", "reward", "extracted_answer", "answer_note", "advantage")
PROBE_TIMEOUT_S = 5.0
EXTRA = "pip install 'kuberl-trainer[tracking]' (`make setup` installs it)"


class TrackerError(RuntimeError):
    """A tracker cannot start; the message names the key and the fix (one line)."""


class Tracker(Protocol):
    name: str
    run_id: (
        str | None
    )  # what a resumed run passes back to continue this tracker's run (None: nothing to pass)

    def scalars(self, step: int, values: Mapping[str, float]) -> None: ...

    def table(self, step: int, rows: list[dict[str, Any]]) -> None:
        """The step's rollouts, one dict per row with :data:`TABLE_COLUMNS` as keys."""

    def close(self, failed: bool = False) -> None: ...


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys with scalar values (lists and empty mappings as their JSON-like text),
    the form W&B and MLflow show and compare runs by."""
    if isinstance(config, Mapping) and config:
        out: dict[str, Any] = {}
        for key, value in config.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if config is None or isinstance(config, (bool, int, float, str)):
        return {prefix: config}
    return {prefix: str(config)}


def table_rows(rows: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """The first ``n`` rollouts of a step's jsonl rows, cut to the table's columns."""
    return [{c: row.get(c) for c in TABLE_COLUMNS} for row in rows[:n]]


# ----- before the run starts ------------------------------------------------------------------------


def _import(module: str, backend: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise TrackerError(
            f"logger.backends has {backend}, but the {module} package is not installed: {EXTRA}"
        ) from None


def _probe(url: str, what: str) -> None:
    """A TCP connection to ``url``'s host and port within PROBE_TIMEOUT_S, or a one-line TrackerError."""
    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=PROBE_TIMEOUT_S):
            pass
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise TrackerError(
            f"{what} {url} is unreachable ({reason}); check the URL, or drop the backend from logger.backends"
        ) from None


def wandb_mode(cfg: LoggerConfig) -> str:
    return cfg.wandb.mode or os.environ.get("WANDB_MODE") or "online"


def mlflow_uri(cfg: LoggerConfig) -> str | None:
    return cfg.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")


def _wandb_has_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:  # `wandb login` writes the key to ~/.netrc
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def check(cfg: LoggerConfig) -> None:
    """Everything about ``logger.backends`` that can fail before the run starts: each in one line."""
    if "wandb" in cfg.backends:
        _import("wandb", "wandb")
        mode = wandb_mode(cfg)
        if mode == "online":
            if not _wandb_has_key():
                raise TrackerError(
                    "logger.backends has wandb, but WANDB_API_KEY is not set (the chart's secrets.wandbApiKey, or "
                    "`wandb login`); set it, or run offline with logger.wandb.mode=offline"
                )
            _probe(
                os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"), "the W&B server (WANDB_BASE_URL)"
            )
    if "mlflow" in cfg.backends:
        _import("mlflow", "mlflow")
        uri = mlflow_uri(cfg)
        if not uri:
            raise TrackerError(
                "logger.backends has mlflow, but no tracking URI: set logger.mlflow.tracking_uri (e.g. "
                "http://mlflow:5000 or sqlite:////data/mlflow.db) or MLFLOW_TRACKING_URI"
            )
        scheme = urlparse(uri).scheme
        if scheme in ("http", "https"):
            _probe(uri, "the MLflow tracking server (logger.mlflow.tracking_uri or MLFLOW_TRACKING_URI)")
        elif scheme == "sqlite":
            _import("sqlalchemy", "mlflow with a sqlite:// store")
            _check_sqlite_path(uri)


def _check_sqlite_path(uri: str) -> None:
    """A SQLite store is a file that MLflow creates: its directory must exist and be writable (MLflow itself
    retries a file it cannot open for minutes before it says so)."""
    path = Path(
        uri.split("://", 1)[1] or "."
    )  # sqlite:////abs/path.db -> /abs/path.db; sqlite:///rel.db -> rel.db
    where = "logger.mlflow.tracking_uri or MLFLOW_TRACKING_URI"
    if path.is_dir():
        raise TrackerError(
            f"{where}={uri}: {path} is a directory; name the database file, e.g. {path / 'mlflow.db'}"
        )
    if not os.access(path.parent if str(path.parent) else ".", os.W_OK):
        raise TrackerError(
            f"{where}={uri}: cannot create the database in {path.parent} (no such directory, "
            "or not writable); pass a writable path"
        )


# ----- the run's trackers ----------------------------------------------------------------------------


def open_trackers(
    cfg, run_dir, run_name: str, resume_step: int, run_ids: Mapping[str, str] | None = None
) -> list[Tracker]:
    """Start every backend of ``cfg.logger.backends`` (``cfg``: the whole run's config); ``run_ids``, from a
    resumed checkpoint, continues each tracker's earlier run. A backend that cannot start is a TrackerError."""
    from trainer.config import to_dict

    config = flatten(to_dict(cfg))
    trackers: list[Tracker] = []
    try:
        for name in cfg.logger.backends:
            module, cls = BACKENDS[name]
            tracker_cls = getattr(_import(module, name), cls)
            trackers.append(
                tracker_cls(
                    cfg,
                    run_dir=run_dir,
                    run_name=run_name,
                    config=config,
                    resume_step=resume_step,
                    run_id=(run_ids or {}).get(name),
                )
            )
    except TrackerError:
        for tracker in trackers:
            tracker.close(failed=True)
        raise
    return trackers
