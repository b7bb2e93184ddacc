"""Reading a run back from each tracker's own store, with the tracker's own reader: TensorBoard's event
accumulator, W&B's ``wandb leet inspect --json`` over an offline run's ``.wandb`` log, ``MlflowClient``."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path


def tensorboard(run_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def tensorboard_text(run_dir: Path, tag: str) -> dict[int, str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors(f"{tag}/text_summary")}


def wandb_records(run_dir: Path) -> list[tuple[Path, dict]]:
    """Every record of every offline W&B run under ``run_dir`` (a resumed run adds a directory), in order,
    with the directory of the run that wrote it."""
    records = []
    wandb_cli = Path(sys.executable).with_name("wandb")
    for log in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        out = subprocess.run(
            [str(wandb_cli), "leet", "inspect", "--json", str(log)],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
        records += [(log.parent, json.loads(line)) for line in out.splitlines() if line.startswith("{")]
    return records


def wandb_run(run_dir: Path) -> dict:
    """What W&B holds of a run: its ids, config, history {key: {step: value}} and rollout tables {step: rows}."""
    ids, config, history, tables = set(), {}, {}, {}
    for where, r in wandb_records(run_dir):
        if r["type"] == "run":
            ids.add(r["run"]["run_id"])
            config.update(r["run"].get("config", {}).get("update", {}))
        elif r["type"] == "history":
            item = r["history"]["item"]
            step = int(item["_step"])
            for key, value in item.items():
                if (
                    not key.startswith("_")
                    and isinstance(value, (int, float))
                    and not key.startswith("rollouts.")
                ):
                    history.setdefault(key, {})[step] = float(value)
            if "rollouts.path" in item:
                table = json.loads((where / "files" / item["rollouts.path"]).read_text())
                tables[step] = [dict(zip(table["columns"], row)) for row in table["data"]]
    return {"ids": ids, "config": config, "history": history, "tables": tables}


def mlflow_run(uri: str, run_id: str) -> dict:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    history = {
        key: {m.step: m.value for m in client.get_metric_history(run_id, key)} for key in run.data.metrics
    }
    tables = {}
    # Into a directory of ours: without dst_path MLflow downloads each artifact into a temporary directory
    # of its own that nothing removes.
    with tempfile.TemporaryDirectory(prefix="kuberl-mlflow-readback-") as into:
        for item in client.list_artifacts(run_id, "rollouts"):
            local = client.download_artifacts(run_id, item.path, dst_path=into)
            table = json.loads(Path(local).read_text())
            step = int(Path(item.path).stem.split("_")[1])
            tables[step] = [dict(zip(table["columns"], row)) for row in table["data"]]
    return {"run": run, "params": run.data.params, "history": history, "tables": tables}
