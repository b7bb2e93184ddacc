"""The run's progress as Prometheus gauges (trainer/tracking/ray_gauges.py), scraped for real from Ray's
metrics port after a real run, and held to the list the chart's alert rules and dashboard read
(charts/kuberl/files/metrics.yaml): a gauge renamed on one side and not the other fails here, instead of
leaving an alert silent on a cluster."""

from __future__ import annotations

import re
import time
import urllib.request

import pytest
import yaml

from tests.conftest import REPO
from tests.tiny_run import train_tiny
from trainer.tracking.ray_gauges import gauge_name

pytestmark = pytest.mark.slow

METRICS = REPO / "charts" / "kuberl" / "files" / "metrics.yaml"
# Series a run of `tiny` (colocated, no validation) has no reason to set: refits of disaggregated engines,
# validation, the async stream's wait.
NOT_IN_TINY = {
    "kuberl_val_accuracy",
    "kuberl_timing_refit_s",
    "kuberl_perf_refit_bytes",
    "kuberl_timing_weight_push_wait_s",
}


def _scrape(port: int, run: str, want: set[str], timeout_s: float = 90) -> dict[str, float]:
    """``ray_kuberl_*`` values of ``run`` on the metrics port, once every series of ``want`` is there (Ray
    reports them every few seconds)."""
    deadline = time.monotonic() + timeout_s
    pattern = re.compile(r'^ray_(kuberl_\w+)\{[^}]*\brun="' + re.escape(run) + r'"[^}]*\} (\S+)$')
    found: dict[str, float] = {}
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        found = {m.group(1): float(m.group(2)) for line in text.splitlines() if (m := pattern.match(line))}
        if want <= found.keys():
            return found
        time.sleep(2)
    raise AssertionError(f"never exported: {sorted(want - found.keys())}; exported: {sorted(found)}")


def test_should_export_the_series_the_alerts_and_dashboard_read_after_a_real_run(trainer_env, tmp_path):
    import ray

    started = time.time()
    _, run_dir = train_tiny(trainer_env, tmp_path, "grpo.max_num_steps=2", "checkpointing.save_period=1")
    wanted = set(yaml.safe_load(METRICS.read_text())["trainer"]) - NOT_IN_TINY
    attached = ray.is_initialized()
    if not attached:
        ray.init(address=trainer_env["RAY_ADDRESS"])  # to find the metrics port of the session's node
    try:
        (node,) = [n for n in ray.nodes() if n["Alive"]]
        port = node["MetricsExportPort"]
    finally:
        if not attached:
            ray.shutdown()
    got = _scrape(port, run_dir.name, wanted)
    assert got["kuberl_train_step"] == 2.0
    assert started <= got["kuberl_checkpoint_last_timestamp_seconds"] <= time.time()
    assert started <= got["kuberl_train_last_step_timestamp_seconds"] <= time.time()
    assert 0.0 <= got["kuberl_train_reward_mean"] <= 1.0


def test_should_name_a_step_scalar_as_the_rules_expect():
    assert gauge_name("train/reward_mean") == "kuberl_train_reward_mean"
    assert gauge_name("perf/peak_memory_gib/rank_0") == "kuberl_perf_peak_memory_gib_rank_0"
