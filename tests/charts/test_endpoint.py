"""The generation endpoint on the chart (generationEndpoint): its ports and POD_IP on the pods that serve it,
its own token (never Ray's) in every Ray container, only the release's own pods admitted to those ports (not
the sandbox service's), and a render that refuses to open it without the NetworkPolicy. Rendered by a real
`helm` binary; every object checked against the strict schemas."""

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


def test_should_list_the_ports_pod_ip_and_token_on_every_ray_pod_but_not_the_sandbox_when_enabled() -> None:
    docs = _valid(render(*ON, *SANDBOX, *gpu_group("generation")))
    templates = _templates(docs)
    assert set(templates) == {"head", "train", "generation"}
    for name, template in templates.items():
        env = env_of(template)
        assert _endpoint_ports(template) == list(range(8000, 8008)), name
        assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}, name
        assert env["KUBERL_ENDPOINT_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": "exp1-endpoint",
            "key": "token",
        }
    # model-written code serves nothing and holds no token of the endpoint's
    sandbox = one(docs, "Deployment")["spec"]["template"]
    assert "KUBERL_ENDPOINT_TOKEN" not in env_of(sandbox)
    assert [p["containerPort"] for p in sandbox["spec"]["containers"][0]["ports"]] == [8090]


def test_should_render_no_endpoint_port_pod_ip_or_token_when_disabled() -> None:
    docs = render(*SANDBOX)
    for name, template in _templates(docs).items():
        assert _endpoint_ports(template) == [] and "POD_IP" not in env_of(template), name
        assert "KUBERL_ENDPOINT_TOKEN" not in env_of(template), name
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Secret"] == ["exp1-sandbox"]


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


def test_should_let_the_sandbox_reach_no_port_of_the_ray_pods_when_the_endpoint_is_enabled() -> None:
    # The sandbox service is no Ray node: it reaches nothing, the endpoint included (its own policy has no egress).
    docs = _valid(render(*ON, *SANDBOX))
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    assert policies["exp1-sandbox"]["egress"] == []
    for rule in policies["exp1"]["ingress"]:
        for peer in rule["from"]:
            if "namespaceSelector" not in peer:
                assert {"key": "kuberl.dev/role", "operator": "NotIn", "values": ["sandbox"]} in peer[
                    "podSelector"]["matchExpressions"]  # fmt: skip


@pytest.mark.parametrize(
    "sets, message",
    [
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
