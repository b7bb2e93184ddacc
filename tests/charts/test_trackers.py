"""The chart's experiment trackers (values `logger`), their `helm test` pod, and the optional PodMonitoring
for Ray's own metrics."""

from __future__ import annotations

import jsonschema
import pytest
from chartlib import (
    BASE,
    CHART,
    env_of,
    groups,
    head_template,
    one,
    pod_labels,
    render,
    run_helm,
    schema_errors,
    selects,
)

WANDB = ("logger.backends={tensorboard,wandb}", "secrets.wandbApiKey.secretName=wandb")
MLFLOW = ("logger.backends={tensorboard,mlflow}", "logger.mlflow.trackingUri=http://mlflow.mlflow.svc:5000")

# The fields of monitoring.googleapis.com/v1 PodMonitoring the chart renders, with the constraints its CRD
# puts on them (GoogleCloudPlatform/prometheus-engine, charts/operator/crds/
# monitoring.googleapis.com_podmonitorings.yaml), written out here: ../shared/schemas does not carry that
# CRD yet. Unknown fields fail, as the API server would prune them.
PODMONITORING = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.googleapis.com/v1"},
        "kind": {"const": "PodMonitoring"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "required": ["endpoints", "selector"],
            "additionalProperties": False,
            "properties": {
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["port"], "additionalProperties": False,
                    "properties": {"port": {"type": ["integer", "string"]},
                                   "interval": {"type": "string", "pattern": r"^([0-9]+(ms|s|m|h))+$"}}}},
                "selector": {"type": "object", "additionalProperties": False, "properties": {
                    "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                    "matchExpressions": {"type": "array", "items": {
                        "type": "object", "required": ["key", "operator"], "additionalProperties": False,
                        "properties": {"key": {"type": "string"}, "operator": {"type": "string"},
                                       "values": {"type": "array", "items": {"type": "string"}}}}}}},
                "targetLabels": {"type": "object", "additionalProperties": False, "properties": {
                    "metadata": {"type": "array", "uniqueItems": True, "items": {
                        "enum": ["container", "node", "pod", "top_level_controller_name", "top_level_controller_type"]}},
                    "fromPod": {"type": "array", "maxItems": 100, "items": {
                        "type": "object", "required": ["from"], "additionalProperties": False,
                        "properties": {"from": {"type": "string"},
                                       "to": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$",
                                              "not": {"enum": ["project_id", "location", "cluster", "namespace", "job",
                                                               "instance", "top_level_controller",
                                                               "top_level_controller_type", "__address__"]}}}}}}},
            },
        },
    },
}  # fmt: skip


def logger_env(template: dict) -> dict[str, dict]:
    return {k: v for k, v in env_of(template).items() if k.startswith(("KUBERL_LOGGER", "WANDB_", "MLFLOW_"))}


def tracker_test(docs: list[dict]) -> dict | None:
    found = [d for d in docs if d["kind"] == "Pod" and d["metadata"]["name"].endswith("-test-trackers")]
    return found[0] if found else None


def test_should_log_to_tensorboard_alone_and_read_no_wandb_key_when_logger_is_left_default() -> None:
    docs = render("secrets.wandbApiKey.secretName=wandb")  # a Secret named, but wandb not a backend
    for template in [head_template(docs), *(g["template"] for g in groups(docs).values())]:
        assert logger_env(template) == {
            "KUBERL_LOGGER_BACKENDS": {"name": "KUBERL_LOGGER_BACKENDS", "value": "[tensorboard]"}
        }
    assert tracker_test(docs) is None


def test_should_read_the_wandb_key_into_every_ray_container_only_when_wandb_is_a_backend() -> None:
    docs = render(*WANDB, "logger.wandb.entity=team")
    for template in [head_template(docs), *(g["template"] for g in groups(docs).values())]:
        env = logger_env(template)
        assert env["KUBERL_LOGGER_BACKENDS"]["value"] == "[tensorboard,wandb]"
        assert env["WANDB_PROJECT"]["value"] == "kuberl" and env["WANDB_ENTITY"]["value"] == "team"
        assert env["WANDB_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "wandb", "key": "api-key"}}
        assert "MLFLOW_TRACKING_URI" not in env


def test_should_pass_the_tracking_uri_when_mlflow_is_a_backend() -> None:
    docs = render(*MLFLOW, "logger.mlflow.experiment=gsm8k")
    env = logger_env(head_template(docs))
    assert env["MLFLOW_TRACKING_URI"]["value"] == "http://mlflow.mlflow.svc:5000"
    assert env["MLFLOW_EXPERIMENT_NAME"]["value"] == "gsm8k"
    assert "WANDB_API_KEY" not in env


def test_should_fail_in_one_line_when_mlflow_is_a_backend_without_a_tracking_uri() -> None:
    out = run_helm(
        "template",
        "exp1",
        str(CHART),
        *[a for s in (*BASE, "logger.backends={mlflow}") for a in ("--set", s)],
    )
    assert out.returncode != 0
    assert "logger.mlflow.trackingUri is required when logger.backends has mlflow" in out.stderr


@pytest.mark.parametrize(
    "bad",
    [
        "logger.backends={tensorboard,neptune}",
        "logger.backends={wandb,wandb}",
        "logger.mlflow.trackingUri=mlflow:5000",
    ],
)
def test_should_reject_the_value_when_logger_is_not_what_the_trainer_takes(bad: str) -> None:
    out = run_helm("template", "exp1", str(CHART), *[a for s in (*BASE, bad) for a in ("--set", s)])
    assert out.returncode != 0 and "logger" in out.stderr


@pytest.mark.parametrize("sets", [WANDB, MLFLOW, (*WANDB, *MLFLOW[1:], "logger.backends={wandb,mlflow}")])
def test_should_check_the_trackers_from_beside_the_head_with_the_runs_environment_when_helm_test_runs(
    sets,
) -> None:
    docs = render(*sets)
    pod = tracker_test(docs)
    assert pod is not None and not schema_errors(pod)
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["python", "-m", "trainer.tracking"]
    assert container["image"] == head_template(docs)["spec"]["containers"][0]["image"]
    # the environment the trainer's driver composes its trackers from, exactly
    assert {e["name"]: e for e in container["env"]} == logger_env(head_template(docs))


def test_should_render_no_podmonitoring_when_it_is_disabled() -> None:
    assert not [d for d in render() if d["kind"] == "PodMonitoring"]


@pytest.mark.parametrize("sets", [(), ("job.enabled=true", "experiment=tiny")], ids=["raycluster", "rayjob"])
def test_should_scrape_the_metrics_port_of_the_head_and_every_worker_when_podmonitoring_is_enabled(
    sets,
) -> None:
    """By the release's labels, which KubeRay keeps from the pod templates, and its own ray.io/node-type: a
    RayJob's cluster is named `<name>-<random>`, so `ray.io/cluster=<name>` selected nothing there."""
    docs = render("podMonitoring.enabled=true", "podMonitoring.interval=15s", "sandbox.enabled=true", *sets)
    pm = one(docs, "PodMonitoring")
    assert not list(jsonschema.Draft202012Validator(PODMONITORING).iter_errors(pm))
    scraped = {role for role, labels in pod_labels(docs).items() if selects(pm["spec"]["selector"], labels)}
    # not the sandbox (its policy admits no scraper), the submitter nor the helm test pods: no metrics port
    assert scraped == {"head", "train"}
    assert "ray.io/cluster" not in str(pm["spec"]["selector"])
    (endpoint,) = pm["spec"]["endpoints"]
    assert endpoint == {"port": "metrics", "interval": "15s"}
    # The port it names is declared by every Ray container of the cluster: the head and each worker group.
    spec = one(docs, "RayJob")["spec"]["rayClusterSpec"] if sets else one(docs, "RayCluster")["spec"]
    for template in [spec["headGroupSpec"]["template"], *(g["template"] for g in spec["workerGroupSpecs"])]:
        ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
        assert ports["metrics"] == 8080
    assert not [e for d in docs if d["kind"] != "PodMonitoring" for e in schema_errors(d)]


@pytest.mark.parametrize("enabled", [True, False])
def test_should_admit_managed_prometheus_to_the_metrics_port_only_when_podmonitoring_is_enabled(
    enabled,
) -> None:
    docs = render(f"podMonitoring.enabled={str(enabled).lower()}")
    policy = one(docs, "NetworkPolicy")
    assert not schema_errors(policy)
    scrapes = [
        rule
        for rule in policy["spec"]["ingress"]
        if {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gmp-system"}}}
        in rule.get("from", [])
    ]
    assert scrapes == (
        [
            {
                "from": [
                    {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gmp-system"}}}
                ],
                "ports": [{"protocol": "TCP", "port": 8080}],
            }
        ]
        if enabled
        else []
    )
