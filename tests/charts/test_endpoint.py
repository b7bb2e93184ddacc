"""The generation endpoint on the chart (generationEndpoint): its ports and POD_IP on the pods that serve it,
only the release's own pods admitted to those ports, and a render that refuses to open it without Ray's
token auth or the NetworkPolicy. Rendered by a real `helm` binary; every object checked against the strict
schemas."""

from __future__ import annotations

import pytest
import yaml
from chartlib import (
    BASE,
    CHART,
    env_of,
    gpu_group,
    groups,
    head_template,
    one,
    render,
    run_helm,
    schema_errors,
)

from trainer.config import EndpointConfig

ON = ("generationEndpoint.enabled=true",)
SANDBOX = ("sandbox.enabled=true",)
OWN = {"app.kubernetes.io/name": "kuberl", "app.kubernetes.io/instance": "exp1"}


def _valid(docs: list[dict]) -> list[dict]:
    errors = [e for d in docs if d["kind"] != "PodMonitoring" for e in schema_errors(d)]  # no schema held
    assert not errors, "\n".join(errors)
    return docs


def _templates(docs: list[dict]) -> dict[str, dict]:
    return {"head": head_template(docs), **{name: g["template"] for name, g in groups(docs).items()}}


def _endpoint_ports(template: dict) -> list[int]:
    ports = template["spec"]["containers"][0]["ports"]
    return [p["containerPort"] for p in ports if p["name"].startswith("openai-")]


def _covers(rule: dict, port: int) -> bool:
    """Whether an ingress rule admits TCP traffic to ``port`` (no ports: every port)."""
    if "ports" not in rule:
        return True
    return any(
        p.get("protocol", "TCP") == "TCP" and p["port"] <= port <= p.get("endPort", p["port"])
        for p in rule["ports"]
    )


def _fails(*sets: str) -> str:
    args = ["template", "x", str(CHART)]
    for s in (*BASE, *sets):
        args += ["--set", s]
    out = run_helm(*args)
    assert out.returncode != 0, "the render should have failed"
    return out.stderr


def test_should_list_the_ports_and_pod_ip_on_every_ray_pod_but_the_sandbox_when_enabled() -> None:
    docs = _valid(render(*ON, *SANDBOX, *gpu_group("generation")))
    templates = _templates(docs)
    assert set(templates) == {"head", "train", "generation", "sandbox"}
    for name, template in templates.items():
        env = env_of(template)
        if name == "sandbox":  # model-written code serves nothing and needs no address
            assert _endpoint_ports(template) == [] and "POD_IP" not in env
            continue
        assert _endpoint_ports(template) == list(range(8000, 8008)), name
        assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}, name


def test_should_render_no_endpoint_port_or_pod_ip_when_disabled() -> None:
    for name, template in _templates(render(*SANDBOX)).items():
        assert _endpoint_ports(template) == [] and "POD_IP" not in env_of(template), name


@pytest.mark.parametrize(
    "sets",
    [ON, (*ON, *SANDBOX), (*ON, "podMonitoring.enabled=true"), (*ON, "generationEndpoint.port=9100")],
    ids=["default", "sandbox", "podmonitoring", "port"],
)
def test_should_admit_only_the_releases_own_pods_to_the_endpoint_when_enabled(sets) -> None:
    docs = _valid(render(*sets))
    ports = _endpoint_ports(head_template(docs))
    assert ports
    policies = [d["spec"] for d in docs if d["kind"] == "NetworkPolicy"]
    main = next(p for p in policies if "kuberl.dev/role" not in p["podSelector"]["matchLabels"])
    assert main["podSelector"]["matchLabels"] == OWN and "Ingress" in main["policyTypes"]
    admitted = [rule for rule in main["ingress"] if any(_covers(rule, p) for p in ports)]
    assert admitted  # the release's own pods do reach it
    for rule in admitted:
        for peer in rule["from"]:
            # a pod of this release, in this namespace: no namespaceSelector, no ipBlock, no empty peer
            assert set(peer) == {"podSelector"}, peer
            assert peer["podSelector"]["matchLabels"] == OWN, peer
            if "sandbox.enabled=true" in sets:  # and not the pods that run model-written code
                assert peer["podSelector"]["matchExpressions"] == [
                    {"key": "kuberl.dev/role", "operator": "NotIn", "values": ["sandbox"]}
                ]


def test_should_keep_every_other_port_open_to_the_sandbox_when_the_endpoint_is_enabled() -> None:
    # The sandbox's raylet still reaches the head's GCS and the workers' object managers.
    docs = _valid(render(*ON, *SANDBOX))
    main = next(d["spec"] for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "exp1")
    (rule,) = [
        r for r in main["ingress"] if r["from"][0]["podSelector"]["matchLabels"].get("kuberl.dev/role")
    ]
    for port in (6379, 8080, 8265, 10001, 10002, 19999, 7999, 8008, 65535):
        assert _covers(rule, port), port
    for port in range(8000, 8008):
        assert not _covers(rule, port), port


@pytest.mark.parametrize(
    "sets, message",
    [
        (("auth.mode=disabled",), "generationEndpoint.enabled needs auth.mode=token"),
        (("networkPolicy.enabled=false",), "generationEndpoint.enabled needs networkPolicy.enabled=true"),
        (("generationEndpoint.port=8075",), "generationEndpoint ports 8075-8082 take port 8080"),
        (("tensorboard.port=8003",), "take port 8003"),
    ],
)
def test_should_refuse_to_render_an_endpoint_that_would_not_be_closed_when_asked(sets, message) -> None:
    assert message in _fails(*ON, *sets)


@pytest.mark.parametrize(
    "bad", ["generationEndpoint.port=80", "generationEndpoint.ports=0", "generationEndpoint.token=x"]
)
def test_should_reject_endpoint_values_the_schema_does_not_allow(bad) -> None:
    assert "values don't meet the specifications of the schema" in _fails(bad)


def test_should_default_to_the_trainers_own_ports_when_enabled() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())["generationEndpoint"]
    defaults = EndpointConfig()
    assert (values["port"], values["ports"]) == (defaults.port, defaults.ports)
    assert values["enabled"] is defaults.enabled is False
    assert one(render(), "RayCluster")  # the default render is unchanged by the endpoint's values
