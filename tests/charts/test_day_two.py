"""Operating a release from day two on: renders that GitOps can diff, upgrades that restart no run
unless a pod changes, and the privileges every pod keeps, each with its reason. Rendered by a real
`helm` binary from every values file; no cluster."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from chartlib import CHART, JOB_SETS, one, run_helm, schema_errors, values_files

VALUES = [pytest.param(p, id=p.stem) for p in values_files()]
GPU_VALUES = [pytest.param(p, id=p.stem) for p in values_files() if p.stem != "local"]


def _template(chart: Path, values: Path, *sets: str) -> str:
    args = ["template", values.stem, str(chart), "-f", str(values), "--namespace", "exp"]
    for s in sets:
        args += ["--set", s]
    out = run_helm(*args)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _pod_templates(rendered: str) -> dict[str, dict]:
    """What KubeRay hashes to decide whether an upgrade recreates pods: each group's pod template."""
    found = {}
    for doc in yaml.safe_load_all(rendered):
        if not doc or doc["kind"] not in ("RayCluster", "RayJob"):
            continue
        spec = doc["spec"].get("rayClusterSpec", doc["spec"])
        found["head"] = spec["headGroupSpec"]["template"]
        found.update({g["groupName"]: g["template"] for g in spec["workerGroupSpecs"]})
        if "submitterPodTemplate" in doc["spec"]:
            found["submitter"] = doc["spec"]["submitterPodTemplate"]
    return found


@pytest.mark.parametrize("values", VALUES)
@pytest.mark.parametrize("sets", [(), JOB_SETS], ids=["raycluster", "rayjob"])
def test_should_render_byte_identical_output_when_templated_twice_with_the_same_values(values, sets) -> None:
    first = _template(CHART, values, *sets)
    assert _template(CHART, values, *sets) == first


@pytest.mark.parametrize("values", VALUES)
def test_should_render_no_cluster_scoped_object_when_not_asked_to(values) -> None:
    # Networks are the platform's (charts/kuberl-networks); a Lustre PV only for storage.type=lustre
    # without an existing claim, one per release (its name hashes namespace and release).
    docs = [d for d in yaml.safe_load_all(_template(CHART, values)) if d]
    cluster_scoped = {d["kind"] for d in docs} & {"Network", "GKENetworkParamSet", "ClusterRole", "ClusterRoleBinding",
                                                  "PriorityClass", "StorageClass", "Namespace"}  # fmt: skip
    assert not cluster_scoped
    storage = yaml.safe_load(values.read_text()).get("storage") or {}
    if [d for d in docs if d["kind"] == "PersistentVolume"]:
        assert storage.get("type") == "lustre" and not storage.get("lustre", {}).get("existingClaim")


@pytest.mark.parametrize("values", VALUES)
@pytest.mark.parametrize("sets", [(), JOB_SETS], ids=["raycluster", "rayjob"])
def test_should_render_byte_identical_pod_templates_when_only_the_chart_version_changes(
    values, sets, tmp_path
) -> None:
    """An upgrade to a chart that changes nothing in the pods must not recreate them (KubeRay hashes the
    template, metadata included): no chart version or appVersion label in a pod template."""
    other = tmp_path / "kuberl"
    shutil.copytree(CHART, other)
    chart_yaml = other / "Chart.yaml"
    text = chart_yaml.read_text()
    meta = yaml.safe_load(text)
    text = text.replace(f"version: {meta['version']}", "version: 9.8.7").replace(
        f'appVersion: "{meta["appVersion"]}"', 'appVersion: "9.8.7"')  # fmt: skip
    chart_yaml.write_text(text)
    assert yaml.safe_load(text)["version"] == "9.8.7" and yaml.safe_load(text)["appVersion"] == "9.8.7"
    pin = ("image.tag=1.2.3",)  # appVersion is the default tag: the same values pin the image
    old, new = _template(CHART, values, *pin, *sets), _template(other, values, *pin, *sets)
    assert old != new  # the objects' own labels do say which chart made them
    before, after = _pod_templates(old), _pod_templates(new)
    assert before and yaml.safe_dump(before) == yaml.safe_dump(after)
    for template in before.values():
        assert not {"helm.sh/chart", "app.kubernetes.io/version"} & set(template["metadata"]["labels"])


# ----- least privilege ---------------------------------------------------------------------------------
# What checkov 3.3.30 asks of the lifted pod templates (bench/lift_pods.py, bench/README.md), pinned here
# without checkov: every check passes or carries its skip annotation with a reason.

ALWAYS_SKIPPED = {
    "CKV_K8S_8",
    "CKV_K8S_9",
    "CKV_K8S_22",
    "CKV_K8S_43",
    "CKV_K8S_15",
    "CKV_K8S_23",
    "CKV_K8S_40",
}


def _skips(template: dict) -> dict[str, str]:
    annotations = template["metadata"].get("annotations") or {}
    return dict(v.split("=", 1) for k, v in annotations.items() if k.startswith("checkov.io/skip"))


@pytest.mark.parametrize("values", GPU_VALUES)
def test_should_keep_only_the_privileges_it_names_a_reason_for_when_rendered(values) -> None:
    templates = _pod_templates(_template(CHART, values))
    for name, template in templates.items():
        pod = template["spec"]
        ray = pod["containers"][0]
        sc = ray["securityContext"]
        skips = _skips(template)
        assert ALWAYS_SKIPPED <= set(skips) and all(len(reason) > 30 for reason in skips.values()), name
        assert pod["automountServiceAccountToken"] is False, name
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC"), name
        assert sc["allowPrivilegeEscalation"] is False and not sc.get("privileged"), name
        assert sc["capabilities"]["drop"] == ["ALL"], name  # NET_RAW with the rest
        # only the sandbox adds any back, and only what Pod Security baseline allows
        assert set(sc["capabilities"].get("add", [])) <= (
            {"SETFCAP", "SETGID", "SETUID"} if name == "sandbox" else set()
        )
        assert ray["resources"]["limits"]["memory"] and ray["resources"]["requests"]["memory"], name
        assert not [p for p in ray.get("ports", []) if "hostPort" in p], name
        if name == "sandbox":
            assert sc["seccompProfile"] == {"type": "Unconfined"} and "CKV_K8S_25" in skips
        else:
            assert (
                pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
                and "seccompProfile" not in sc
            )
        if "cpu" not in ray["resources"]["limits"]:
            assert "CKV_K8S_11" in skips, name


@pytest.mark.parametrize("values", GPU_VALUES)
def test_should_limit_the_memory_of_gpu_workers_beside_their_shared_memory_when_rendered(values) -> None:
    for name, template in _pod_templates(_template(CHART, values)).items():
        resources = template["spec"]["containers"][0]["resources"]
        if "nvidia.com/gpu" in resources.get("limits", {}):
            assert resources["limits"]["memory"] == resources["requests"]["memory"], name


def test_should_drop_a_skip_when_the_values_remove_its_reason() -> None:
    values = values_files()[0]
    sets = ("image.tag=0.1.0@sha256:" + "a" * 64, "image.pullPolicy=Always", "podSecurityContext.runAsNonRoot=true",
            "head.resources.limits.cpu=12")  # fmt: skip
    head = _pod_templates(_template(CHART, values, *sets))["head"]
    assert not {"CKV_K8S_43", "CKV_K8S_15", "CKV_K8S_23", "CKV_K8S_40", "CKV_K8S_11"} & set(_skips(head))


def test_should_render_valid_objects_when_rdma_is_off_for_one_node() -> None:
    # a one-node run needs no RDMA, whose hostPath mounts would force a privileged namespace
    lora = next(p for p in values_files() if p.stem.startswith("lora-"))
    docs = [d for d in yaml.safe_load_all(_template(CHART, lora)) if d]
    assert not [e for d in docs for e in schema_errors(d)]
    for template in _pod_templates(_template(CHART, lora)).values():
        assert not [v for v in template["spec"]["volumes"] if "hostPath" in v]
    assert one(docs, "RayCluster")["spec"]["workerGroupSpecs"][0]["replicas"] == 1
