"""Operating a release from day two on: renders that GitOps can diff, upgrades that restart no run unless
KubeRay's spec hash changes (computed here as KubeRay 1.6.2 does), the privileges every pod keeps, each with
its reason in checkov's config beside the chart (and checkov itself run over every values file in both
modes), one checkpoint lineage per release, and the smaller things a platform team runs into (a GPU group
added with --set, networks kept on uninstall). Rendered by a real `helm` binary; no cluster."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from chartlib import (
    CHART,
    JOB_SETS,
    NETWORKS_CHART,
    REPO,
    env_of,
    groups,
    lint_failure,
    one,
    render,
    run_helm,
    schema_errors,
    values_files,
)

from tests import tiers
from trainer.tools import submit
from trainer.tools.preflight import kuberay_hashed_spec, spec_changes

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
    """Each group's pod template, the RayJob's submitter's and the sandbox service's (its Deployment's)."""
    found = {}
    for doc in yaml.safe_load_all(rendered):
        if doc and doc["kind"] == "Deployment":
            found["sandbox"] = doc["spec"]["template"]
        if not doc or doc["kind"] not in ("RayCluster", "RayJob"):
            continue
        spec = doc["spec"].get("rayClusterSpec", doc["spec"])
        found["head"] = spec["headGroupSpec"]["template"]
        found.update({g["groupName"]: g["template"] for g in spec["workerGroupSpecs"]})
        if "submitterPodTemplate" in doc["spec"]:
            found["submitter"] = doc["spec"]["submitterPodTemplate"]
    return found


def _without_generated_tokens(rendered: str) -> tuple[str, int]:
    """The render with the random token of each Secret the chart generates (kuberl.generatedToken: `helm
    template` sees no live Secret to read back) blanked, and how many it blanked."""
    return re.subn(
        r"(?m)^(# Source: kuberl/templates/secret\.yaml\n(?:.*\n)*?  token: )\S+$", r"\1<random>", rendered
    )


@pytest.mark.parametrize("values", VALUES)
@pytest.mark.parametrize("sets", [(), JOB_SETS], ids=["raycluster", "rayjob"])
def test_should_render_byte_identical_output_when_templated_twice_with_the_same_values(values, sets) -> None:
    """But for the release's own random tokens, which `helm upgrade` reads back from the cluster: a GitOps
    tool names an existing Secret instead, and then the renders are byte-identical."""
    first, second = _template(CHART, values, *sets), _template(CHART, values, *sets)
    sandbox = bool((yaml.safe_load(values.read_text()).get("sandbox") or {}).get("enabled"))
    (a, generated), (b, _) = _without_generated_tokens(first), _without_generated_tokens(second)
    assert a == b and generated == int(sandbox)
    assert (first == second) == (not sandbox)  # a token is random, not derived from the values
    gitops = ("sandbox.existingSecret=team-sandbox-token",)
    assert _template(CHART, values, *sets, *gitops) == _template(CHART, values, *sets, *gitops)


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


def _cluster_specs(rendered: str) -> list[dict]:
    """The RayClusterSpec of each RayCluster, or of the cluster a RayJob makes (its rayClusterSpec)."""
    docs = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] in ("RayCluster", "RayJob")]
    return [d["spec"]["rayClusterSpec"] if d["kind"] == "RayJob" else d["spec"] for d in docs]


def kuberay_hash_input(spec: dict) -> str:
    """What KubeRay 1.6.2 hashes to decide that an upgrade recreates every pod of a RayCluster
    (`upgradeStrategy: Recreate`; ray-operator/controllers/ray/utils/util.go,
    GenerateHashWithoutReplicasAndWorkersToDelete): the whole RayClusterSpec, pod templates and their
    metadata included, less the head's and each worker group's pod `tolerations` and `schedulingGates`,
    each worker group's `replicas`, `minReplicas`, `maxReplicas` and `scaleStrategy.workersToDelete`, and
    `upgradeStrategy`. KubeRay then takes the SHA-1 of Go's JSON of the typed struct; this returns the
    normalised spec as canonical JSON instead. Two renders with equal results have equal KubeRay hashes
    (Go serialises equal objects equally); ours is, if anything, stricter (it tells `"1"` from `1`, where
    both parse to the same Quantity), so "equal" here is never a false reassurance."""
    spec = json.loads(json.dumps(spec))
    templates = [
        spec["headGroupSpec"]["template"],
        *(g["template"] for g in spec.get("workerGroupSpecs", [])),
    ]
    for template in templates:
        template["spec"].pop("tolerations", None)
        template["spec"].pop("schedulingGates", None)
    for group in spec.get("workerGroupSpecs", []):
        for key in ("replicas", "minReplicas", "maxReplicas"):
            group.pop(key, None)
        (group.get("scaleStrategy") or {}).pop("workersToDelete", None)
    spec.pop("upgradeStrategy", None)
    return json.dumps(spec, sort_keys=True)


def _reword(chart: Path) -> int:
    """Every piece of text in a copy of the chart that is not meant to reach a pod, reworded: the version
    and appVersion, the description, every template comment and every `#` comment line of the templates and
    files (a shell comment in the start-up script would reach the pods: this catches one), and checkov's
    reasons (charts/kuberl/checkov/). Returns how many comments it changed."""
    chart_yaml = chart / "Chart.yaml"
    meta = yaml.safe_load(chart_yaml.read_text())
    text = chart_yaml.read_text().replace(f"version: {meta['version']}", "version: 9.8.7")
    text = text.replace(f'appVersion: "{meta["appVersion"]}"', 'appVersion: "9.8.7"').replace(
        "One GRPO", "A GRPO"
    )
    chart_yaml.write_text(text)
    assert yaml.safe_load(text)["version"] == "9.8.7" and yaml.safe_load(text)["appVersion"] == "9.8.7"
    changed = 0
    for f in [*chart.glob("templates/**/*"), *chart.glob("files/*"), *chart.glob("checkov/*.yaml")]:
        if f.is_file():
            text, n = re.subn(r"(\{\{-?\s*/\*)", r"\1 Reworded.", f.read_text())
            text, m = re.subn(r"(?m)^(\s*)# ", r"\1# Reworded: ", text)
            f.write_text(text)
            changed += n + m
    return changed


@pytest.mark.parametrize("values", VALUES)
@pytest.mark.parametrize("sets", [(), JOB_SETS], ids=["raycluster", "rayjob"])
def test_should_give_kuberay_the_same_spec_hash_when_only_the_charts_version_and_text_change(
    values, sets, tmp_path
) -> None:
    """An upgrade to a chart that changes nothing in the pods must not recreate them: no chart version or
    appVersion label, no checkov reason, no comment of the start-up script reaches the RayClusterSpec."""
    other = tmp_path / "kuberl"
    shutil.copytree(CHART, other)
    assert _reword(other) > 50
    pin = ("image.tag=1.2.3",)  # appVersion is the default tag: the same values pin the image
    old, new = _template(CHART, values, *pin, *sets), _template(other, values, *pin, *sets)
    assert old != new  # the objects' own labels do say which chart made them
    before, after = _cluster_specs(old), _cluster_specs(new)
    assert len(before) == len(after) == 1
    assert kuberay_hash_input(before[0]) == kuberay_hash_input(after[0])
    assert not spec_changes(kuberay_hashed_spec(before[0]), kuberay_hashed_spec(after[0]))  # preflight agrees
    for template in _pod_templates(old).values():
        assert not {"helm.sh/chart", "app.kubernetes.io/version"} & set(template["metadata"]["labels"])


@pytest.mark.parametrize(
    "change, recreates",
    [
        (("head.rayStartParams.num-cpus=4",), True),
        (("image.tag=0.1.1",), True),
        (("podAnnotations.note=any text",), True),  # what a checkov skip in the pods was: text KubeRay hashes
        (("workerGroups.train.replicas=3",), False),
        (("workerGroups.train.tolerations[0].key=pool", "workerGroups.train.tolerations[0].operator=Exists"), False),
        (("head.tolerations[0].key=pool", "head.tolerations[0].operator=Exists"), False),
    ],
    ids=["rayStartParams", "image", "pod-annotation", "replicas", "worker-tolerations", "head-tolerations"],
)  # fmt: skip
def test_should_change_kuberays_spec_hash_only_where_kuberay_recreates_the_pods_when_values_change(
    change, recreates
) -> None:
    """The other side of the test above: the hash input tells a real change from a muted one, as KubeRay
    does (a tolerations-only change never rolls out; a replicas change is the autoscaler's business)."""
    base, changed = one(render(), "RayCluster")["spec"], one(render(*change), "RayCluster")["spec"]
    assert base != changed  # the values did change the spec
    assert (kuberay_hash_input(base) != kuberay_hash_input(changed)) == recreates
    # and `make preflight`'s warning before an upgrade (trainer/tools/preflight.py) says what KubeRay will do
    assert bool(spec_changes(kuberay_hashed_spec(base), kuberay_hashed_spec(changed))) == recreates


# ----- least privilege ---------------------------------------------------------------------------------
# What checkov asks of the lifted pod templates (bench/lift_pods.py, `make checkov`): every check passes or
# is skipped, with its reason, in the checkov config of the pod's kind beside the chart
# (charts/kuberl/checkov/), never in the pods themselves.

CHECKOV_CONFIGS = CHART / "checkov"
CHECKOV = REPO / ".venv-checkov" / "bin" / "checkov"
# Skipped for every kind: the image (a tag, IfNotPresent) and its root user. The Ray pods and the submitter
# skip the probes (KubeRay's own; a Job's pod) and the read-only root; the sandbox has probes and a read-only root.
ALWAYS_SKIPPED = {"CKV_K8S_43", "CKV_K8S_15", "CKV_K8S_23", "CKV_K8S_40"}
PROBES_AND_ROOT = {"CKV_K8S_8", "CKV_K8S_9", "CKV_K8S_22"}


def _kind(name: str) -> str:
    return name if name in ("sandbox", "submitter") else "ray"


def _checkov_skips(kind: str) -> dict[str, str]:
    """The checks a kind's config skips, each with its reason: the comment lines right above its entry,
    which begin with `CHECK_ID:`."""
    skips, comment = {}, []
    for line in (CHECKOV_CONFIGS / f"{kind}.yaml").read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            comment.append(stripped.lstrip("# "))
        elif stripped.startswith("- ") and comment:
            check = stripped[2:].strip()
            text = " ".join(comment)
            assert text.startswith(f"{check}: "), f"{kind}.yaml: the reason above {check} does not name it"
            skips[check] = text.removeprefix(f"{check}: ")
            comment = []
        else:
            comment = []
    listed = yaml.safe_load((CHECKOV_CONFIGS / f"{kind}.yaml").read_text())["skip-check"]
    assert sorted(listed) == sorted(skips), f"{kind}.yaml: a skip without its reason above it"
    return skips


@pytest.mark.parametrize("kind", ["ray", "sandbox", "submitter"])
def test_should_give_every_checkov_skip_its_reason_when_the_config_lists_it(kind) -> None:
    skips = _checkov_skips(kind)
    assert ALWAYS_SKIPPED <= set(skips) and all(len(reason) > 30 for reason in skips.values())
    assert PROBES_AND_ROOT & set(skips) == (set() if kind == "sandbox" else PROBES_AND_ROOT)
    # each privilege only where it is kept: capabilities on the sandbox alone, Secrets in the environment
    # never there, no CPU limit only on the head and GPU workers
    assert ("CKV_K8S_25" in skips) == (kind == "sandbox")
    assert ("CKV_K8S_35" in skips) == (kind != "sandbox")
    assert ("CKV_K8S_11" in skips) == (kind == "ray")
    config = yaml.safe_load((CHECKOV_CONFIGS / f"{kind}.yaml").read_text())
    assert config["framework"] == ["kubernetes"] and config["skip-download"] is True


@pytest.mark.parametrize("values", VALUES)
@pytest.mark.parametrize("sets", [(), JOB_SETS], ids=["raycluster", "rayjob"])
def test_should_render_no_checkov_skip_into_any_pod_when_rendered(values, sets) -> None:
    """A skip's reason in a pod template is text KubeRay hashes: rewording it would recreate the cluster."""
    for name, template in _pod_templates(_template(CHART, values, *sets)).items():
        assert not [
            k for k in template["metadata"].get("annotations") or {} if k.startswith("checkov.io/")
        ], name


def test_should_keep_the_checkov_configs_out_of_the_chart_package_when_helm_loads_it() -> None:
    assert "checkov/" in (CHART / ".helmignore").read_text().splitlines()


@pytest.mark.parametrize("values", GPU_VALUES)
@pytest.mark.parametrize("sets", [(), JOB_SETS], ids=["raycluster", "rayjob"])
def test_should_keep_only_the_privileges_it_names_a_reason_for_when_rendered(values, sets) -> None:
    templates = _pod_templates(_template(CHART, values, *sets))
    for name, template in templates.items():
        pod = template["spec"]
        ray = pod["containers"][0]
        sc = ray["securityContext"]
        skips = _checkov_skips(_kind(name))
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
            assert sc["readOnlyRootFilesystem"] is True and "CKV_K8S_22" not in skips
            # CKV_K8S_35 is not skipped there: no Secret in its environment, only the downward API's address
            assert not [e for e in ray["env"] if "secretKeyRef" in (e.get("valueFrom") or {})]
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


def _need_checkov() -> None:
    if not CHECKOV.exists():
        pytest.skip(
            f"checkov is missing at {CHECKOV.relative_to(REPO)}: run `make checkov` (make test does it)"
        )


def _checkov(kind: str, pods: Path, *args: str) -> subprocess.CompletedProcess:
    _need_checkov()
    if not args:
        args = ("--config-file", str(CHECKOV_CONFIGS / f"{kind}.yaml"))
    return subprocess.run([str(CHECKOV), *args, "-d", str(pods / kind)], capture_output=True, text=True,
                          timeout=300, cwd=pods)  # fmt: skip


@pytest.fixture(scope="module")
@tiers.starts("lifts every pod template with a Python interpreter of its own")
def lifted(tmp_path_factory) -> Path:
    """Every values file's pod templates, as the RayCluster and as the RayJob, lifted as `make checkov`
    lifts them (bench/lift_pods.py), one directory per kind."""
    _need_checkov()
    out = tmp_path_factory.mktemp("pods")
    subprocess.run([sys.executable, str(REPO / "bench" / "lift_pods.py"), str(out), *map(str, values_files())],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    return out


@pytest.mark.parametrize("kind", ["ray", "sandbox", "submitter"])
def test_should_pass_checkov_with_only_its_kinds_skips_when_every_values_file_renders_in_both_modes(
    kind, lifted
) -> None:
    pods = [p for p in (lifted / kind).glob("*.yaml") if not p.name.endswith("-policy.yaml")]
    # every values file in both modes: a submitter per values file, a sandbox Deployment where a values file has one
    expected = {"submitter": len(values_files())}.get(kind)
    assert pods and (expected is None or len(pods) == expected)
    assert any("-job-" in p.name for p in pods) and (
        kind == "submitter" or any("-job-" not in p.name for p in pods)
    )
    out = _checkov(kind, lifted)
    assert out.returncode == 0 and "Failed checks: 0" in out.stdout, out.stdout[-3000:] + out.stderr[-2000:]


@pytest.mark.parametrize("kind", ["ray", "sandbox", "submitter"])
def test_should_fail_each_check_it_skips_when_checkov_runs_without_the_skip(kind, lifted) -> None:
    """No skip is dead weight: each one hides a failure some pod of its kind would show."""
    skips = sorted(_checkov_skips(kind))
    out = _checkov(
        kind, lifted, "--framework", "kubernetes", "--compact", "--skip-download", "--check", ",".join(skips)
    )
    failed = set(re.findall(r"^Check: (CKV_K8S_\d+):", out.stdout, flags=re.M))
    assert out.returncode == 1 and failed == set(skips), out.stdout[-3000:] + out.stderr[-2000:]


@pytest.mark.integration  # runs checkov
def test_should_pass_the_checks_whose_reason_the_values_remove_when_checkov_runs_without_those_skips(
    tmp_path,
) -> None:
    """A digest, `Always`, a non-root user and a CPU limit in the values: then the head passes CKV_K8S_43, 15,
    23, 40 and 11 with no skip (the config skips them for every Ray pod; only the values decide)."""
    _need_checkov()
    sets = ("image.tag=0.1.0@sha256:" + "a" * 64, "image.pullPolicy=Always", "podSecurityContext.runAsNonRoot=true",
            "podSecurityContext.runAsUser=10001", "head.resources.limits.cpu=12")  # fmt: skip
    head = _pod_templates(_template(CHART, values_files()[0], *sets))["head"]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {**head["metadata"], "name": "head", "namespace": "exp"},
           "spec": head["spec"]}  # fmt: skip
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "head.yaml").write_text(yaml.safe_dump(pod))
    checks = "CKV_K8S_43,CKV_K8S_15,CKV_K8S_23,CKV_K8S_40,CKV_K8S_11"
    out = _checkov(
        "ray", tmp_path, "--framework", "kubernetes", "--compact", "--skip-download", "--check", checks
    )
    assert out.returncode == 0 and "Passed checks: 5, Failed checks: 0" in out.stdout, out.stdout[-3000:]


def test_should_render_valid_objects_when_rdma_is_off_for_one_node() -> None:
    # a one-node run needs no RDMA, whose hostPath mounts would force a privileged namespace
    lora = next(p for p in values_files() if p.stem.startswith("lora-"))
    docs = [d for d in yaml.safe_load_all(_template(CHART, lora)) if d]
    assert not [e for d in docs for e in schema_errors(d)]
    for template in _pod_templates(_template(CHART, lora)).values():
        assert not [v for v in template["spec"]["volumes"] if "hostPath" in v]
    assert one(docs, "RayCluster")["spec"]["workerGroupSpecs"][0]["replicas"] == 1


# ----- one release, one checkpoint lineage -------------------------------------------------------------


def _ray_envs(namespace: str, release: str, *sets: str) -> tuple[dict[str, dict[str, str]], dict]:
    """{pod template: {env name: value}} of the Ray containers, and the RayJob's spec (or {})."""
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
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert not [e for d in docs for e in schema_errors(d)]
    job = [d["spec"] for d in docs if d["kind"] == "RayJob"]
    spec = job[0]["rayClusterSpec"] if job else one(docs, "RayCluster")["spec"]
    templates = {
        "head": spec["headGroupSpec"]["template"],
        **{g["groupName"]: g["template"] for g in spec["workerGroupSpecs"]},
    }
    envs = {name: {k: e.get("value") for k, e in env_of(t).items()} for name, t in templates.items()}  # fmt: skip
    return envs, (job[0] if job else {})


@pytest.mark.parametrize("sets", [(), (*JOB_SETS, "experiment=tiny")], ids=["raycluster", "rayjob"])
def test_should_give_each_release_its_own_logs_and_checkpoints_and_share_the_caches_when_rendered(
    sets,
) -> None:
    """The trainer adds `<experiment>`: two releases of one experiment on one storage keep two lineages."""
    envs, job = _ray_envs("team-a", "gemma", "sandbox.enabled=true", *sets)
    assert set(envs) == {"head", "train"}  # the sandbox service is no Ray pod, and holds no storage
    for name, env in envs.items():
        # the lineage's owner, the same for every attempt of a RayJob
        assert env["KUBERL_RELEASE"] == "team-a/gemma", name
        assert env["KUBERL_LOG_DIR"] == "/data/logs/team-a/gemma", name
        assert env["KUBERL_CHECKPOINT_DIR"] == "/data/checkpoints/team-a/gemma", name
        assert (env["HF_HOME"], env["KUBERL_CACHE"]) == ("/data/hf-cache", "/data/cache"), name
    if job:  # a retry of the RayJob resumes from its own lineage, and only from it
        assert ("logger.log_dir=/data/logs/team-a/gemma checkpointing.checkpoint_dir=/data/checkpoints/team-a/gemma"
                in job["entrypoint"])  # fmt: skip


def test_should_keep_two_lineages_apart_when_two_releases_run_one_experiment_on_one_storage() -> None:
    dirs = set()
    for namespace, release in (
        ("team-a", "gemma"),
        ("team-b", "gemma"),
        ("team-a", "gemma-lora"),
        ("team-a-gemma", "x"),
    ):
        envs, _ = _ray_envs(namespace, release, "experiment=gemma3-27b-gsm8k")
        dirs.add(envs["head"]["KUBERL_CHECKPOINT_DIR"])
    assert len(dirs) == 4


def test_should_share_one_directory_by_choice_when_per_release_is_off() -> None:
    envs, _ = _ray_envs("team-a", "gemma", "storage.perRelease=false", "storage.paths.checkpoints=team/ckpt")
    env = envs["head"]
    assert (env["KUBERL_LOG_DIR"], env["KUBERL_CHECKPOINT_DIR"]) == ("/data/logs", "/data/team/ckpt")
    assert env["KUBERL_RELEASE"] == "team-a/gemma"  # the trainer's lease still names the owner


def test_should_write_where_the_rayjob_writes_when_make_submit_runs_on_the_releases_raycluster() -> None:
    """`make submit` builds no path: its entrypoint reads the directories the chart gives the head
    (trainer/tools/submit.py), so a job submitted to the RayCluster keeps the release's lineage, as the RayJob
    of the same release does."""
    envs, _ = _ray_envs("team-a", "gemma", "experiment=tiny")
    _, job = _ray_envs("team-a", "gemma", *JOB_SETS, "experiment=tiny")
    command = submit.entrypoint("tiny", []).replace("python -m trainer", "printf '%s\\n'")
    head = {k: v for k, v in envs["head"].items() if k.startswith("KUBERL_") and v is not None}
    out = subprocess.run(["sh", "-c", command], capture_output=True, text=True, env=head, timeout=30)
    submitted = [
        a for a in out.stdout.split() if a.startswith(("logger.log_dir=", "checkpointing.checkpoint_dir="))
    ]
    assert submitted == [
        "logger.log_dir=/data/logs/team-a/gemma",
        "checkpointing.checkpoint_dir=/data/checkpoints/team-a/gemma",
    ]
    assert all(a in job["entrypoint"].split() for a in submitted)


# ----- smaller day-two items ---------------------------------------------------------------------------


def test_should_refuse_a_gpu_group_without_cpu_and_memory_requests_when_added_with_set() -> None:
    """A GPU pod gets a memory-backed /dev/shm of shmSize (256Gi): without a memory request it would have no
    memory limit (its request is the limit) and could take the node's memory from everything else on it."""
    bare = ("workerGroups.gen.replicas=1", "workerGroups.gen.gpus=8")
    assert "at '/workerGroups/gen': missing property 'resources'" in lint_failure(*bare)
    assert "at '/workerGroups/gen/resources/requests': missing property 'memory'" in lint_failure(
        *bare, "workerGroups.gen.resources.requests.cpu=16"
    )
    assert "missing property 'cpu'" in lint_failure(*bare, "workerGroups.gen.resources.requests.memory=128Gi")
    # a CPU group needs neither; a GPU group with both renders, its memory limit its request
    assert groups(render("workerGroups.cpu.replicas=1", "workerGroups.cpu.gpus=0"))["cpu"]
    sets = (
        *bare,
        "workerGroups.gen.resources.requests.cpu=16",
        "workerGroups.gen.resources.requests.memory=128Gi",
    )
    limits = groups(render(*sets))["gen"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["memory"] == "128Gi" and limits["nvidia.com/gpu"] == 8


@pytest.mark.parametrize("values", VALUES)
def test_should_give_every_gpu_group_of_a_values_file_cpu_and_memory_requests_when_rendered(values) -> None:
    for name, template in _pod_templates(_template(CHART, values)).items():
        resources = template["spec"]["containers"][0]["resources"]
        if "nvidia.com/gpu" in resources.get("limits", {}):
            assert {"cpu", "memory"} <= set(resources["requests"]), name


def test_should_keep_the_networks_when_their_release_is_uninstalled() -> None:
    """Running RDMA pods use them: `helm uninstall kuberl-networks` must not cut their NICs."""
    sets = ("gvnic.vpc=g-net", "gvnic.subnet=g-sub", "roce.vpc=r-net", "roce.subnetPrefix=r-sub")
    out = run_helm("template", "nets", str(NETWORKS_CHART), *[a for s in sets for a in ("--set", s)])
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert {d["kind"] for d in docs} == {"Network", "GKENetworkParamSet"} and len(docs) == 18
    for d in docs:
        assert d["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep", d["metadata"]["name"]
        assert not schema_errors(d)
