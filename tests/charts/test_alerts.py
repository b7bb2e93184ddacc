"""The chart's alert rules and Grafana dashboard (values `monitoring`): both rule formats render the same
groups from files/alerts.yaml and validate against their CRDs, promtool accepts them, promtool's unit
tests show every alert firing on the series that should fire it and staying quiet on its near misses,
and every series a rule or a panel reads is in files/metrics.yaml.

promtool is bin/promtool (`make promtool`, from Debian's prometheus package). Under `make` a missing
promtool fails these tests; a bare pytest skips them with the reason.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml
from chartlib import CHART, REPO, SCHEMAS, render, run_helm

HERE = Path(__file__).parent
ALL_ALERTS = (
    "job.enabled=true",
    "experiment=x",
    "podDisruptionBudget.enabled=true",
    "monitoring.alerts.enabled=true",
)
OPERATOR = (*ALL_ALERTS, "monitoring.alerts.format=prometheusOperator")
RULE_KINDS = {
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule-v1-strict.json",
    ("monitoring.googleapis.com/v1", "Rules"): "gmp-rules-v1-strict.json",
    ("monitoring.googleapis.com/v1", "ClusterRules"): "gmp-clusterrules-v1-strict.json",
}  # fmt: skip
METRICS = yaml.safe_load((CHART / "files" / "metrics.yaml").read_text())
DASHBOARD = json.loads((CHART / "files" / "dashboard.json").read_text())


def known_series() -> set[str]:
    """Every series name files/metrics.yaml lists, as it is queried: the trainer's gauges through Ray's
    `ray_` prefix (ray.util.metrics), the others as their exporters name them."""
    names = {f"ray_{name}" for name in METRICS["trainer"]}
    for source in ("ray", "kube-state-metrics", "kuberay-operator"):
        names |= set(METRICS[source])
    return names


_LABEL_LISTS = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}


def series_names(expr: str) -> set[str]:
    """The series a PromQL expression selects: identifiers that are neither functions, label names,
    keywords nor numbers."""
    text = re.sub(r"\{[^{}]*\}", " ", re.sub(r'"[^"]*"', '""', expr))  # matchers and strings out
    text = _LABEL_LISTS.sub(" ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range selectors
    names = set()
    for m in re.finditer(r"(?<![\w.$])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\()?", text):
        if not m.group(2) and m.group(1).lower() not in _KEYWORDS:
            names.add(m.group(1))
    return names


def promtool() -> Path:
    found = REPO / "bin" / "promtool"
    if not found.exists() and shutil.which("promtool"):
        found = Path(shutil.which("promtool"))
    if found.exists():
        return found
    msg = "bin/promtool is missing: run `make promtool` (make test does it)"
    if os.environ.get("KUBERL_REQUIRE_PROMTOOL"):
        pytest.fail(msg, pytrace=False)
    pytest.skip(msg)


def rule_objects(*sets: str) -> list[dict]:
    return [d for d in render(*sets) if (d["apiVersion"], d["kind"]) in RULE_KINDS]


@functools.cache
def rule_schema(api_version: str, kind: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(
        json.loads((HERE / "schemas" / RULE_KINDS[(api_version, kind)]).read_text())
    )


def groups_of(objs: list[dict]) -> list[dict]:
    """The rule groups of these objects, the release's group first (helm orders the objects by kind)."""
    return sorted(
        (g for o in objs for g in o["spec"]["groups"]), key=lambda g: g["name"].endswith("-cluster")
    )


def run_promtool(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(promtool()), *args], capture_output=True, text=True, timeout=60, cwd=tmp_path)


def write_rules(tmp_path: Path, groups: list[dict]) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return path


# ---------------------------------------------------------------------------------------------------------
# Rendering


def test_should_render_no_rules_and_no_dashboard_when_monitoring_is_left_default() -> None:
    docs = render("job.enabled=true", "experiment=x")
    assert not [d for d in docs if (d["apiVersion"], d["kind"]) in RULE_KINDS]
    assert not [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard")]


def test_should_render_managed_rules_and_cluster_rules_when_the_format_is_managed() -> None:
    objs = rule_objects(*ALL_ALERTS)
    assert sorted(o["kind"] for o in objs) == ["ClusterRules", "Rules"]
    by_kind = {o["kind"]: o for o in objs}
    # ClusterRules is cluster-scoped: its name carries the namespace, so two releases of one name differ
    assert by_kind["ClusterRules"]["metadata"]["name"] == "exp-exp1"
    assert "namespace" not in by_kind["ClusterRules"]["metadata"]
    alerts = {o["kind"]: [r["alert"] for g in o["spec"]["groups"] for r in g["rules"]] for o in objs}
    assert alerts["Rules"] == ["KuberlNoTrainingStep", "KuberlCheckpointTooOld", "KuberlGPUsIdle"]
    assert alerts["ClusterRules"] == ["KuberlPodPending", "KuberlDisruptionBudgetBlocksDrain", "KuberlRayJobNearBackoffLimit"]  # fmt: skip


def test_should_render_only_namespaced_rules_when_cluster_rules_are_turned_off() -> None:
    objs = rule_objects(*ALL_ALERTS, "monitoring.alerts.clusterRules=false")
    assert [o["kind"] for o in objs] == ["Rules"]


def test_should_render_the_same_groups_in_both_formats_when_the_format_changes() -> None:
    managed = groups_of(rule_objects(*ALL_ALERTS))
    (operator,) = rule_objects(*OPERATOR)
    assert operator["kind"] == "PrometheusRule"
    assert operator["spec"]["groups"] == managed


@pytest.mark.parametrize("sets", [ALL_ALERTS, OPERATOR, ("monitoring.alerts.enabled=true",)], ids=["managed", "operator", "raycluster"])  # fmt: skip
def test_should_satisfy_the_crd_schemas_when_alerts_render(sets: tuple[str, ...]) -> None:
    objs = rule_objects(*sets, "monitoring.alerts.labels.release=kube-prometheus-stack")
    assert objs
    for o in objs:
        errors = [f"{o['kind']} {'/'.join(map(str, e.absolute_path))}: {e.message}"
                  for e in rule_schema(o["apiVersion"], o["kind"]).iter_errors(o)]  # fmt: skip
        assert not errors, errors
        assert o["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_should_leave_out_the_job_and_budget_alerts_when_there_is_no_rayjob_or_budget() -> None:
    alerts = [
        r["alert"]
        for g in groups_of(
            rule_objects("monitoring.alerts.enabled=true", "podDisruptionBudget.enabled=false")
        )
        for r in g["rules"]
    ]
    assert "KuberlRayJobNearBackoffLimit" not in alerts and "KuberlDisruptionBudgetBlocksDrain" not in alerts
    assert "KuberlPodPending" in alerts


def test_should_put_thresholds_from_values_into_the_rules_when_they_are_set() -> None:
    sets = (*OPERATOR, "monitoring.alerts.noStepMinutes=7", "monitoring.alerts.gpuIdleMinutes=9",
            "monitoring.alerts.gpuIdlePercent=2", "job.backoffLimit=3", "monitoring.alerts.retriesLeft=5",
            "monitoring.alerts.namespaceLabel=exported_namespace")  # fmt: skip
    rules = {r["alert"]: r for g in groups_of(rule_objects(*sets)) for r in g["rules"]}
    assert rules["KuberlNoTrainingStep"]["expr"].endswith("> 420")
    assert rules["KuberlGPUsIdle"]["for"] == "9m" and rules["KuberlGPUsIdle"]["expr"].endswith("< 2")
    assert rules["KuberlRayJobNearBackoffLimit"]["expr"].endswith(">= 1")  # never 0: that would always fire
    # the exporters' namespace label moves; the release's own series keep the scrape's namespace
    assert 'exported_namespace="exp"' in rules["KuberlPodPending"]["expr"]
    assert 'namespace="exp"' in rules["KuberlNoTrainingStep"]["expr"]


def test_should_refuse_an_unknown_format_when_values_are_validated() -> None:
    out = run_helm("template", "r", str(CHART), "--set", "storage.gcsfuse.bucketName=b",
                   "--set", "monitoring.alerts.enabled=true", "--set", "monitoring.alerts.format=thanos")  # fmt: skip
    assert out.returncode != 0 and "/monitoring/alerts/format" in out.stderr


# ---------------------------------------------------------------------------------------------------------
# promtool


@pytest.mark.parametrize("sets", [ALL_ALERTS, OPERATOR], ids=["managed", "operator"])
def test_should_pass_promtool_check_rules_when_rendered(sets: tuple[str, ...], tmp_path: Path) -> None:
    path = write_rules(tmp_path, groups_of(rule_objects(*sets)))
    out = run_promtool(tmp_path, "check", "rules", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 6 rules found" in out.stdout


def _humanize_duration(seconds: float) -> str:
    """Prometheus' humanizeDuration, for the whole seconds the cases use."""
    d, rest = divmod(int(seconds), 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    if d:
        return f"{d}d {h}h {m}m {s}s"
    if h:
        return f"{h}h {m}m {s}s"
    if m:
        return f"{m}m {s}s"
    return f"{s}s"


def _expand(text: str, labels: dict[str, str], value: float) -> str:
    """The alert's annotation as Prometheus renders it for these labels and this value (the three forms
    files/alerts.yaml uses)."""
    text = re.sub(r"\{\{\s*\$value\s*\|\s*humanizeDuration\s*\}\}", _humanize_duration(value), text)
    text = re.sub(r"\{\{\s*\$value\s*\}\}", f"{value:g}", text)
    return re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), text)


# Per alert: input series (promtool's expanding notation, one sample a minute from t=0), then the times
# to evaluate at with the alerts expected there: (labels, $value) each, [] for none. Series of another
# release (exp2-, exp10-) and near misses must never fire.
HEAD, WORKER, OTHER = "exp1-head-x7k2p", "exp1-gpu-worker-q9z8m", "exp10-head-aaaaa"
RUN = {"experiment": "gsm8k", "run": "20260101-000000-1"}
CASES = {
    "KuberlNoTrainingStep": (
        {  # steps until 20m, then nothing; another release's run stalls too; a healthy run goes on
            f'ray_kuberl_train_last_step_timestamp_seconds{{namespace="exp", pod="{HEAD}", experiment="gsm8k", run="20260101-000000-1"}}': "0+60x20 1200x60",
            f'ray_kuberl_train_last_step_timestamp_seconds{{namespace="exp", pod="{OTHER}", experiment="gsm8k", run="other"}}': "0x80",
            f'ray_kuberl_train_last_step_timestamp_seconds{{namespace="exp", pod="{HEAD}", experiment="gsm8k", run="healthy"}}': "0+60x80",
        },
        {"45m": [], "55m": [({"namespace": "exp", **RUN}, 2100)]},
    ),
    "KuberlCheckpointTooOld": (
        {
            f'ray_kuberl_checkpoint_last_timestamp_seconds{{namespace="exp", pod="{HEAD}", experiment="gsm8k", run="20260101-000000-1"}}': "0x130",
            f'ray_kuberl_checkpoint_last_timestamp_seconds{{namespace="exp", pod="{HEAD}", experiment="gsm8k", run="healthy"}}': "0+600x13",
        },
        {"119m": [], "125m": [({"namespace": "exp", **RUN}, 7500)]},
    ),
    "KuberlGPUsIdle": (
        {
            f'ray_node_gpus_utilization{{namespace="exp", pod="{WORKER}", GpuIndex="0"}}': "0x60",
            f'ray_node_gpus_utilization{{namespace="exp", pod="{WORKER}", GpuIndex="1"}}': "3x60",
            f'ray_node_gpus_utilization{{namespace="busy", pod="{WORKER}", GpuIndex="0"}}': "90x60",
        },
        {"25m": [], "35m": [({"namespace": "exp"}, 3)]},
    ),
    "KuberlPodPending": (
        {
            f'kube_pod_status_phase{{namespace="exp", pod="{WORKER}", phase="Pending"}}': "1x30",
            f'kube_pod_status_phase{{namespace="exp", pod="{HEAD}", phase="Pending"}}': "1x5 0x25",
            f'kube_pod_status_phase{{namespace="exp", pod="{HEAD}", phase="Running"}}': "0x5 1x25",
            f'kube_pod_status_phase{{namespace="exp", pod="{OTHER}", phase="Pending"}}': "1x30",
        },
        {"10m": [], "20m": [({"namespace": "exp", "pod": WORKER}, 1)]},
    ),
    "KuberlDisruptionBudgetBlocksDrain": (
        {  # node n1 (the worker's) cordoned from 10m; n2 (no pod of the release) cordoned all along
            'kube_poddisruptionbudget_status_pod_disruptions_allowed{namespace="exp", poddisruptionbudget="exp1"}': "0x60",
            f'kube_pod_info{{namespace="exp", pod="{WORKER}", node="n1"}}': "1x60",
            f'kube_pod_info{{namespace="exp", pod="{HEAD}", node="n3"}}': "1x60",
            'kube_node_spec_unschedulable{node="n1"}': "0x10 1x50",
            'kube_node_spec_unschedulable{node="n2"}': "1x60",
            'kube_node_spec_unschedulable{node="n3"}': "0x60",
        },
        {"35m": [], "45m": [({"namespace": "exp", "poddisruptionbudget": "exp1"}, 1)]},
    ),
    "KuberlRayJobNearBackoffLimit": (
        {  # job.backoffLimit=10, retriesLeft=2: the 8th retry fires; the final Failed attempt is not a retry
            **{f'kuberay_job_execution_duration_seconds{{namespace="exp", name="exp1", uid="u1", job_deployment_status="Retrying", retry_count="{i}"}}': "100x30" for i in range(7)},
            'kuberay_job_execution_duration_seconds{namespace="exp", name="exp1", uid="u1", job_deployment_status="Retrying", retry_count="7"}': "_x10 100x20",
            'kuberay_job_execution_duration_seconds{namespace="exp", name="exp1", uid="u0", job_deployment_status="Failed", retry_count="10"}': "100x30",
            **{f'kuberay_job_execution_duration_seconds{{namespace="exp", name="exp2", uid="u2", job_deployment_status="Retrying", retry_count="{i}"}}': "100x30" for i in range(9)},
        },
        {"5m": [], "15m": [({"namespace": "exp", "name": "exp1", "uid": "u1"}, 8)]},
    ),
}  # fmt: skip


def promtool_tests(groups: list[dict]) -> dict:
    rules = {r["alert"]: r for g in groups for r in g["rules"]}
    assert set(rules) == set(CASES), "every alert has a promtool case, and every case an alert"
    tests = []
    for alert, (series, evals) in CASES.items():
        rule = rules[alert]
        checks = []
        for at, expected in evals.items():
            exp = []
            for labels, value in expected:
                full = {**labels, **rule["labels"]}
                anns = {k: _expand(v, full, value) for k, v in rule["annotations"].items()}
                exp.append({"exp_labels": full, "exp_annotations": anns})
            checks.append({"eval_time": at, "alertname": alert, "exp_alerts": exp})
        tests.append({
            "name": alert, "interval": "1m",
            "input_series": [{"series": s, "values": v} for s, v in series.items()],
            "alert_rule_test": checks,
        })  # fmt: skip
    return {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests}


@pytest.mark.parametrize("sets", [ALL_ALERTS, OPERATOR], ids=["managed", "operator"])
def test_should_fire_each_alert_on_its_series_and_not_on_near_misses_when_promtool_tests_them(
    sets: tuple[str, ...], tmp_path: Path
) -> None:
    groups = groups_of(rule_objects(*sets))
    write_rules(tmp_path, groups)
    (tmp_path / "alerts_test.yaml").write_text(yaml.safe_dump(promtool_tests(groups), sort_keys=False))
    out = run_promtool(tmp_path, "test", "rules", "alerts_test.yaml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_should_read_only_series_the_metrics_list_knows_when_rules_render() -> None:
    known = known_series()
    for rule in (r for g in groups_of(rule_objects(*ALL_ALERTS)) for r in g["rules"]):
        names = series_names(rule["expr"])
        assert names, f"{rule['alert']}: no series found in {rule['expr']!r}"
        assert names <= known, f"{rule['alert']} reads {sorted(names - known)}, not in files/metrics.yaml"


# ---------------------------------------------------------------------------------------------------------
# The dashboard


def _panel_exprs() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in DASHBOARD["panels"] for t in p["targets"]]


def test_should_query_only_series_the_metrics_list_knows_when_panels_are_read() -> None:
    known = known_series()
    assert len({p["id"] for p in DASHBOARD["panels"]}) == len(DASHBOARD["panels"]), "panel ids are unique"
    for title, expr in _panel_exprs():
        names = series_names(expr)
        assert names, f"panel {title!r}: no series found in {expr!r}"
        assert names <= known, f"panel {title!r} reads {sorted(names - known)}, not in files/metrics.yaml"
    for var in DASHBOARD["templating"]["list"]:
        if var["type"] == "query":
            selector = var["query"]["query"].removeprefix("label_values(").rsplit(",", 1)[0]
            assert series_names(selector) <= known, var["name"]


def test_should_show_what_the_platform_team_asked_for_when_the_dashboard_loads() -> None:
    read = {n for _, expr in _panel_exprs() for n in series_names(expr)}
    for wanted in ("ray_kuberl_train_reward_mean", "ray_kuberl_timing_step_s", "ray_kuberl_timing_generation_s",
                   "ray_kuberl_timing_train_s", "ray_kuberl_perf_mfu", "ray_kuberl_timing_refit_s",
                   "ray_kuberl_perf_refit_bytes", "ray_kuberl_train_gen_logprob_abs_diff", "ray_node_gpus_utilization"):  # fmt: skip
        assert wanted in read, f"no panel reads {wanted}"


def test_should_ship_the_dashboard_in_a_labelled_configmap_when_enabled() -> None:
    sets = ("monitoring.dashboard.enabled=true", "monitoring.dashboard.annotations.grafana_folder=Training")
    (cm,) = [
        d for d in render(*sets) if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "exp1-dashboard"
    ]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "Training"}
    assert "namespace" not in cm["metadata"]  # the release's
    assert json.loads(cm["data"]["kuberl-grpo.json"]) == DASHBOARD
    schema = SCHEMAS / "k8s" / "configmap-v1.json"
    if not schema.exists():
        pytest.skip(f"schemas not found at {SCHEMAS} (CI has them in ../shared/schemas)")
    errors = [
        e.message for e in jsonschema.Draft202012Validator(json.loads(schema.read_text())).iter_errors(cm)
    ]
    assert not errors, errors


def test_should_use_the_sidecars_label_and_namespace_when_they_are_set() -> None:
    sets = ("monitoring.dashboard.enabled=true", "monitoring.dashboard.namespace=monitoring",
            "monitoring.dashboard.labels.grafana_dashboard=null", "monitoring.dashboard.labels.team-dashboards=yes")  # fmt: skip
    (cm,) = [
        d for d in render(*sets) if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "exp1-dashboard"
    ]
    assert cm["metadata"]["namespace"] == "monitoring"
    assert (
        cm["metadata"]["labels"]["team-dashboards"] == "yes"
        and "grafana_dashboard" not in cm["metadata"]["labels"]
    )


# ---------------------------------------------------------------------------------------------------------
# The runbook


def test_should_cite_only_monitoring_keys_that_exist_when_the_runbook_explains_them() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    doc = (REPO / "docs" / "cluster.md").read_text()
    cited = set(re.findall(r"(?<![\w.])(monitoring\.[A-Za-z][\w.]*[A-Za-z])", doc))
    assert {"monitoring.alerts.enabled", "monitoring.dashboard.enabled"} <= cited
    for key in cited:
        node = values
        for part in key.split("."):
            if node == {}:  # a free-form map (labels, annotations): any key
                break
            assert isinstance(node, dict) and part in node, f"docs/cluster.md cites {key}, not in values.yaml"
            node = node[part]
