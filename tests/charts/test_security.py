"""What the chart does for a cluster several teams share: Ray's token auth, the NetworkPolicy, the
PodDisruptionBudget, code sandboxes, tenancy and the hooks a platform adds (Kueue, extra containers).
Rendered by a real `helm` binary; every object checked against the strict schemas."""

from __future__ import annotations

import base64
import ipaddress
import re

import pytest
import yaml
from chartlib import CHART, RDMA, env_of, groups, head_template, one, render, run_helm, schema_errors

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
def test_should_turn_on_token_auth_with_a_token_of_its_own_when_rendered_by_default(sets) -> None:
    docs = _valid(render(*sets))
    assert _cluster_spec(docs)["authOptions"] == {"mode": "token", "secretName": "exp1-ray-auth"}
    secret = one(docs, "Secret")
    assert secret["metadata"]["name"] == "exp1-ray-auth"
    token = base64.b64decode(secret["data"]["auth_token"]).decode()
    assert len(token) >= 32 and token.isalnum()


def test_should_give_the_helm_test_pod_the_token_when_auth_is_on() -> None:
    env = env_of(one(render(), "Pod"))
    assert env["RAY_AUTH_MODE"]["value"] == "token"
    assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "exp1-ray-auth", "key": "auth_token"}


def test_should_give_the_rayjob_submitter_the_token_when_auth_is_on() -> None:
    template = one(render(*JOB), "RayJob")["spec"]["submitterPodTemplate"]
    env = env_of(template)
    assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "exp1-ray-auth"


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


def test_should_admit_only_the_releases_pods_and_the_operators_dashboard_calls_when_rendered_by_default() -> None:
    policy = _policy()
    own = {"app.kubernetes.io/name": "kuberl", "app.kubernetes.io/instance": "exp1"}
    assert policy["spec"]["podSelector"]["matchLabels"] == own
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    ingress = policy["spec"]["ingress"]
    assert _peers_labels(ingress[0], "from") == [own] and "ports" not in ingress[0]
    operator = ingress[1]
    assert operator["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "kuberay-system"}
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
        pods = [t["metadata"]["labels"] for t in templates] + [d["metadata"]["labels"] for d in docs if d["kind"] == "Pod"]
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
    assert {("169.254.169.254/32", ("TCP", 80)), ("169.254.169.254/32", ("TCP", 8080))} <= allowed  # Dataplane V2
    assert {("169.254.169.252/32", ("TCP", 987)), ("169.254.169.252/32", ("TCP", 988))} <= allowed  # Calico
    assert ("0.0.0.0/0", ("TCP", 443)) in allowed
    # nothing else leaves the pod: no rule with neither peers nor ports
    assert all(r.get("to") or r.get("ports") for r in egress)


def test_should_allow_the_lustre_instance_when_storage_is_lustre() -> None:
    policy = _policy("storage.type=lustre", "storage.lustre.volumeHandle=p/z/i", "storage.lustre.ip=10.90.1.4",
                     "storage.lustre.filesystem=fs")  # fmt: skip
    rules = [r for r in policy["spec"]["egress"] if r.get("to", [{}])[0].get("ipBlock", {}).get("cidr") == "10.90.1.4/32"]
    assert rules and rules[0]["ports"] == [{"protocol": "TCP", "port": 988}]


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


@pytest.mark.parametrize("sets", [(), JOB], ids=["raycluster", "rayjob"])
def test_should_hold_a_drain_of_any_ray_pod_when_rendered_by_default(sets) -> None:
    docs = _valid(render(*sets))
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 0
    selector = pdb["spec"]["selector"]
    assert selector["matchExpressions"] == [{"key": "ray.io/node-type", "operator": "In", "values": ["head", "worker"]}]
    # KubeRay labels the head and worker pods from these templates
    spec = _cluster_spec(docs)
    for template in [spec["headGroupSpec"]["template"], *(g["template"] for g in spec["workerGroupSpecs"])]:
        assert selector["matchLabels"].items() <= template["metadata"]["labels"].items()


def test_should_render_no_budget_when_disabled() -> None:
    assert not [d for d in render("podDisruptionBudget.enabled=false") if d["kind"] == "PodDisruptionBudget"]


def test_should_keep_the_workers_labels_for_the_budget_when_a_group_adds_its_own() -> None:
    labels = groups(render("workerGroups.train.labels.team=a"))["train"]["template"]["metadata"]["labels"]
    assert labels["team"] == "a" and labels["app.kubernetes.io/instance"] == "exp1"


# ----- code sandboxes -----------------------------------------------------------------------------


def _ray_containers(docs: list[dict]) -> list[dict]:
    spec = _cluster_spec(docs)
    templates = [spec["headGroupSpec"]["template"], *(g["template"] for g in spec["workerGroupSpecs"])]
    return [t["spec"]["containers"][0] for t in templates]


@pytest.mark.parametrize("sets", [(), JOB], ids=["raycluster", "rayjob"])
def test_should_force_bubblewrap_on_every_ray_container_when_rendered_by_default(sets) -> None:
    for container in _ray_containers(render(*sets)):
        assert {"name": "KUBERL_SANDBOX", "value": "bwrap"} in container["env"]
        assert "securityContext" not in container  # nothing loosened unless asked


@pytest.mark.parametrize("sets", [(), JOB], ids=["raycluster", "rayjob"])
def test_should_loosen_only_seccomp_and_apparmor_of_the_ray_containers_when_sandbox_enabled(sets) -> None:
    docs = _valid(render("sandbox.enabled=true", *sets))
    for container in _ray_containers(docs):
        assert container["securityContext"] == {
            "seccompProfile": {"type": "Unconfined"},
            "appArmorProfile": {"type": "Unconfined"},
            "allowPrivilegeEscalation": False,
        }
    others = [d for d in docs if d["kind"] == "Pod"] + [
        {"spec": d["spec"]["submitterPodTemplate"]["spec"]} for d in docs if d["kind"] == "RayJob"
    ]
    for pod in others:  # the test pod and the submitter run no model code
        assert "securityContext" not in pod["spec"]["containers"][0]


def test_should_let_container_security_context_win_when_both_are_set() -> None:
    docs = render("sandbox.enabled=true", "containerSecurityContext.seccompProfile.type=Localhost",
                  "containerSecurityContext.seccompProfile.localhostProfile=profiles/bwrap.json")  # fmt: skip
    sc = _ray_containers(docs)[0]["securityContext"]
    assert sc["seccompProfile"] == {"type": "Localhost", "localhostProfile": "profiles/bwrap.json"}
    assert sc["appArmorProfile"] == {"type": "Unconfined"}


# ----- tenancy ------------------------------------------------------------------------------------

LUSTRE = ("storage.type=lustre", "storage.lustre.volumeHandle=p/us-central1-b/i", "storage.lustre.ip=10.90.1.4",
          "storage.lustre.filesystem=fs")  # fmt: skip


def _render_in(namespace: str, release: str, *sets: str) -> list[dict]:
    args = ["template", release, str(CHART), "--namespace", namespace, "--set", "storage.gcsfuse.bucketName=b"]
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
              "PersistentVolumeClaim"}  # fmt: skip


@pytest.mark.parametrize("sets", [(), JOB], ids=["raycluster", "rayjob"])
def test_should_render_only_namespaced_objects_when_installed_with_namespace_rights_only(sets) -> None:
    docs = _valid(render("storage.type=lustre", "storage.lustre.existingClaim=team-lustre", *RDMA,
                         "rdma.createNetworks=false", *sets))  # fmt: skip
    assert {d["kind"] for d in docs} <= NAMESPACED
    spec = _cluster_spec(docs)
    claims = {v["persistentVolumeClaim"]["claimName"] for g in spec["workerGroupSpecs"]
              for v in g["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v}  # fmt: skip
    assert claims == {"team-lustre"}


def test_should_look_up_cluster_scoped_objects_only_where_it_creates_networks_when_rendered() -> None:
    """helm treats a forbidden `lookup` as an error: a tenant without cluster-wide rights installs with
    rdma.createNetworks=false, and then no cluster-scoped lookup may run."""
    templates = CHART / "templates"
    calls = {p.name: re.findall(r"\blookup\s+(\S+)\s+(\S+)\s+(\S+)", p.read_text()) for p in templates.rglob("*")
             if p.is_file()}  # fmt: skip
    calls = {name: found for name, found in calls.items() if found}
    assert set(calls) == {"_helpers.tpl", "secret.yaml"}, calls
    assert all(ns == ".Release.Namespace" for _, _, ns in calls["secret.yaml"])  # namespaced: the token
    helpers = (templates / "_helpers.tpl").read_text()
    owns = helpers.split('{{- define "kuberl.ownsClusterObject" -}}', 1)[1].split("{{- end }}\n{{- end }}", 1)[0]
    assert "lookup" in owns and helpers.count("lookup ") == 1  # only kuberl.ownsClusterObject looks up
    for p in templates.rglob("*"):
        if p.is_file() and "kuberl.ownsClusterObject" in p.read_text() and p.name != "_helpers.tpl":
            first = p.read_text().split("kuberl.ownsClusterObject", 1)[0]
            assert "if and .Values.rdma.enabled .Values.rdma.createNetworks" in first, p.name


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
        assert pod["securityContext"] == {"fsGroup": 1000}
        assert [c["name"] for c in pod["containers"]][0] in ("ray-head", "ray-worker")
        assert [c["name"] for c in pod["containers"]][1:] == ["log-shipper"]
        assert [c["name"] for c in pod["initContainers"]] == ["wait-for-proxy"]
        ray = pod["containers"][0]
        assert ray["envFrom"] == [{"configMapRef": {"name": "platform-env"}}]
        assert env_of(template)["POD_IP"] == {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
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
    return affinity.get("nodeAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution", {}).get(
        "nodeSelectorTerms", []
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
    if mode == "token":
        assert "kubectl get secret r-ray-auth -n exp -o jsonpath='{.data.auth_token}' | base64 -d" in out.stdout
    else:
        assert "WARNING: auth.mode=disabled" in out.stdout
