"""A worker group that serves reward models: it offers the custom Ray resource the reward model's replicas
ask for (`workerGroups.<name>.rayResources`),
and is otherwise a GPU worker like the training ones: the same image, shared storage, the Pod Security
`baseline` context, the release's NetworkPolicy and disruption budget. Rendered by a real `helm` binary
and checked against the strict KubeRay and Kubernetes schemas in ../shared/schemas."""

from __future__ import annotations

import pytest
from chartlib import (
    CHART,
    JOB_SETS,
    VALUES,
    gpu_group,
    groups,
    lint_failure,
    one,
    ray_resources,
    render,
    run_helm,
    schema_errors,
)

RM = (*gpu_group("rm", gpus=1), "workerGroups.rm.rayResources.kuberl_reward_model=1")
PRESET = VALUES / "qwen2.5-coder-7b-code-rm-b200.yaml"
JOB = (*JOB_SETS, "experiment=qwen2.5-coder-7b-code-rm")  # a RayJob runs a named experiment


def _valid(docs: list[dict]) -> list[dict]:
    errors = [e for d in docs for e in schema_errors(d)]
    assert not errors, "\n".join(errors)
    return docs


def _cluster_spec(docs: list[dict]) -> dict:
    found = [d for d in docs if d["kind"] in ("RayCluster", "RayJob")]
    assert len(found) == 1
    return found[0]["spec"].get("rayClusterSpec", found[0]["spec"])


def _groups(docs: list[dict]) -> dict[str, dict]:
    return {g["groupName"]: g for g in _cluster_spec(docs)["workerGroupSpecs"]}


def _template_failure(*sets: str) -> str:
    args = ["template", "x", str(CHART), "--set", "storage.gcsfuse.bucketName=b"]
    for s in sets:
        args += ["--set", s]
    out = run_helm(*args)
    assert out.returncode != 0, f"rendered with {sets}"
    return out.stderr


def _selects(selector: dict, labels: dict) -> bool:
    """Whether a Kubernetes label selector (matchLabels, matchExpressions In/NotIn) selects `labels`."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions", []):
        inside = labels.get(e["key"]) in e["values"]
        if (e["operator"] == "In") != inside:
            return False
    return True


@pytest.mark.parametrize("sets", [(), JOB], ids=["raycluster", "rayjob"])
def test_should_offer_the_reward_models_resource_on_its_group_when_the_group_declares_it(sets) -> None:
    docs = _valid(render(*RM, *sets))
    rm = _groups(docs)["rm"]
    assert ray_resources(rm) == {"kuberl_reward_model": 1}
    # KubeRay hands it to `ray start --resources` as it writes the flag itself: JSON in single quotes
    assert rm["rayStartParams"]["resources"] == "'{\"kuberl_reward_model\": 1}'"
    limits = rm["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 1 and "num-gpus" not in rm["rayStartParams"]  # Ray sees its GPU


def test_should_write_every_resource_in_order_when_a_group_offers_several() -> None:
    docs = render(*RM, "workerGroups.rm.rayResources.accel_b=4", "workerGroups.rm.rayResources.a=2")
    assert groups(docs)["rm"]["rayStartParams"]["resources"] == (
        '\'{"a": 2, "accel_b": 4, "kuberl_reward_model": 1}\''
    )
    assert render(*RM, "workerGroups.rm.rayResources.accel_b=4", "workerGroups.rm.rayResources.a=2") == docs


def test_should_offer_no_custom_resource_when_no_group_declares_one() -> None:
    for docs in (render(), render(*gpu_group("rm", gpus=1))):
        assert all("resources" not in g["rayStartParams"] for g in groups(docs).values())


def test_should_offer_no_sandbox_resource_when_the_sandbox_is_a_service_of_its_own() -> None:
    # code rewards call the sandbox service (KUBERL_SANDBOX_URL): no Ray group, no resource to ask for
    found = groups(render("sandbox.enabled=true", "sandbox.cpus=7", *RM))
    assert set(found) == {"train", "rm"}
    assert ray_resources(found["rm"]) == {"kuberl_reward_model": 1} and ray_resources(found["train"]) == {}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (
            "workerGroups.rm.rayResource.kuberl_reward_model=1",
            "additional properties 'rayResource' not allowed",
        ),
        ("workerGroups.rm.rayResources.kuberl_reward_model=0", "minimum: got 0, want 1"),
        ("workerGroups.rm.rayResources.kuberl_reward_model=one", "want integer"),
        ("workerGroups.rm.rayResources.GPU=1", "invalid propertyName 'GPU'"),
        ("workerGroups.rm.rayResources.bad-name=1", "'bad-name' does not match pattern"),
    ],
    ids=["unknown-key", "zero-units", "not-a-number", "rays-own-resource", "bad-name"],
)
def test_should_refuse_in_lint_naming_the_key_when_the_schema_rejects_a_group_resource(bad, message) -> None:
    out = lint_failure(*RM, bad)
    assert message in out, out


def test_should_fail_naming_both_keys_when_ray_start_params_also_set_resources() -> None:
    err = _template_failure(*RM, "workerGroups.rm.rayStartParams.resources='{\"x\": 1}'")
    assert "workerGroups.rm: rayStartParams.resources and rayResources both set: keep rayResources" in err


def test_should_run_the_reward_model_group_as_the_training_group_runs_when_rendered() -> None:
    """The same image, the shared storage mounts (weights are read there), the GPU preset's node selector
    and tolerations, the restricted security context and service account: what changes is only what the
    group sets (its GPUs, resources and resource)."""
    docs = _valid(render(*RM, "workerGroups.rm.nodeSelector.pool=rm", "storage.models.enabled=true"))
    train, rm = (groups(docs)[n]["template"]["spec"] for n in ("train", "rm"))
    t, r = train["containers"][0], rm["containers"][0]
    assert r["image"] == t["image"] and r["securityContext"] == t["securityContext"]
    assert r["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert r["securityContext"]["allowPrivilegeEscalation"] is False
    assert r["volumeMounts"] == t["volumeMounts"] and rm["volumes"] == train["volumes"]
    assert any(m["mountPath"] == "/models" and m.get("readOnly") for m in r["volumeMounts"])
    assert r["env"] == t["env"]
    for key in ("serviceAccountName", "automountServiceAccountToken", "securityContext", "tolerations"):
        assert rm[key] == train[key], key
    assert rm["nodeSelector"] == {**train["nodeSelector"], "pool": "rm"}
    assert rm["nodeSelector"]["cloud.google.com/gke-accelerator"] == "nvidia-b200"


def test_should_admit_the_reward_model_pods_with_the_releases_pods_when_network_policy_is_on() -> None:
    docs = _valid(render(*RM, "sandbox.enabled=true"))
    labels = groups(docs)["rm"]["template"]["metadata"]["labels"]
    policies = {p["metadata"]["name"]: p["spec"] for p in docs if p["kind"] == "NetworkPolicy"}
    main, sandbox = policies["exp1"], policies["exp1-sandbox"]
    assert _selects(main["podSelector"], labels) and not _selects(sandbox["podSelector"], labels)
    # its peers are the release's pods: the head and the training workers reach it, and it them
    head = _cluster_spec(docs)["headGroupSpec"]["template"]["metadata"]["labels"]
    for rules in (main["ingress"][0]["from"], main["egress"][0]["to"]):
        assert _selects(rules[0]["podSelector"], labels) and _selects(rules[0]["podSelector"], head)


def test_should_count_the_reward_model_pods_in_the_disruption_budget_when_rendered() -> None:
    pdb = one(render(*RM, "workerGroups.rm.replicas=2"), "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1 + 1 + 2


@pytest.mark.parametrize("sets", [(), JOB_SETS], ids=["raycluster", "rayjob"])
def test_should_render_the_presets_reward_model_group_valid_against_the_strict_schemas_when_templated(
    sets,
) -> None:
    docs = _valid(render(*sets, values=(str(PRESET),)))
    rm = _groups(docs)["reward-model"]
    assert ray_resources(rm) == {"kuberl_reward_model": 1} and rm["replicas"] == 1
    assert rm["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    lint = run_helm("lint", "--strict", str(CHART), "-f", str(PRESET), *(["--set", *sets] if sets else []))
    assert lint.returncode == 0, lint.stdout + lint.stderr
