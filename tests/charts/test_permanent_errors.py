"""The RayJob tells the trainer that it retries it, so that a permanent error ends each further attempt at start
(trainer/failures.py): KubeRay retries every failed Ray job whatever its exit code."""

from __future__ import annotations

import json

from tests.charts.chartlib import one, render, schema_errors
from trainer import failures

JOB = ("job.enabled=true", "experiment=gemma3-1b-math")


def test_should_mark_the_ray_job_as_retried_by_a_rayjob_when_job_enabled() -> None:
    job = one(render(*JOB), "RayJob")
    assert not schema_errors(job)  # KubeRay's strict RayJob schema: spec.metadata is a string map
    metadata = job["spec"]["metadata"]
    assert metadata == dict([failures.RETRIED_BY])
    # what Ray's job supervisor gives the entrypoint from `ray job submit --metadata-json`, as the trainer reads it
    seen = {
        failures.JOB_CONFIG_ENV: json.dumps(
            {"runtime_env": {}, "metadata": {**metadata, "job_submission_id": "x"}}
        )
    }
    assert failures.retried_by_rayjob(seen)
