"""What the chart does for a cluster several teams share: Ray's token auth, the NetworkPolicy, the
PodDisruptionBudget, code sandboxes, tenancy and the hooks a platform adds (Kueue, extra containers).
Rendered by a real `helm` binary; every object checked against the strict schemas."""

from __future__ import annotations

import ipaddress
import re

import pytest
import yaml
from chartlib import (
    CHART,
    RDMA,
    env_of,
    groups,
    head_template,
    lint_failure,
    one,
    pod_labels,
    render,
    run_helm,
    sandbox_pod,
    schema_errors,
    selects,
)

JOB = ("job.enabled=true", "experiment=tiny")


def _valid(docs: list[dict]) -> list[dict]:
    errors = [e for d in docs for e in schema_errors(d)]
    assert not errors, "\n".join(errors)
    return docs


def _cluster_spec(docs: list[dict]) -> dict:
    job = [d for d in docs if d["kind"] == "RayJob"]
    return job[0]["spec"]["rayClusterSpec"] if job else one(docs, "RayCluster")["spec"]


# ----- Ray token auth -----------------------------------------------------------------------------


@pytest.mark.parametrize("sets", [(), JOB], ids=["raycluster", "rayjob"])
def test_should_turn_on_token_auth_with_kuberays_own_secret_when_rendered_by_default(sets) -> None:
    # No secretName: KubeRay 1.6+ makes a Secret named after the cluster (reconcileAuthSecret) and keeps
    # it with the RayCluster; the chart renders no token, random or looked up.
    docs = _valid(render(*sets))
    assert _cluster_spec(docs)["authOptions"] == {"mode": "token"}
    assert not [d for d in docs if d["kind"] == "Secret"]


def test_should_give_the_helm_test_pod_the_token_of_kuberays_secret_when_auth_is_on() -> None:
    env = env_of(one(render(), "Pod"))
    assert env["RAY_AUTH_MODE"]["value"] == "token"
    assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "exp1", "key": "auth_token"}


def test_should_name_the_secret_as_kuberays_check_name_does_when_the_release_starts_with_a_digit() -> None:
    env = env_of(one(render(release="7b-run"), "Pod"))
    assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "rb-run"


def test_should_leave_the_submitters_token_to_kuberay_unless_an_existing_secret_is_named() -> None:
    # KubeRay injects RAY_AUTH_MODE/RAY_AUTH_TOKEN into the submitter from the Secret of the cluster it names
    template = one(render(*JOB), "RayJob")["spec"]["submitterPodTemplate"]
    assert "env" not in template["spec"]["containers"][0]
    template = one(render(*JOB, "auth.existingSecret=team-ray-token"), "RayJob")["spec"][
        "submitterPodTemplate"
    ]
    assert env_of(template)["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "team-ray-token"


def test_should_use_the_named_secret_and_make_none_when_auth_existing_secret_is_set() -> None:
    docs = _valid(render("auth.existingSecret=team-ray-token"))
    assert not [d for d in docs if d["kind"] == "Secret"]
    assert one(docs, "RayCluster")["spec"]["authOptions"]["secretName"] == "team-ray-token"
    assert env_of(one(docs, "Pod"))["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "team-ray-token"


def test_should_say_so_and_make_no_token_when_auth_is_disabled() -> None:
    docs = _valid(render("auth.mode=disabled"))
    assert one(docs, "RayCluster")["spec"]["authOptions"] == {"mode": "disabled"}
    assert not [d for d in docs if d["kind"] == "Secret"]
    assert "RAY_AUTH_TOKEN" not in env_of(one(docs, "Pod"))


def test_should_bind_tensorboard_to_the_heads_loopback_when_enabled() -> None:
    # TensorBoard has no authentication: only kubectl port-forward (Kubernetes RBAC) reaches it.
    script = head_template(render())["spec"]["containers"][0]["args"][0]
    assert "tensorboard --logdir" in script and "--host 127.0.0.1" in script and "--bind_all" not in script


# ----- NetworkPolicy ------------------------------------------------------------------------------


def _policy(*sets: str) -> dict:
    return one(_valid(render(*sets)), "NetworkPolicy")


def _peers_labels(rule: dict, key: str) -> list[dict]:
    return [p.get("podSelector", {}).get("matchLabels") for p in rule.get(key, [])]


def test_should_admit_only_the_releases_pods_and_the_operators_dashboard_calls_when_rendered_by_default() -> (
    None
):
    policy = _policy()
    own = {"app.kubernetes.io/name": "kuberl", "app.kubernetes.io/instance": "exp1"}
    assert policy["spec"]["podSelector"]["matchLabels"] == own
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    ingress = policy["spec"]["ingress"]
    assert _peers_labels(ingress[0], "from") == [own] and "ports" not in ingress[0]
    operator = ingress[1]
    assert operator["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "kuberay-system"
    }
    assert operator["ports"] == [{"protocol": "TCP", "port": 8265}]
    assert len(ingress) == 2  # nobody else: no ipBlock, no empty peer


def test_should_select_every_pod_that_talks_to_ray_when_rendered() -> None:
    # the Ray pods, the RayJob submitter and the helm test pod all carry the policy's labels
    for sets in ((), JOB):
        docs = render(*sets)
        selector = one(docs, "NetworkPolicy")["spec"]["podSelector"]["matchLabels"]
        spec = _cluster_spec(docs)
        templates = [spec["headGroupSpec"]["template"], *(g["template"] for g in spec["workerGroupSpecs"])]
        templates += [d["spec"]["submitterPodTemplate"] for d in docs if d["kind"] == "RayJob"]
        pods = [t["metadata"]["labels"] for t in templates] + [
            d["metadata"]["labels"] for d in docs if d["kind"] == "Pod"
        ]
        for labels in pods:
            assert selector.items() <= labels.items()


def test_should_let_pods_reach_dns_the_metadata_server_https_and_each_other_when_rendered() -> None:
    egress = _policy()["spec"]["egress"]
    allowed = set()
    for rule in egress:
        ports = [(p["protocol"], p["port"]) for p in rule.get("ports", [])] or [("any", "any")]
        peers = rule.get("to") or [{"anywhere": True}]
        for peer in peers:
            where = peer.get("ipBlock", {}).get("cidr") or ("self" if "podSelector" in peer else "anywhere")
            allowed |= {(where, port) for port in ports}
    assert ("self", ("any", "any")) in allowed
    assert ("anywhere", ("UDP", 53)) in allowed and ("anywhere", ("TCP", 53)) in allowed
    assert {
        ("169.254.169.254/32", ("TCP", 80)),
        ("169.254.169.254/32", ("TCP", 8080)),
    } <= allowed  # Dataplane V2
    assert {("169.254.169.252/32", ("TCP", 987)), ("169.254.169.252/32", ("TCP", 988))} <= allowed  # Calico
    assert ("0.0.0.0/0", ("TCP", 443)) in allowed
    # nothing else leaves the pod: no rule with neither peers nor ports
    assert all(r.get("to") or r.get("ports") for r in egress)


def test_should_add_no_rule_for_lustre_when_storage_is_lustre() -> None:
    # The Lustre kernel client mounts in the node's network namespace: a pod's policy never sees it.
    policy = _policy("storage.type=lustre", "storage.lustre.volumeHandle=p/z/i", "storage.lustre.ip=10.90.1.4",
                     "storage.lustre.filesystem=fs")  # fmt: skip
    assert policy["spec"]["egress"] == _policy()["spec"]["egress"]


def test_should_narrow_https_to_the_cidrs_given_when_https_cidrs_is_set() -> None:
    egress = _policy("networkPolicy.egress.httpsCidrs={199.36.153.8/30}")["spec"]["egress"]
    https = [r for r in egress if {"protocol": "TCP", "port": 443} in r.get("ports", [])]
    assert [p["ipBlock"]["cidr"] for r in https for p in r["to"]] == ["199.36.153.8/30"]
    for r in egress:
        for p in r.get("to", []):
            if "ipBlock" in p:
                ipaddress.ip_network(p["ipBlock"]["cidr"])


def test_should_add_extra_rules_and_drop_the_operators_when_given() -> None:
    policy = _policy(
        "networkPolicy.operator=null",
        "networkPolicy.extraIngress[0].from[0].namespaceSelector.matchLabels.name=gmp-system",
        "networkPolicy.extraIngress[0].ports[0].port=8080",
    )
    assert len(policy["spec"]["ingress"]) == 2
    assert policy["spec"]["ingress"][1]["ports"] == [{"port": 8080}]


def test_should_render_no_policy_when_network_policy_is_disabled() -> None:
    assert not [d for d in render("networkPolicy.enabled=false") if d["kind"] == "NetworkPolicy"]


# ----- PodDisruptionBudget ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sets, mode, min_available",
    [((), "protect", 4), (JOB, "yield", 3), (("podDisruptionBudget.mode=yield",), "yield", 3),
     ((*JOB, "podDisruptionBudget.mode=protect"), "protect", 4)],
    ids=["raycluster-auto", "rayjob-auto", "raycluster-yield", "rayjob-protect"],
)  # fmt: skip
def test_should_hold_every_healthy_ray_pod_or_yield_one_at_a_time_as_the_mode_says_when_rendered(
    sets, mode, min_available
) -> None:
    """`auto` protects a bare RayCluster (an evicted pod ends its jobs) and yields for a RayJob (its next
    attempt resumes from the checkpoint the trainer commits within the pod's grace)."""
    docs = _valid(render("workerGroups.train.replicas=3", *sets))
    pdb = one(docs, "PodDisruptionBudget")
    # the head and the three workers, less one under yield: an integer, which the disruption controller
    # needs no /scale for
    assert pdb["spec"]["minAvailable"] == min_available and "maxUnavailable" not in pdb["spec"]
    assert pdb["metadata"]["annotations"]["kuberl.dev/disruption-mode"] == mode
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    # it counts exactly the pods it selects: the Ray pods KubeRay makes from these templates
    selected = [role for role, labels in pod_labels(docs).items() if selects(pdb["spec"]["selector"], labels)]
    assert sorted(selected) == ["head", "train"]
    assert 1 + 3 - pdb["spec"]["minAvailable"] == (
        1 if mode == "yield" else 0
    )  # evictions allowed when healthy


@pytest.mark.parametrize("sets", [(), JOB], ids=["raycluster", "rayjob"])
def test_should_leave_the_sandbox_pods_out_of_the_budget_when_sandbox_enabled(sets) -> None:
    """Sandbox pods hold no run state: they never hold a drain of the CPU pool, in either mode."""
    docs = _valid(render("sandbox.enabled=true", "sandbox.replicas=2", *sets))
    pdb = one(docs, "PodDisruptionBudget")
    assert (
        pdb["spec"]["minAvailable"]
        == one(_valid(render(*sets)), "PodDisruptionBudget")["spec"]["minAvailable"]
    )
    labels = pod_labels(docs)
    assert not selects(pdb["spec"]["selector"], labels["sandbox"])
    assert selects(pdb["spec"]["selector"], labels["head"]) and selects(
        pdb["spec"]["selector"], labels["train"]
    )


def test_should_select_no_submitter_or_test_pod_when_the_budget_counts_ray_pods() -> None:
    for sets in ((), JOB):
        docs = render(*sets)
        pdb = one(docs, "PodDisruptionBudget")
        others = [r for r in pod_labels(docs) if r == "submitter" or r.startswith("test:")]
        assert others and not [r for r in others if selects(pdb["spec"]["selector"], pod_labels(docs)[r])]


def test_should_refuse_a_mode_it_does_not_know_when_linting() -> None:
    out = run_helm("lint", "--strict", str(CHART), "--set", "storage.gcsfuse.bucketName=b",
                   "--set", "podDisruptionBudget.mode=never")  # fmt: skip
    assert out.returncode != 0 and "/podDisruptionBudget/mode" in out.stdout + out.stderr


def test_should_not_use_max_unavailable_because_the_raycluster_crd_has_no_scale_subresource() -> None:
    """With maxUnavailable (or a percentage) the disruption controller counts the expected pods through
    the owner's /scale subresource; KubeRay's pods are owned by the RayCluster. A /scale subresource
    needs `specReplicasPath` (one integer field under .spec, no array index) and `labelSelectorPath`
    (a string under .status) in the CRD's schema: the RayCluster has replicas only per worker group, in
    an array, and no status selector, so it cannot have one, and the budget would stay at 0 allowed
    disruptions (SyncFailed), unhealthy pods included. An integer minAvailable needs no controller."""
    import json

    from chartlib import SCHEMAS

    if not SCHEMAS.is_dir():
        pytest.skip(f"schemas not found at {SCHEMAS}")
    schema = json.loads((SCHEMAS / "raycluster-v1.json").read_text())
    spec, status = schema["properties"]["spec"]["properties"], schema["properties"]["status"]["properties"]
    assert "replicas" not in spec  # no .spec.replicas for specReplicasPath
    assert spec["workerGroupSpecs"]["type"] == "array"  # replicas live per group, in an array
    assert "replicas" in spec["workerGroupSpecs"]["items"]["properties"]
    assert not any(v.get("type") == "string" and "selector" in k.lower() for k, v in status.items())
    pdb = one(render(), "PodDisruptionBudget")["spec"]
    assert isinstance(pdb["minAvailable"], int) and "maxUnavailable" not in pdb


def test_should_render_no_budget_when_disabled() -> None:
    assert not [d for d in render("podDisruptionBudget.enabled=false") if d["kind"] == "PodDisruptionBudget"]


def test_should_keep_the_workers_labels_for_the_budget_when_a_group_adds_its_own() -> None:
    labels = groups(render("workerGroups.train.labels.team=a"))["train"]["template"]["metadata"]["labels"]
    assert labels["team"] == "a" and labels["app.kubernetes.io/instance"] == "exp1"


# ----- code sandboxes -----------------------------------------------------------------------------


def _templates(docs: list[dict]) -> dict[str, dict]:
    spec = _cluster_spec(docs)
    return {
        "head": spec["headGroupSpec"]["template"],
        **{g["groupName"]: g["template"] for g in spec["workerGroupSpecs"]},
    }


def _ray_containers(docs: list[dict]) -> list[dict]:
    return [t["spec"]["containers"][0] for t in _templates(docs).values()]


RESTRICTED = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


@pytest.mark.parametrize("sets", [(), JOB], ids=["raycluster", "rayjob"])
def test_should_force_bubblewrap_and_restrict_every_ray_container_when_rendered_by_default(sets) -> None:
    docs = _valid(render(*sets))
    for template in _templates(docs).values():
        container = template["spec"]["containers"][0]
        assert {"name": "KUBERL_SANDBOX", "value": "bwrap"} in container["env"]
        assert container["securityContext"] == RESTRICTED
        assert template["spec"]["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
        assert template["spec"]["automountServiceAccountToken"] is False


SANDBOX = ("sandbox.enabled=true",)
LOOSENED = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"], "add": ["SETFCAP", "SETGID", "SETUID"]},
    "readOnlyRootFilesystem": True,
    "seccompProfile": {"type": "Unconfined"},
    "appArmorProfile": {"type": "Unconfined"},
}


def _others(docs: list[dict]) -> dict[str, dict]:
    """The pod specs of the `helm test` pods and the RayJob's submitter: they hold the Ray token."""
    found = {f"test:{d['metadata']['name']}": d["spec"] for d in docs if d["kind"] == "Pod"}
    for d in docs:
        if d["kind"] == "RayJob":
            found["submitter"] = d["spec"]["submitterPodTemplate"]["spec"]
    return found


@pytest.mark.parametrize("sets", [(), JOB], ids=["raycluster", "rayjob"])
def test_should_run_model_code_in_a_deployment_and_in_no_ray_group_when_sandbox_enabled(sets) -> None:
    docs = _valid(render(*SANDBOX, *sets))
    assert set(_templates(docs)) == {"head", "train"}  # no Ray worker group for the sandbox
    deployment, service = one(docs, "Deployment"), one(docs, "Service")
    assert deployment["metadata"]["name"] == service["metadata"]["name"] == "exp1-sandbox"
    assert deployment["spec"]["replicas"] == 1
    pod = deployment["spec"]["template"]
    assert selects(deployment["spec"]["selector"], pod["metadata"]["labels"])
    assert selects({"matchLabels": service["spec"]["selector"]}, pod["metadata"]["labels"])
    assert service["spec"]["ports"] == [
        {"name": "sandbox", "port": 8090, "targetPort": "sandbox", "protocol": "TCP"}
    ]
    container = pod["spec"]["containers"][0]
    assert container["args"] == ["python", "-m", "trainer.sandbox.server"] and "command" not in container
    assert container["ports"] == [{"name": "sandbox", "containerPort": 8090, "protocol": "TCP"}]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "sandbox"}
    env = env_of(pod)
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["KUBERL_SANDBOX"]["value"] == "bwrap" and env["KUBERL_SANDBOX_PORT"]["value"] == "8090"
    assert env["KUBERL_SANDBOX_TOKEN_FILE"]["value"] == "/var/run/secrets/kuberl/sandbox/token"
    # longer than the longest batch of programs, which SIGTERM lets the server finish
    assert pod["spec"]["terminationGracePeriodSeconds"] == 120
    assert container["resources"] == {"requests": {"cpu": "15", "memory": "56Gi"},
                                      "limits": {"cpu": "15", "memory": "56Gi"}}  # fmt: skip


@pytest.mark.parametrize("sets", [(), JOB], ids=["raycluster", "rayjob"])
def test_should_loosen_only_the_sandbox_services_container_when_sandbox_enabled(sets) -> None:
    docs = _valid(render(*SANDBOX, *sets))
    assert sandbox_pod(docs)["spec"]["containers"][0]["securityContext"] == LOOSENED
    assert sandbox_pod(docs)["spec"]["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    for template in _templates(docs).values():  # the head and the GPU workers keep the restricted profile
        assert template["spec"]["containers"][0]["securityContext"] == RESTRICTED
        assert {"name": "KUBERL_SANDBOX", "value": "bwrap"} in template["spec"]["containers"][0]["env"]
    for pod in _others(docs).values():  # the test pod and the submitter run no model code
        assert pod["containers"][0]["securityContext"] == RESTRICTED


def test_should_keep_the_default_profiles_of_the_sandbox_service_when_it_runs_under_gvisor() -> None:
    sandbox = sandbox_pod(_valid(render(*SANDBOX, "sandbox.runtimeClassName=gvisor")))
    assert sandbox["spec"]["runtimeClassName"] == "gvisor"
    sc = sandbox["spec"]["containers"][0]["securityContext"]
    assert "seccompProfile" not in sc and "appArmorProfile" not in sc  # the pod's RuntimeDefault holds
    assert sandbox["spec"]["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}


@pytest.mark.parametrize("sets", [(), JOB], ids=["raycluster", "rayjob"])
def test_should_give_the_sandbox_no_ray_env_secret_storage_or_identity_when_sandbox_enabled(sets) -> None:
    """Nothing in the pod that runs model code is worth taking: no Ray token or Ray env, no other Secret, no
    shared storage, no service-account token, no Google identity; only its own token's file."""
    docs = _valid(render(*SANDBOX, "secrets.wandbApiKey.secretName=wandb", "logger.backends={wandb}",
                         "serviceAccount.gcpServiceAccount=rl@p.iam.gserviceaccount.com", "auth.existingSecret=ray",
                         "generationEndpoint.enabled=true", "storage.models.enabled=true", *HOOKS, *sets))  # fmt: skip
    template = sandbox_pod(docs)
    pod = template["spec"]
    assert [c["name"] for c in pod["containers"]] == ["sandbox"] and "initContainers" not in pod
    container = pod["containers"][0]
    names = [e["name"] for e in container["env"]]
    assert not [n for n in names if n.startswith("RAY_")], names
    assert not {"HF_TOKEN", "WANDB_API_KEY", "KUBERL_ENDPOINT_TOKEN", "KUBERL_CHECKPOINT_DIR"} & set(names)
    assert [e["name"] for e in container["env"] if "valueFrom" in e] == ["POD_IP"]  # the downward API only
    assert "envFrom" not in container and pod["enableServiceLinks"] is False
    assert pod["volumes"] == [
        {"name": "sandbox-token", "secret": {"secretName": "exp1-sandbox", "defaultMode": 0o440,
                                             "items": [{"key": "token", "path": "token"}]}},
        {"name": "scratch", "emptyDir": {"sizeLimit": "2Gi"}},
    ]  # fmt: skip
    assert container["volumeMounts"] == [
        {"name": "sandbox-token", "mountPath": "/var/run/secrets/kuberl/sandbox", "readOnly": True},
        {"name": "scratch", "mountPath": "/tmp"},
    ]
    assert "annotations" not in template["metadata"]  # no gcsfuse sidecar, no multi-network
    assert pod["automountServiceAccountToken"] is False
    sas = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceAccount"}
    assert (
        pod["serviceAccountName"] == "exp1-sandbox" and "annotations" not in sas["exp1-sandbox"]["metadata"]
    )
    assert all(sa["automountServiceAccountToken"] is False for sa in sas.values())
    # not KubeRay's: no Ray container, no Ray start, no Ray labels
    assert not [k for k in template["metadata"]["labels"] if k.startswith("ray.io/")]
    assert "ray" not in " ".join(container["args"])


@pytest.mark.parametrize(
    "sets", [(), JOB, ("networkPolicy.enabled=false",)], ids=["raycluster", "rayjob", "nopolicy"]
)
def test_should_admit_only_the_ray_pods_on_8090_and_let_nothing_out_when_sandbox_enabled(sets) -> None:
    docs = _valid(render(*SANDBOX, *sets))
    policies = {p["metadata"]["name"]: p["spec"] for p in docs if p["kind"] == "NetworkPolicy"}
    own = policies["exp1-sandbox"]  # whatever networkPolicy.enabled says
    labels = pod_labels(docs)
    assert selects(own["podSelector"], labels["sandbox"])
    assert set(own["policyTypes"]) == {"Ingress", "Egress"} and own["egress"] == []  # not even DNS
    (rule,) = own["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8090}] and len(rule["from"]) == 1
    peer = rule["from"][0]
    assert set(peer) == {"podSelector"}  # this namespace, no ipBlock
    callers = {r for r, pod in labels.items() if selects(peer["podSelector"], pod)}
    assert callers == {"head", "train"}  # not the submitter, the test pods or the sandbox itself
    if "exp1" in policies:  # the release's policy neither selects nor admits the sandbox
        main = policies["exp1"]
        assert not selects(main["podSelector"], labels["sandbox"])
        for rule in main["ingress"]:
            for peer in rule.get("from", []):
                if "podSelector" in peer and "namespaceSelector" not in peer:
                    assert not selects(peer["podSelector"], labels["sandbox"])
                    assert selects(peer["podSelector"], labels["head"])


@pytest.mark.parametrize("sets", [(), JOB], ids=["raycluster", "rayjob"])
def test_should_give_only_the_ray_pods_the_sandbox_url_and_token_file_when_sandbox_enabled(sets) -> None:
    docs = _valid(
        render(*SANDBOX, "logger.backends={mlflow}", "logger.mlflow.trackingUri=http://m:5000", *sets)
    )
    for name, template in _templates(docs).items():
        env = env_of(template)
        assert env["KUBERL_SANDBOX_URL"]["value"] == "http://exp1-sandbox.exp.svc:8090", name
        assert env["KUBERL_SANDBOX_TOKEN_FILE"]["value"] == "/var/run/secrets/kuberl/sandbox/token", name
        assert "KUBERL_SANDBOX_RESOURCE" not in env and "KUBERL_SANDBOX_TOKEN" not in env, name
        pod = template["spec"]
        assert {"name": "sandbox-token", "mountPath": "/var/run/secrets/kuberl/sandbox", "readOnly": True} in pod[
            "containers"][0]["volumeMounts"], name  # fmt: skip
        (volume,) = [v for v in pod["volumes"] if v["name"] == "sandbox-token"]
        assert volume["secret"]["secretName"] == "exp1-sandbox" and volume["secret"]["items"] == [
            {"key": "token", "path": "token"}]  # fmt: skip
    others = _others(docs)
    assert others
    for name, pod in others.items():  # they never call it: no URL, no token
        assert not [e for c in pod["containers"] for e in c.get("env", []) if "SANDBOX" in e["name"]], name
        assert not [v for v in pod.get("volumes", []) if v["name"] == "sandbox-token"], name


def test_should_give_no_pod_the_sandbox_url_or_token_when_sandbox_disabled() -> None:
    docs = _valid(render())
    assert not [d for d in docs if d["kind"] in ("Deployment", "Service", "Secret")]
    for template in _templates(docs).values():
        assert not {"KUBERL_SANDBOX_URL", "KUBERL_SANDBOX_TOKEN_FILE"} & set(env_of(template))
        assert not [v for v in template["spec"]["volumes"] if v["name"] == "sandbox-token"]
        assert "podAntiAffinity" not in (template["spec"].get("affinity") or {})


def _anti_terms(spec: dict) -> list[dict]:
    return (
        (spec.get("affinity") or {})
        .get("podAntiAffinity", {})
        .get("requiredDuringSchedulingIgnoredDuringExecution", [])
    )


@pytest.mark.parametrize("sets", [(), JOB], ids=["raycluster", "rayjob"])
def test_should_keep_every_pod_that_holds_a_token_off_the_sandbox_nodes_both_ways_when_sandbox_enabled(
    sets,
) -> None:
    docs = _valid(render(*SANDBOX, "logger.backends={mlflow}", "logger.mlflow.trackingUri=http://m:5000",
                         "head.affinity.podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution[0].topologyKey=zone",
                         "head.affinity.podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution[0].labelSelector.matchLabels.x=y",
                         *sets))  # fmt: skip
    labels = pod_labels(docs)
    holders = {**{n: t["spec"] for n, t in _templates(docs).items()}, **_others(docs)}
    assert len(holders) >= 3 and "head" in holders
    for name, spec in holders.items():
        terms = [t for t in _anti_terms(spec) if t["topologyKey"] == "kubernetes.io/hostname"]
        assert len(terms) == 1, name
        (term,) = terms
        assert selects(term["labelSelector"], labels["sandbox"]), name
        assert term["namespaceSelector"] == {}, name  # a sandbox of any release, in any namespace
        assert not selects(term["labelSelector"], labels[name if name in labels else "head"]), name
    # the head's own term is kept beside it
    assert [t["topologyKey"] for t in _anti_terms(holders["head"])] == ["zone", "kubernetes.io/hostname"]
    # the other way: the sandbox pods keep off every kuberl pod but sandboxes, in every namespace
    (term,) = _anti_terms(sandbox_pod(docs)["spec"])
    assert term["topologyKey"] == "kubernetes.io/hostname" and term["namespaceSelector"] == {}
    assert not selects(term["labelSelector"], labels["sandbox"])
    for role, pod in labels.items():
        if role != "sandbox":
            assert selects(term["labelSelector"], pod), role
    if not sets:  # the helm test pod still runs beside the head
        status = next(p for n, p in _others(docs).items() if n.endswith("test-ray-status"))
        assert status["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0][
            "labelSelector"]["matchLabels"]["ray.io/node-type"] == "head"  # fmt: skip


def test_should_put_the_sandbox_on_its_pool_with_its_own_tolerations_and_affinity_when_given() -> None:
    pod = sandbox_pod(_valid(render(*SANDBOX, "sandbox.replicas=3", "sandbox.cpus=7", "sandbox.memory=20Gi",
                                    "sandbox.workers=5", "sandbox.nodeSelector.pool=sandbox",
                                    "sandbox.tolerations[0].key=kuberl.dev/sandbox",
                                    "sandbox.tolerations[0].operator=Exists",
                                    "sandbox.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].key=z",
                                    "sandbox.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].operator=Exists",
                                    "priorityClassName=high")))["spec"]  # fmt: skip
    assert pod["nodeSelector"] == {"pool": "sandbox"}
    assert pod["tolerations"] == [{"key": "kuberl.dev/sandbox", "operator": "Exists"}]
    assert "nodeAffinity" in pod["affinity"] and len(_anti_terms(pod)) == 1
    assert pod["priorityClassName"] == "high"
    assert pod["containers"][0]["resources"]["limits"] == {"cpu": "7", "memory": "20Gi"}
    assert env_of({"spec": pod})["KUBERL_SANDBOX_WORKERS"]["value"] == "5"


def test_should_name_the_unisolated_fallback_for_the_sandbox_pod_alone_when_backend_gives_isolation_up() -> (
    None
):
    docs = _valid(render(*SANDBOX, "sandbox.backend=rlimit-without-isolation"))
    assert env_of(sandbox_pod(docs))["KUBERL_SANDBOX"]["value"] == "rlimit-without-isolation"
    for template in _templates(docs).values():  # beside the Ray token, model code stays under bubblewrap
        assert env_of(template)["KUBERL_SANDBOX"]["value"] == "bwrap"
    # without the service the Ray pods run model code themselves, under the isolation the user named
    head = head_template(_valid(render("sandbox.backend=rlimit-without-isolation")))
    assert env_of(head)["KUBERL_SANDBOX"]["value"] == "rlimit-without-isolation"
    assert "/sandbox/backend" in lint_failure(
        "sandbox.backend=rlimit"
    )  # the old name says nothing of what it gives up


@pytest.mark.parametrize(
    "component, sets", [("sandbox", SANDBOX), ("endpoint", ("generationEndpoint.enabled=true",))]
)
def test_should_make_a_random_token_secret_of_its_own_when_the_service_is_enabled(component, sets) -> None:
    import base64

    docs = _valid(render(*sets))
    (secret,) = [d for d in docs if d["kind"] == "Secret"]
    assert secret["metadata"]["name"] == f"exp1-{component}" and secret["type"] == "Opaque"
    assert secret["metadata"]["labels"]["app.kubernetes.io/component"] == component
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) >= 32 and token.isalnum()  # the server wants >= 16 characters
    other = [d for d in render(*sets, release="exp2") if d["kind"] == "Secret"][0]
    assert other["data"]["token"] != secret["data"]["token"]  # random, not derived from the values
    assert secret["metadata"]["name"] != "exp1"  # never the Secret KubeRay adopts for the Ray token
    # an existing Secret (GitOps): none rendered, that one used
    key = "sandbox.existingSecret" if component == "sandbox" else "generationEndpoint.existingSecret"
    docs = _valid(render(*sets, f"{key}=team-{component}-token"))
    assert not [d for d in docs if d["kind"] == "Secret"]
    head = head_template(docs)
    if component == "sandbox":
        pods = [head["spec"], sandbox_pod(docs)["spec"]]
        assert [v["secret"]["secretName"] for p in pods for v in p["volumes"] if v["name"] == "sandbox-token"] == [
            "team-sandbox-token"] * 2  # fmt: skip
    else:
        assert (
            env_of(head)["KUBERL_ENDPOINT_TOKEN"]["valueFrom"]["secretKeyRef"]["name"]
            == "team-endpoint-token"
        )


def test_should_give_every_ray_container_the_endpoints_own_token_when_the_endpoint_is_enabled() -> None:
    docs = _valid(render("generationEndpoint.enabled=true", "auth.mode=disabled"))  # Ray's auth is not needed
    for name, template in _templates(docs).items():
        ref = env_of(template)["KUBERL_ENDPOINT_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "exp1-endpoint", "key": "token"}, name
    for pod in _others(docs).values():
        assert not [
            e for c in pod["containers"] for e in c.get("env", []) if e["name"] == "KUBERL_ENDPOINT_TOKEN"
        ]
    assert "KUBERL_ENDPOINT_TOKEN" not in env_of(head_template(_valid(render())))


def test_should_let_container_security_context_win_when_set() -> None:
    docs = render(*SANDBOX, "containerSecurityContext.seccompProfile.type=Localhost",
                  "containerSecurityContext.seccompProfile.localhostProfile=profiles/bwrap.json")  # fmt: skip
    sc = sandbox_pod(docs)["spec"]["containers"][0]["securityContext"]
    assert sc["seccompProfile"] == {"type": "Localhost", "localhostProfile": "profiles/bwrap.json"}
    assert sc["appArmorProfile"] == {"type": "Unconfined"}
    assert _templates(docs)["train"]["spec"]["containers"][0]["securityContext"]["capabilities"] == {
        "drop": ["ALL"]
    }


# ----- tenancy ------------------------------------------------------------------------------------

LUSTRE = ("storage.type=lustre", "storage.lustre.volumeHandle=p/us-central1-b/i", "storage.lustre.ip=10.90.1.4",
          "storage.lustre.filesystem=fs")  # fmt: skip


def _render_in(namespace: str, release: str, *sets: str) -> list[dict]:
    args = [
        "template",
        release,
        str(CHART),
        "--namespace",
        namespace,
        "--set",
        "storage.gcsfuse.bucketName=b",
    ]
    for s in sets:
        args += ["--set", s]
    out = run_helm(*args)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_should_give_two_releases_two_volumes_when_their_names_agree_on_the_first_63_characters() -> None:
    """The collision of the issue: the old `<ns>-<release>-lustre` cut to 63 characters made one name."""
    ns = "research-team-alpha-rl-experiments-prod"
    names = []
    for release in ("gemma3-27b-gsm8k-h200", "gemma3-27b-gsm8k-h200-lora"):
        docs = _valid(_render_in(ns, release, *LUSTRE))
        pv, pvc = one(docs, "PersistentVolume"), one(docs, "PersistentVolumeClaim")
        assert pvc["spec"]["volumeName"] == pv["metadata"]["name"]
        assert pv["spec"]["claimRef"] == {"namespace": ns, "name": pvc["metadata"]["name"]}
        names.append(pv["metadata"]["name"])
    assert names[0] != names[1] and all(len(n) <= 253 for n in names)


def test_should_tell_apart_namespace_and_release_when_the_dashes_fall_differently() -> None:
    a = one(_render_in("a-b", "c", *LUSTRE), "PersistentVolume")["metadata"]["name"]
    b = one(_render_in("a", "b-c", *LUSTRE), "PersistentVolume")["metadata"]["name"]
    assert a != b


def test_should_keep_a_volume_made_before_when_volume_name_is_set() -> None:
    docs = render(*LUSTRE, "storage.lustre.volumeName=exp-exp1-lustre")
    assert one(docs, "PersistentVolume")["metadata"]["name"] == "exp-exp1-lustre"
    assert one(docs, "PersistentVolumeClaim")["spec"]["volumeName"] == "exp-exp1-lustre"


NAMESPACED = {"RayCluster", "RayJob", "Pod", "ServiceAccount", "Secret", "NetworkPolicy", "PodDisruptionBudget",
              "PersistentVolumeClaim", "Deployment", "Service"}  # fmt: skip


@pytest.mark.parametrize("sets", [(), JOB], ids=["raycluster", "rayjob"])
def test_should_render_only_namespaced_objects_when_installed_with_namespace_rights_only(sets) -> None:
    docs = _valid(render("storage.type=lustre", "storage.lustre.existingClaim=team-lustre", *RDMA, *SANDBOX,
                         "generationEndpoint.enabled=true", *sets))  # fmt: skip
    assert {d["kind"] for d in docs} <= NAMESPACED
    spec = _cluster_spec(docs)
    claims = {v["persistentVolumeClaim"]["claimName"] for g in spec["workerGroupSpecs"]
              for v in g["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v}  # fmt: skip
    assert claims == {"team-lustre"}


def test_should_look_up_and_draw_only_the_releases_own_tokens_so_other_renders_agree_when_rendered() -> None:
    """`lookup` is empty under `helm template` (CI, Argo CD, Flux) and forbidden cluster-wide to a tenant: no
    template may depend on it, nor on anything random or timed, but the one helper that makes the release's
    own tokens (kuberl.generatedToken: a Secret of the release's namespace, random once, then read back)."""
    pattern = r"\b(lookup|randAlphaNum|randAlpha|randNumeric|randAscii|uuidv4|now|genPrivateKey|genCA)\b"
    for p in (CHART / "templates").rglob("*"):
        if p.is_file():
            text = p.read_text()
            if p.name == "_auth.tpl":
                start = text.index('{{- define "kuberl.generatedToken" -}}')
                body = text[start : text.index("{{- end }}\n\n", start)]
                assert sorted(re.findall(pattern, body)) == ["lookup", "randAlphaNum"]
                assert 'lookup "v1" "Secret" .root.Release.Namespace .name' in body
                text = text.replace(body, "")
            assert not re.findall(pattern, text), p.name


# ----- what a platform adds -----------------------------------------------------------------------

HOOKS = (
    "priorityClassName=research-high",
    "runtimeClassName=gvisor",
    "podSecurityContext.fsGroup=1000",
    "envFrom[0].configMapRef.name=platform-env",
    "env[0].name=POD_IP",
    "env[0].valueFrom.fieldRef.fieldPath=status.podIP",
    "extraVolumes[0].name=certs",
    "extraVolumes[0].secret.secretName=platform-certs",
    "extraVolumeMounts[0].name=certs",
    "extraVolumeMounts[0].mountPath=/etc/platform/certs",
    "initContainers[0].name=wait-for-proxy",
    "initContainers[0].image=busybox:1.36",
    "sidecars[0].name=log-shipper",
    "sidecars[0].image=fluent/fluent-bit:3.1",
)


@pytest.mark.parametrize("sets", [(), JOB], ids=["raycluster", "rayjob"])
def test_should_label_and_annotate_the_ray_object_and_queue_it_for_kueue_when_given(sets) -> None:
    docs = _valid(render("queue=team-a", "labels.cost-center=rl", "annotations.owner=team-a", *sets))
    ray = one(docs, "RayJob" if sets else "RayCluster")
    assert ray["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert ray["metadata"]["labels"]["cost-center"] == "rl"
    assert ray["metadata"]["annotations"] == {"ray.io/overwrite-container-cmd": "true", "owner": "team-a"}
    if sets:  # what Kueue requires of a RayJob it manages
        assert ray["spec"]["shutdownAfterJobFinishes"] is True and "clusterSelector" not in ray["spec"]


def test_should_refuse_a_rayjob_kueue_cannot_manage_when_queue_is_set_and_the_cluster_is_kept() -> None:
    out = run_helm("template", "x", str(CHART), "--set", "storage.gcsfuse.bucketName=b", *[
        a for s in (*JOB, "queue=team-a", "job.shutdownAfterJobFinishes=false") for a in ("--set", s)])  # fmt: skip
    assert out.returncode != 0 and "Kueue manages only a RayJob that deletes its cluster" in out.stderr


@pytest.mark.parametrize("sets", [(), JOB], ids=["raycluster", "rayjob"])
def test_should_give_every_ray_pod_the_platforms_hooks_with_the_ray_container_first_when_set(sets) -> None:
    docs = _valid(render(*HOOKS, *sets))
    spec = _cluster_spec(docs)
    for template in [spec["headGroupSpec"]["template"], *(g["template"] for g in spec["workerGroupSpecs"])]:
        pod = template["spec"]
        assert (pod["priorityClassName"], pod["runtimeClassName"]) == ("research-high", "gvisor")
        assert pod["securityContext"] == {"fsGroup": 1000, "seccompProfile": {"type": "RuntimeDefault"}}
        assert [c["name"] for c in pod["containers"]][0] in ("ray-head", "ray-worker")
        assert [c["name"] for c in pod["containers"]][1:] == ["log-shipper"]
        assert [c["name"] for c in pod["initContainers"]] == ["wait-for-proxy"]
        ray = pod["containers"][0]
        assert ray["envFrom"] == [{"configMapRef": {"name": "platform-env"}}]
        assert env_of(template)["POD_IP"] == {
            "name": "POD_IP",
            "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
        }
        assert {"name": "certs", "mountPath": "/etc/platform/certs"} in ray["volumeMounts"]
        assert {"name": "certs", "secret": {"secretName": "platform-certs"}} in pod["volumes"]
        assert "shared" in {v["name"] for v in pod["volumes"]}
    for d in docs:
        if d["kind"] == "RayJob":
            assert d["spec"]["submitterPodTemplate"]["spec"]["priorityClassName"] == "research-high"


def test_should_still_reject_a_token_in_env_when_value_from_is_allowed() -> None:
    out = run_helm("lint", "--strict", str(CHART), "--set", "storage.gcsfuse.bucketName=b",
                   "--set", "env[0].name=HF_TOKEN", "--set", "env[0].valueFrom.secretKeyRef.name=x")  # fmt: skip
    assert out.returncode != 0


# ----- capacity -----------------------------------------------------------------------------------

NOT_SPOT = [
    {"key": "cloud.google.com/gke-spot", "operator": "NotIn", "values": ["true"]},
    {"key": "cloud.google.com/gke-flex-start", "operator": "NotIn", "values": ["true"]},
]


def _required_terms(template: dict) -> list[dict]:
    affinity = template["spec"].get("affinity", {})
    return (
        affinity.get("nodeAffinity", {})
        .get("requiredDuringSchedulingIgnoredDuringExecution", {})
        .get("nodeSelectorTerms", [])
    )


def test_should_keep_gpu_pods_off_spot_and_flex_start_nodes_when_capacity_is_on_demand() -> None:
    docs = _valid(render())
    assert _required_terms(groups(docs)["train"]["template"]) == [{"matchExpressions": NOT_SPOT}]
    assert not _required_terms(head_template(docs))  # the head's CPU pool is whatever the platform gives


def test_should_add_the_exclusion_to_every_term_the_group_gives_when_capacity_is_on_demand() -> None:
    base = "workerGroups.train.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms"
    docs = _valid(render(f"{base}[0].matchExpressions[0].key=topology.kubernetes.io/zone",
                         f"{base}[0].matchExpressions[0].operator=In",
                         f"{base}[0].matchExpressions[0].values[0]=us-central1-b",
                         f"{base}[1].matchExpressions[0].key=pool", f"{base}[1].matchExpressions[0].operator=Exists"))  # fmt: skip
    terms = _required_terms(groups(docs)["train"]["template"])
    assert len(terms) == 2 and all(t["matchExpressions"][-2:] == NOT_SPOT for t in terms)
    assert terms[0]["matchExpressions"][0]["key"] == "topology.kubernetes.io/zone"


@pytest.mark.parametrize("capacity", ["spot", "flexStart"])
def test_should_not_exclude_the_nodes_it_asks_for_when_capacity_is_not_on_demand(capacity) -> None:
    template = groups(_valid(render(f"capacity.type={capacity}")))["train"]["template"]
    assert not _required_terms(template)
    if capacity == "flexStart":
        assert template["spec"]["nodeSelector"]["cloud.google.com/gke-flex-start"] == "true"
        assert {"key": "cloud.google.com/gke-flex-start", "operator": "Equal", "value": "true",
                "effect": "NoSchedule"} in template["spec"]["tolerations"]  # fmt: skip


def test_should_select_a_shared_reservations_project_and_block_when_given() -> None:
    selector = groups(_valid(render("capacity.type=reservation", "capacity.reservationName=h200-res",
                                    "capacity.reservationProject=capacity-owner",
                                    "capacity.reservationBlock=h200-res-block-0001")))["train"]["template"]["spec"]["nodeSelector"]  # fmt: skip
    assert selector["cloud.google.com/reservation-name"] == "h200-res"
    assert selector["cloud.google.com/reservation-affinity"] == "specific"
    assert selector["cloud.google.com/reservation-project"] == "capacity-owner"
    assert selector["cloud.google.com/reservation-blocks"] == "h200-res-block-0001"


@pytest.mark.parametrize("mode", ["token", "disabled"])
def test_should_say_where_the_token_is_or_warn_that_there_is_none_when_notes_print(mode) -> None:
    out = run_helm("install", "r", str(CHART), "--dry-run=client", "-n", "exp", "--set", "storage.gcsfuse.bucketName=b",
                   "--set", f"auth.mode={mode}")  # fmt: skip
    assert out.returncode == 0, out.stderr
    if mode == "token":  # a stock Ray client sends the token only with RAY_AUTH_MODE=token
        assert "export RAY_AUTH_MODE=token\n" in out.stdout
        assert (
            "export RAY_AUTH_TOKEN=$(kubectl get secret r -n exp -o jsonpath='{.data.auth_token}' | base64 -d)"
            in out.stdout
        )
    else:
        assert "WARNING: auth.mode=disabled" in out.stdout
