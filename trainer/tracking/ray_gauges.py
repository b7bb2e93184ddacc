"""The run's progress as Prometheus gauges, through Ray's metrics: what the chart's alert rules and
dashboard read (charts/kuberl/files/metrics.yaml lists every series).

On the driver, each step's scalar ``group/key`` becomes the gauge ``kuberl_group_key`` (every character
outside ``[a-zA-Z0-9_]`` an underscore), labelled with the experiment and the run; beside them
``kuberl_train_step``, ``kuberl_train_last_step_timestamp_seconds`` and
``kuberl_checkpoint_last_timestamp_seconds``. Ray exports them as ``ray_kuberl_*`` on the metrics port of
the driver's node (the head's 8080 on the chart's clusters, which its PodMonitoring scrapes): no new port,
Service or NetworkPolicy rule. Without Ray (a unit test) nothing is exported. An export that fails is one
warning, never a stopped run.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from typing import Any

_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")
TAGS = ("experiment", "run")


def gauge_name(key: str) -> str:
    """``train/reward_mean`` -> ``kuberl_train_reward_mean``."""
    return "kuberl_" + _UNSAFE.sub("_", key)


class RayGauges:
    def __init__(self, experiment: str, run: str):
        import ray

        self.enabled = ray.is_initialized()
        self.tags = {"experiment": experiment, "run": run}
        self._gauges: dict[str, Any] = {}
        self._warned = False

    def _set(self, name: str, value: float) -> None:
        from ray.util.metrics import Gauge

        gauge = self._gauges.get(name)
        if gauge is None:
            gauge = self._gauges[name] = Gauge(name, description=f"kuberl: {name}", tag_keys=TAGS)
        gauge.set(float(value), tags=self.tags)

    def _guarded(self, values: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        try:
            for name, value in values.items():
                self._set(name, value)
        except Exception as e:  # metrics never stop a run; one warning, then quiet
            if not self._warned:
                self._warned = True
                print(f"kuberl: warning: exporting Prometheus gauges through Ray failed ({type(e).__name__}: "
                      f"{e}); the trackers keep logging", flush=True)  # fmt: skip

    def started(self, step: int, checkpoint_time: float | None) -> None:
        """At start or resume: the step it continues from, now as the last step's time (a run that never
        finishes a step then trips the no-step alert), and the newest checkpoint's time when checkpointing."""
        now = time.time()
        values = {"kuberl_train_step": float(step), "kuberl_train_last_step_timestamp_seconds": now}
        if checkpoint_time is not None:
            values["kuberl_checkpoint_last_timestamp_seconds"] = checkpoint_time
        self._guarded(values)

    def step(self, step: int, scalars: Mapping[str, float]) -> None:
        values = {gauge_name(k): v for k, v in scalars.items() if isinstance(v, (int, float))}
        values["kuberl_train_step"] = float(step)
        values["kuberl_train_last_step_timestamp_seconds"] = time.time()
        self._guarded(values)

    def checkpointed(self, at: float) -> None:
        self._guarded({"kuberl_checkpoint_last_timestamp_seconds": at})
