"""Behaviour of charts/kuberl, one case per test, rendered by a real `helm` binary."""

from __future__ import annotations

import json

import pytest
import yaml
from chartlib import (
    CHART,
    NETWORKS_CHART,
    RDMA,
    REPO,
    env_of,
    gpu_group,
    groups,
    head_template,
    lint_failure,
    node_file,
    one,
    render,
    run_helm,
    run_start_script,
    schema_errors,
    start_script,
)

# ----- RayCluster shape ---------------------------------------------------------------------------


def test_should_list_all_default_head_ports_and_tensorboard_when_tensorboard_enabled() -> None:
    ports = {p["name"]: p["containerPort"] for p in head_template(render())["spec"]["containers"][0]["ports"]}
    assert ports == {"gcs": 6379, "dashboard": 8265, "client": 10001, "metrics": 8080, "tensorboard": 6006}


def test_should_drop_the_tensorboard_port_and_process_when_tensorboard_disabled() -> None:
    head = head_template(render("tensorboard.enabled=false"))["spec"]["containers"][0]
    assert "tensorboard" not in {p["name"] for p in head["ports"]}
    assert "tensorboard" not in head["args"][0]


def test_should_start_tensorboard_on_the_shared_log_dir_only_on_the_head_when_enabled() -> None:
    docs = render()
    assert 'tensorboard --logdir "$KUBERL_LOG_DIR"' in head_template(docs)["spec"]["containers"][0]["args"][0]
    assert "tensorboard" not in groups(docs)["train"]["template"]["spec"]["containers"][0]["args"][0]


def test_should_give_a_stopped_job_the_pods_grace_before_sigkill_when_rendered() -> None:
    docs = render("terminationGracePeriodSeconds=300")
    for template in [head_template(docs), *(g["template"] for g in groups(docs).values())]:
        assert template["spec"]["terminationGracePeriodSeconds"] == 300
        # Ray's job supervisor reads it (its default, 3 s, would kill a save at `make stop`)
        assert env_of(template)["RAY_JOB_STOP_WAIT_TIME_S"]["value"] == "300"


def test_should_give_the_head_no_gpus_when_workers_have_gpus() -> None:
    head = one(render(), "RayCluster")["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    resources = head["template"]["spec"]["containers"][0]["resources"]
    assert "nvidia.com/gpu" not in json.dumps(resources)


def test_should_render_replicas_min_and_max_for_every_group_when_only_replicas_given() -> None:
    docs = render(
        "workerGroups.train.replicas=4",
        *gpu_group("generation"),
    )
    for g in groups(docs).values():
        assert {"replicas", "minReplicas", "maxReplicas"} <= set(g)
    assert groups(docs)["train"]["replicas"] == groups(docs)["train"]["maxReplicas"] == 4


def test_should_keep_explicit_min_and_max_replicas_when_given() -> None:
    g = groups(render("workerGroups.train.minReplicas=0", "workerGroups.train.maxReplicas=3"))["train"]
    assert (g["replicas"], g["minReplicas"], g["maxReplicas"]) == (1, 0, 3)


def test_should_add_a_worker_group_when_set_on_the_command_line() -> None:
    docs = render(*gpu_group("generation", replicas=2))
    assert set(groups(docs)) == {"train", "generation"}
    assert not [e for d in docs for e in schema_errors(d)]


def test_should_request_and_limit_the_group_gpus_when_a_group_has_gpus() -> None:
    res = groups(render("workerGroups.train.gpus=4"))["train"]["template"]["spec"]["containers"][0][
        "resources"
    ]
    assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == 4


def test_should_add_gpu_toleration_and_memory_backed_shm_when_a_group_has_gpus() -> None:
    spec = groups(render())["train"]["template"]["spec"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in spec["containers"][0]["volumeMounts"]


@pytest.mark.parametrize(
    ("gpu", "machine", "accelerator", "tuner"),
    [
        ("b200", "a4-highgpu-8g", "nvidia-b200", "/usr/local/gib/configs/tuner_config_a4.txtpb"),
        ("h200", "a3-ultragpu-8g", "nvidia-h200-141gb", "/usr/local/gib/configs/tuner_config_a3u.txtpb"),
    ],
)
def test_should_pick_machine_accelerator_and_tuner_when_gpu_type_is_set(
    gpu, machine, accelerator, tuner, tmp_path
) -> None:
    template = groups(render(f"gpu.type={gpu}", *RDMA))["train"]["template"]
    selector = template["spec"]["nodeSelector"]
    assert selector["node.kubernetes.io/instance-type"] == machine
    assert selector["cloud.google.com/gke-accelerator"] == accelerator
    # the preset's tuner file applies where the installer's script names none
    node_file(tmp_path, "/usr/local/gib/scripts/set_nccl_env.sh", "export NCCL_NET=gIB\n")
    out = run_start_script(template, tmp_path)
    assert out.returncode == 0, out.stderr
    assert f"NCCL_TUNER_CONFIG_PATH={tuner}" in out.stdout.splitlines()


def test_should_render_a_cpu_only_cluster_when_gpu_type_is_none() -> None:
    docs = render("gpu.type=none", "workerGroups.train.gpus=0", "storage.type=hostPath")
    spec = groups(docs)["train"]["template"]["spec"]
    assert "nodeSelector" not in spec and "tolerations" not in spec
    assert groups(docs)["train"]["rayStartParams"]["num-gpus"] == "0"


def test_should_add_spot_node_selector_and_toleration_when_capacity_is_spot() -> None:
    spec = groups(render("capacity.type=spot"))["train"]["template"]["spec"]
    assert spec["nodeSelector"]["cloud.google.com/gke-spot"] == "true"
    assert any(t["key"] == "cloud.google.com/gke-spot" for t in spec["tolerations"])
    assert "cloud.google.com/gke-spot" not in json.dumps(head_template(render("capacity.type=spot")))


def test_should_select_the_reservation_when_capacity_is_reservation() -> None:
    selector = groups(render("capacity.type=reservation", "capacity.reservationName=res-1"))["train"][
        "template"
    ]["spec"]["nodeSelector"]
    assert selector["cloud.google.com/reservation-name"] == "res-1"
    assert selector["cloud.google.com/reservation-affinity"] == "specific"
    assert "cloud.google.com/gke-spot" not in selector


def test_should_fail_naming_the_value_when_reservation_has_no_name() -> None:
    out = run_helm(
        "template",
        "x",
        str(CHART),
        "--set",
        "storage.gcsfuse.bucketName=b",
        "--set",
        "capacity.type=reservation",
    )
    assert out.returncode != 0 and "capacity.reservationName" in out.stderr


# ----- start-up -----------------------------------------------------------------------------------


def _ray_templates(docs: list[dict]) -> list[dict]:
    """Every Ray pod template, in RayClusters and RayJobs alike."""
    specs = [d["spec"] for d in docs if d["kind"] == "RayCluster"]
    specs += [d["spec"]["rayClusterSpec"] for d in docs if d["kind"] == "RayJob"]
    return [
        t
        for s in specs
        for t in [s["headGroupSpec"]["template"], *(g["template"] for g in s["workerGroupSpecs"])]
    ]


def test_should_exec_kuberays_generated_ray_start_when_overwriting_the_container_command(tmp_path) -> None:
    docs = render()
    assert one(docs, "RayCluster")["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    for template in _ray_templates(docs):
        assert start_script(template).rstrip().endswith('exec /bin/bash -c "$KUBERAY_GEN_RAY_START_CMD"')
    out = run_start_script(head_template(docs), tmp_path, {"KUBERAY_GEN_RAY_START_CMD": "echo ray start ran"})
    assert out.returncode == 0 and out.stdout.strip() == "ray start ran", out.stderr


@pytest.mark.parametrize("sets", [(), ("job.enabled=true", "experiment=tiny")], ids=["raycluster", "rayjob"])
def test_should_run_tini_as_pid_1_of_every_ray_container_when_rendered(sets) -> None:
    """tini reaps the orphans of bubblewrap sandboxes; the command replaces the image's ENTRYPOINT."""
    docs = render(*gpu_group("generation"), *sets)
    assert not [e for d in docs for e in schema_errors(d)]
    templates = _ray_templates(docs)
    assert len(templates) == 3
    for template in templates:
        assert template["spec"]["containers"][0]["command"] == [
            "/usr/bin/tini",
            "--",
            "/bin/bash",
            "-c",
            "--",
        ]
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["/usr/bin/tini", "--"' in dockerfile  # the path Debian's tini package installs
    assert " tini " in dockerfile.split("apt-get install", 1)[1].split("&&", 1)[0] + " "


# ----- GPU driver ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("driver", "starts"), [("570.172.08", False), ("580.95.05", True), ("590.44.01", True)]
)
def test_should_refuse_to_start_a_gpu_worker_in_one_line_when_the_node_driver_is_older_than_r580(
    driver, starts, tmp_path
) -> None:
    """The lock's CUDA 13 wheels need R580+ (Chart.yaml `kuberl.dev/min-nvidia-driver`)."""
    min_driver = yaml.safe_load((CHART / "Chart.yaml").read_text())["annotations"][
        "kuberl.dev/min-nvidia-driver"
    ]
    assert min_driver == "580"
    node_file(tmp_path, "/usr/local/nvidia/bin/nvidia-smi", f"#!/bin/sh\necho {driver}\n", mode=0o755)
    out = run_start_script(groups(render())["train"]["template"], tmp_path)
    if starts:
        assert out.returncode == 0 and "KUBERAY_GEN_RAY_START_CMD=env" in out.stdout, out.stderr
    else:
        assert out.returncode == 1 and out.stdout == ""
        assert out.stderr.strip().splitlines() == [
            f"kuberl: this node's NVIDIA driver {driver} is older than R580, which the image's CUDA 13 wheels "
            "need: recreate the GPU node pool with gpu-driver-version=latest (docs/cluster.md)"
        ]


def test_should_check_the_driver_only_in_gpu_containers_when_rendered() -> None:
    docs = render()
    assert "nvidia-smi" in start_script(groups(docs)["train"]["template"])
    assert "nvidia-smi" not in start_script(head_template(docs))


# ----- storage ------------------------------------------------------------------------------------


def test_should_mount_shared_storage_at_the_same_path_on_every_pod_when_rendered() -> None:
    docs = render()
    for template in [head_template(docs), *(g["template"] for g in groups(docs).values())]:
        mounts = {m["name"]: m["mountPath"] for m in template["spec"]["containers"][0]["volumeMounts"]}
        assert mounts["shared"] == "/data"
        env = env_of(template)
        # the release's own logs and checkpoints (namespace exp, release exp1); the caches are shared
        assert env["KUBERL_LOG_DIR"]["value"] == "/data/logs/exp/exp1"
        assert env["KUBERL_CHECKPOINT_DIR"]["value"] == "/data/checkpoints/exp/exp1"
        assert env["HF_HOME"]["value"] == "/data/hf-cache"


def test_should_mount_the_bucket_with_the_csi_driver_and_annotate_the_pod_when_storage_is_gcsfuse() -> None:
    docs = render("storage.gcsfuse.fileCache.worker=100Gi")
    template = groups(docs)["train"]["template"]
    volume = next(v for v in template["spec"]["volumes"] if v["name"] == "shared")["csi"]
    assert volume["driver"] == "gcsfuse.csi.storage.gke.io"
    assert volume["volumeAttributes"]["bucketName"] == "test-bucket"
    assert "implicit-dirs" in volume["volumeAttributes"]["mountOptions"].split(",")
    assert volume["volumeAttributes"]["fileCacheCapacity"] == "100Gi"
    annotations = template["metadata"]["annotations"]
    assert annotations["gke-gcsfuse/volumes"] == "true"
    assert annotations["gke-gcsfuse/memory-limit"] == "0"
    assert head_template(docs)["metadata"]["annotations"]["gke-gcsfuse/volumes"] == "true"


def test_should_fail_naming_the_value_when_gcsfuse_has_no_bucket() -> None:
    out = run_helm("template", "x", str(CHART))
    assert out.returncode != 0 and "storage.gcsfuse.bucketName" in out.stderr


LUSTRE = (
    "storage.type=lustre",
    "storage.lustre.volumeHandle=proj/us-central1-b/lfs",
    "storage.lustre.ip=10.0.0.2",
    "storage.lustre.filesystem=kuberl",
)


def test_should_create_a_bound_static_pv_and_pvc_when_storage_is_lustre() -> None:
    docs = render(*LUSTRE)
    pv, pvc = one(docs, "PersistentVolume"), one(docs, "PersistentVolumeClaim")
    assert pv["spec"]["csi"]["driver"] == "lustre.csi.storage.gke.io"
    assert pv["spec"]["csi"]["volumeHandle"] == "proj/us-central1-b/lfs"
    assert pv["spec"]["csi"]["volumeAttributes"] == {"ip": "10.0.0.2", "filesystem": "kuberl"}
    assert pv["spec"]["claimRef"] == {"namespace": "exp", "name": pvc["metadata"]["name"]}
    assert pvc["spec"]["volumeName"] == pv["metadata"]["name"]
    shared = next(v for v in head_template(docs)["spec"]["volumes"] if v["name"] == "shared")
    assert shared["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert "gke-gcsfuse/volumes" not in json.dumps(docs)


def test_should_use_the_existing_claim_and_create_no_pv_when_lustre_existing_claim_is_set() -> None:
    docs = render("storage.type=lustre", "storage.lustre.existingClaim=team-lustre")
    assert not [d for d in docs if d["kind"] in ("PersistentVolume", "PersistentVolumeClaim")]
    shared = next(v for v in head_template(docs)["spec"]["volumes"] if v["name"] == "shared")
    assert shared["persistentVolumeClaim"]["claimName"] == "team-lustre"


# ----- RDMA ---------------------------------------------------------------------------------------


def test_should_put_network_annotations_on_the_gpu_worker_pod_template_when_rdma_enabled() -> None:
    docs = render(*RDMA, "podAnnotations.team=rl", "podLabels.cost-center=ml")
    template = groups(docs)["train"]["template"]
    annotations = template["metadata"]["annotations"]
    assert annotations["networking.gke.io/default-interface"] == "eth0"
    interfaces = json.loads(annotations["networking.gke.io/interfaces"])
    assert interfaces[:2] == [
        {"interfaceName": "eth0", "network": "default"},
        {"interfaceName": "eth1", "network": "gvnic-1"},
    ]
    assert [i["network"] for i in interfaces[2:]] == [f"rdma-{i}" for i in range(8)]
    # Google's NeMo-RL chart drops these on the way to the pod: check ours reach it, with the user's.
    assert annotations["team"] == "rl" and template["metadata"]["labels"]["cost-center"] == "ml"
    assert "networking.gke.io/interfaces" not in head_template(docs)["metadata"].get("annotations", {})


def test_should_carry_pod_annotations_and_labels_to_every_pod_template_when_set() -> None:
    docs = render(
        "podAnnotations.a=x", "podLabels.b=y", "head.annotations.h=head", "workerGroups.train.labels.w=worker"
    )
    head, worker = head_template(docs)["metadata"], groups(docs)["train"]["template"]["metadata"]
    assert head["annotations"]["a"] == worker["annotations"]["a"] == "x"
    assert head["labels"]["b"] == worker["labels"]["b"] == "y"
    assert head["annotations"]["h"] == "head" and "h" not in worker["annotations"]
    assert worker["labels"]["w"] == "worker" and "w" not in head["labels"]


def test_should_mount_gib_and_nvidia_libraries_when_rdma_enabled() -> None:
    template = groups(render(*RDMA))["train"]["template"]
    volumes = {v["name"]: v.get("hostPath", {}).get("path") for v in template["spec"]["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in template["spec"]["containers"][0]["volumeMounts"]}
    assert (
        volumes["nvidia-libs"] == "/home/kubernetes/bin/nvidia"
        and mounts["nvidia-libs"] == "/usr/local/nvidia"
    )
    assert volumes["gib"] == "/home/kubernetes/bin/gib" and mounts["gib"] == "/usr/local/gib"
    env = {k: e["value"] for k, e in env_of(template).items() if "value" in e}
    assert "/usr/local/gib/lib64" in env["LD_LIBRARY_PATH"].split(":")
    # NCCL's settings are not a hard-coded copy in the pod spec: the installer's script sets them
    assert not [k for k in env if k.startswith("NCCL_")]


INSTALLER_SCRIPT = """export NCCL_NET=gIB
export NCCL_IB_TC=52
export NCCL_SOCKET_IFNAME=enp0s19
export NCCL_TUNER_CONFIG_PATH=/usr/local/gib/configs/from_the_installer.txtpb
"""


def test_should_source_the_installers_nccl_settings_with_explicit_values_over_them_when_rdma_enabled(
    tmp_path,
) -> None:
    template = groups(render(*RDMA, "rdma.ncclEnv.NCCL_IB_TC=106"))["train"]["template"]
    node_file(tmp_path, "/usr/local/gib/scripts/set_nccl_env.sh", INSTALLER_SCRIPT)
    out = run_start_script(template, tmp_path)
    assert out.returncode == 0, out.stderr
    env = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
    assert env["NCCL_NET"] == "gIB"  # from the installer, not from the chart
    assert env["NCCL_TUNER_CONFIG_PATH"] == "/usr/local/gib/configs/from_the_installer.txtpb"
    assert env["NCCL_IB_TC"] == "106" and env["NCCL_SOCKET_IFNAME"] == "eth0,eth1"  # rdma.ncclEnv wins
    assert env["GLOO_SOCKET_IFNAME"] == "eth0"


def test_should_stop_a_gpu_worker_in_one_line_when_the_rdma_installer_has_not_run(tmp_path) -> None:
    out = run_start_script(groups(render(*RDMA))["train"]["template"], tmp_path)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.replace(str(tmp_path), "").strip().splitlines() == [
        "kuberl: /usr/local/gib/scripts/set_nccl_env.sh is missing: GKE's nccl-rdma-installer has not run "
        "on this node (make preflight; docs/cluster.md step 5)"
    ]


def test_should_leave_the_head_without_nccl_settings_when_rdma_enabled() -> None:
    assert "set_nccl_env.sh" not in start_script(head_template(render(*RDMA)))


def test_should_reject_an_nccl_value_that_would_break_its_quoting_when_linting() -> None:
    assert "/rdma/ncclEnv" in lint_failure("rdma.ncclEnv.NCCL_IB_TC=1'; rm -rf /")


def test_should_leave_pods_without_rdma_plumbing_when_rdma_disabled() -> None:
    docs = render()
    text = json.dumps(docs)
    assert "networking.gke.io" not in text and "NCCL_NET" not in text and "/usr/local/gib" not in text
    assert not [d for d in docs if d["kind"] in ("Network", "GKENetworkParamSet")]


def _networks(*sets: str) -> list[dict]:
    args = ["template", "nets", str(NETWORKS_CHART)]
    for v in sets:
        args += ["--set", v]
    out = run_helm(*args)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


NETS = ("gvnic.vpc=g-net", "gvnic.subnet=g-sub", "roce.vpc=r-net", "roce.subnetPrefix=r-sub")


def test_should_create_gvnic_and_rdma_networks_when_the_platform_installs_the_networks_chart() -> None:
    docs = _networks(*NETS)
    params = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "GKENetworkParamSet"}
    networks = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Network"}
    assert params["gvnic-1"] == {"vpc": "g-net", "vpcSubnet": "g-sub", "deviceMode": "NetDevice"}
    assert params["rdma-3"] == {"vpc": "r-net", "vpcSubnet": "r-sub-3", "deviceMode": "RDMA"}
    assert set(params) == set(networks) == {"gvnic-1", *(f"rdma-{i}" for i in range(8))}
    assert networks["rdma-0"]["parametersRef"]["name"] == "rdma-0"
    assert not [e for d in docs for e in schema_errors(d)]


def test_should_name_the_missing_network_value_when_the_networks_chart_lacks_one() -> None:
    out = run_helm("template", "nets", str(NETWORKS_CHART), "--set", "gvnic.vpc=g-net")
    assert out.returncode != 0 and "gvnic.subnet is required" in out.stderr


def test_should_attach_to_the_platforms_networks_and_create_none_when_rdma_enabled() -> None:
    docs = render(*RDMA)
    assert not [d for d in docs if d["kind"] in ("Network", "GKENetworkParamSet")]
    interfaces = json.loads(
        groups(docs)["train"]["template"]["metadata"]["annotations"]["networking.gke.io/interfaces"]
    )
    names = {i["network"] for i in interfaces}
    assert names == {n["metadata"]["name"] for n in _networks(*NETS) if n["kind"] == "Network"} | {"default"}


# ----- identity and secrets -----------------------------------------------------------------------


def test_should_annotate_the_service_account_for_workload_identity_when_gcp_sa_is_set() -> None:
    docs = render("serviceAccount.gcpServiceAccount=rl@proj.iam.gserviceaccount.com")
    sa = one(docs, "ServiceAccount")
    assert (
        sa["metadata"]["annotations"]["iam.gke.io/gcp-service-account"] == "rl@proj.iam.gserviceaccount.com"
    )
    assert head_template(docs)["spec"]["serviceAccountName"] == sa["metadata"]["name"]


def test_should_use_the_existing_service_account_when_create_is_false() -> None:
    docs = render("serviceAccount.create=false", "serviceAccount.name=team-sa")
    assert not [d for d in docs if d["kind"] == "ServiceAccount"]
    assert groups(docs)["train"]["template"]["spec"]["serviceAccountName"] == "team-sa"


def test_should_read_hf_token_and_wandb_key_from_secret_key_refs_when_secrets_are_named() -> None:
    docs = render(
        "secrets.wandbApiKey.secretName=wandb", "logger.backends={tensorboard,wandb}"
    )  # the key: W&B runs only
    for template in [head_template(docs), groups(docs)["train"]["template"]]:
        env = env_of(template)
        assert env["HF_TOKEN"] == {
            "name": "HF_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}},
        }
        assert env["WANDB_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "wandb", "key": "api-key"}


def test_should_reject_hf_token_as_a_plain_value_when_put_in_env() -> None:
    assert "env" in lint_failure("env[0].name=HF_TOKEN", "env[0].value=hf_abc")


def test_should_reject_a_token_value_under_secrets_when_given() -> None:
    assert "token" in lint_failure("secrets.hfToken.token=hf_abc")


# ----- schema -------------------------------------------------------------------------------------


def test_should_fail_lint_naming_the_key_when_a_key_is_misspelled() -> None:
    out = lint_failure("workerGroups.train.replcas=3")
    assert "replcas" in out and "/workerGroups/train" in out


def test_should_fail_install_naming_the_key_when_a_key_is_misspelled() -> None:
    out = run_helm(
        "template",
        "x",
        str(CHART),
        "--set",
        "storage.gcsfuse.bucketName=b",
        "--set",
        "tensorbord.enabled=true",
    )
    assert out.returncode != 0 and "tensorbord" in out.stderr


@pytest.mark.parametrize(
    "bad", ["gpu.type=h100", "capacity.type=preemptible", "storage.type=nfs", "workerGroups.train.gpus=16"]
)
def test_should_fail_lint_when_an_enum_or_range_is_violated(bad: str) -> None:
    assert bad.split("=")[0].replace(".", "/") in lint_failure(bad)


# ----- helm test and NOTES ------------------------------------------------------------------------


def test_should_expect_every_worker_gpu_in_the_helm_test_pod_when_rendered() -> None:
    docs = render(
        "workerGroups.train.replicas=2",
        *gpu_group("generation"),
    )
    pod = one(docs, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["WANT_GPUS"] == "24"
    assert env["RAY_HEAD"] == "exp1-head-svc:6379"
    assert "ray status" in pod["spec"]["containers"][0]["args"][0]


def test_should_print_the_port_forward_and_submit_command_in_notes_when_installed() -> None:
    out = run_helm(
        "install", "gemma3-1b-math", str(CHART), "--dry-run=client", "-n", "exp",
        "--set", "storage.gcsfuse.bucketName=b", "--set", "experiment=gemma3-1b-math",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    notes = out.stdout.split("NOTES:", 1)[1]
    assert "kubectl port-forward -n exp svc/gemma3-1b-math-head-svc 8265:8265" in notes
    assert "make submit EXP=gemma3-1b-math NAMESPACE=exp" in notes
    assert "image us-docker.pkg.dev/my-project/kuberl/kuberl:0.1.0" in notes
    assert "KubeRay >= 1.6.0" in notes and "make preflight EXP=gemma3-1b-math NAMESPACE=exp" in notes


def test_should_replace_dots_in_the_cluster_name_when_the_release_has_them() -> None:
    rc = one(render(release="qwen2.5-coder"), "RayCluster")
    assert rc["metadata"]["name"] == "qwen2-5-coder"


def test_should_print_the_release_name_for_make_submit_when_several_values_files_could_run_the_experiment() -> (
    None
):
    out = run_helm("install", "qwen2-5-coder-7b-code-b200", str(CHART), "--dry-run=client", "-n", "exp",
                   "--set", "storage.gcsfuse.bucketName=b", "--set", "experiment=qwen2.5-coder-7b-code")  # fmt: skip
    notes = out.stdout.split("NOTES:", 1)[1]
    assert "make submit EXP=qwen2-5-coder-7b-code-b200 NAMESPACE=exp" in notes
    assert "make preflight EXP=qwen2-5-coder-7b-code-b200 NAMESPACE=exp" in notes
    assert "EXP=qwen2.5-coder-7b-code " not in notes


# ----- names --------------------------------------------------------------------------------------

MAX_NAME = 47  # KubeRay 1.6: MaxRayJobNameLength = MaxRayClusterNameLength (53) - 6


def test_should_keep_the_name_limit_in_one_place_when_the_chart_reads_it() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["annotations"]["kuberl.dev/max-name-length"] == str(MAX_NAME)
    assert "trunc 50" not in (CHART / "templates" / "_helpers.tpl").read_text()


@pytest.mark.parametrize("length", [46, 47, 48, 51, 53])
@pytest.mark.parametrize("job", [False, True], ids=["raycluster", "rayjob"])
def test_should_cut_the_cluster_name_to_kuberays_rayjob_limit_when_the_release_name_is_long(
    length, job
) -> None:
    release = ("r" * 44 + "-abcdefghij")[:length]
    docs = render(*(JOB if job else ()), release=release)
    kind = "RayJob" if job else "RayCluster"
    name = one(docs, kind)["metadata"]["name"]
    assert name == release[:MAX_NAME].rstrip("-") and len(name) <= MAX_NAME
    assert not schema_errors(one(docs, kind))
    if not job:
        env = {e["name"]: e.get("value") for e in one(docs, "Pod")["spec"]["containers"][0]["env"]}
        assert env["RAY_HEAD"] == f"{name}-head-svc:6379"


def test_should_drop_every_trailing_dash_when_the_cut_ends_in_dashes() -> None:
    name = one(render(release="r" * 44 + "---x"), "RayCluster")["metadata"]["name"]
    assert name == "r" * 44


# ----- Lustre PV and `helm uninstall` -------------------------------------------------------------


def test_should_let_helm_uninstall_delete_the_pv_but_never_the_data_when_storage_is_lustre() -> None:
    """The runbook says what the chart does: no resource-policy keep (a kept, Released PV would not bind
    the next install's claim); Retain, so deleting the PV object never touches the instance."""
    pv = one(render(*LUSTRE), "PersistentVolume")
    assert "helm.sh/resource-policy" not in (pv["metadata"].get("annotations") or {})
    assert pv["spec"]["persistentVolumeReclaimPolicy"] == "Retain"
    doc = (REPO / "docs" / "cluster.md").read_text()
    assert "the PV stays" not in doc and "kubectl delete pv" not in doc
    assert "deletes the PV object too" in doc


# ----- GPU containers -----------------------------------------------------------------------------


def _gpu_containers(docs: list[dict]) -> list[dict]:
    """Every container that asks for a GPU, in RayClusters and RayJobs alike."""
    specs = [d["spec"] for d in docs if d["kind"] == "RayCluster"]
    specs += [d["spec"]["rayClusterSpec"] for d in docs if d["kind"] == "RayJob"]
    templates = [s["headGroupSpec"]["template"] for s in specs]
    templates += [g["template"] for s in specs for g in s["workerGroupSpecs"]]
    return [
        c
        for t in templates
        for c in t["spec"]["containers"]
        if int(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0)) > 0
    ]


@pytest.mark.parametrize(
    "sets", [(), RDMA, ("job.enabled=true", "experiment=tiny")], ids=["plain", "rdma", "rayjob"]
)
def test_should_put_the_gke_driver_on_ld_library_path_of_every_gpu_container_when_rendered(sets) -> None:
    containers = _gpu_containers(render(*gpu_group("generation"), *sets))
    assert len(containers) == 2
    for c in containers:
        path = {e["name"]: e.get("value") for e in c["env"]}["LD_LIBRARY_PATH"].split(":")
        assert "/usr/local/nvidia/lib64" in path
        assert ("/usr/local/gib/lib64" in path) == bool(sets == RDMA)


def test_should_leave_ld_library_path_alone_when_a_container_has_no_gpu() -> None:
    docs = render()
    assert "LD_LIBRARY_PATH" not in env_of(head_template(docs))
    assert "LD_LIBRARY_PATH" not in env_of(
        groups(render("gpu.type=none", "workerGroups.train.gpus=0"))["train"]["template"]
    )


# ----- image --------------------------------------------------------------------------------------

DIGEST = "sha256:" + "ab" * 32


def _image(*sets: str) -> set[str]:
    docs = render(*sets)
    templates = [head_template(docs), groups(docs)["train"]["template"], {"spec": one(docs, "Pod")["spec"]}]
    return {t["spec"]["containers"][0]["image"] for t in templates}


def test_should_run_the_charts_app_version_when_image_tag_is_empty() -> None:
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert _image() == {f"us-docker.pkg.dev/my-project/kuberl/kuberl:{app_version}"}


@pytest.mark.parametrize(
    ("tag", "ref"),
    [
        ("0.2.0", ":0.2.0"),
        (f"@{DIGEST}", f"@{DIGEST}"),
        (DIGEST, f"@{DIGEST}"),
        (f"0.2.0@{DIGEST}", f":0.2.0@{DIGEST}"),
    ],
    ids=["tag", "digest", "bare-digest", "tag-and-digest"],
)
def test_should_pin_the_image_by_tag_or_digest_when_image_tag_is_given(tag: str, ref: str) -> None:
    assert _image(f"image.tag={tag}") == {f"us-docker.pkg.dev/my-project/kuberl/kuberl{ref}"}


def test_should_reject_a_malformed_digest_when_linting() -> None:
    assert "/image/tag" in lint_failure("image.tag=@sha256:123")


# ----- replicas -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("workerGroups.train.replicas=4", "workerGroups.train.maxReplicas=2"),
         "workerGroups.train.replicas (4) is above workerGroups.train.maxReplicas (2): raise maxReplicas or lower replicas"),
        (("workerGroups.train.replicas=1", "workerGroups.train.minReplicas=3"),
         "workerGroups.train.replicas (1) is below workerGroups.train.minReplicas (3): lower minReplicas or raise replicas"),
    ],
    ids=["above-max", "below-min"],
)  # fmt: skip
def test_should_fail_in_one_line_naming_the_keys_when_replicas_is_outside_min_and_max(sets, message) -> None:
    args = ["template", "x", str(CHART), "--set", "storage.gcsfuse.bucketName=b"]
    for s in sets:
        args += ["--set", s]
    out = run_helm(*args)
    assert out.returncode != 0 and message in out.stderr.splitlines()[0]  # helm adds only its --debug hint


# ----- storage options ----------------------------------------------------------------------------


def _volume(template: dict, name: str) -> dict:
    return next(v for v in template["spec"]["volumes"] if v["name"] == name)


def _options(volume: dict) -> dict[str, str]:
    """gcsfuse mountOptions as {option: value} (`metadata-cache:ttl-secs:0` -> {'metadata-cache:ttl-secs': '0'})."""
    items = volume["csi"]["volumeAttributes"]["mountOptions"].split(",")
    return dict(o.rsplit(":", 1) if ":" in o else (o.split("=", 1) + [""])[:2] for o in items)


def test_should_not_cache_metadata_and_bound_the_file_cache_when_mounting_the_read_write_bucket() -> None:
    docs = render()
    caches = {}
    for name, template in [("head", head_template(docs)), ("worker", groups(docs)["train"]["template"])]:
        shared = _volume(template, "shared")
        assert _options(shared)["metadata-cache:ttl-secs"] == "0"
        caches[name] = shared["csi"]["volumeAttributes"]["fileCacheCapacity"]
        assert "readOnly" not in shared["csi"]
        mount = next(m for m in template["spec"]["containers"][0]["volumeMounts"] if m["name"] == "shared")
        assert not mount.get("readOnly")
    # "0" disables the cache (gcs-fuse-csi-driver volume attributes): the head's boot disk stays free
    assert caches == {"head": "0", "worker": "200Gi"}
    assert "file-cache:max-size-mb:-1" not in json.dumps(docs)


LOCAL_SSD = "cloud.google.com/gke-ephemeral-storage-local-ssd"


def test_should_keep_the_worker_file_cache_on_local_ssd_and_none_on_the_head_when_storage_is_gcsfuse() -> (
    None
):
    docs = render("storage.models.enabled=true")
    worker, head = groups(docs)["train"]["template"], head_template(docs)
    assert worker["spec"]["nodeSelector"][LOCAL_SSD] == "true"
    assert LOCAL_SSD not in (head["spec"].get("nodeSelector") or {})
    assert _volume(worker, "models")["csi"]["volumeAttributes"]["fileCacheCapacity"] == "500Gi"
    assert _volume(head, "models")["csi"]["volumeAttributes"]["fileCacheCapacity"] == "0"


@pytest.mark.parametrize(
    "sets",
    [
        ("storage.gcsfuse.fileCache.worker=0",),
        ("storage.gcsfuse.cacheOnLocalSsd=false",),
        ("storage.type=emptyDir",),
    ],
    ids=["no-worker-cache", "opted-out", "not-gcsfuse"],
)
def test_should_not_ask_for_local_ssd_when_workers_keep_no_gcsfuse_file_cache(sets) -> None:
    assert LOCAL_SSD not in groups(render(*sets))["train"]["template"]["spec"]["nodeSelector"]


def test_should_give_the_head_the_cache_it_is_given_when_file_cache_head_is_set() -> None:
    docs = render("storage.gcsfuse.fileCache.head=20Gi")
    assert _volume(head_template(docs), "shared")["csi"]["volumeAttributes"]["fileCacheCapacity"] == "20Gi"
    assert LOCAL_SSD not in (head_template(docs)["spec"].get("nodeSelector") or {})


def test_should_name_the_per_role_keys_in_one_line_when_file_cache_capacity_is_set_for_every_pod() -> None:
    out = run_helm("template", "x", str(CHART), "--set", "storage.gcsfuse.bucketName=b",
                   "--set", "storage.gcsfuse.volumeAttributes.fileCacheCapacity=200Gi")  # fmt: skip
    assert out.returncode != 0
    assert (
        "storage.gcsfuse.volumeAttributes.fileCacheCapacity is not read: set storage.gcsfuse.fileCache.head "
        "and storage.gcsfuse.fileCache.worker (the head has no local SSD)"
    ) in out.stderr.splitlines()[0]


def test_should_reject_a_forever_metadata_cache_when_set_on_the_read_write_mount() -> None:
    out = lint_failure("storage.gcsfuse.mountOptions=implicit-dirs\\,metadata-cache:ttl-secs:-1")
    assert "/storage/gcsfuse/mountOptions" in out


def test_should_mount_models_read_only_with_cached_metadata_when_models_enabled_on_gcsfuse() -> None:
    docs = render("storage.models.enabled=true")
    template = groups(docs)["train"]["template"]
    models = _volume(template, "models")
    assert models["csi"]["readOnly"] is True
    assert models["csi"]["volumeAttributes"]["bucketName"] == "test-bucket"
    options = _options(models)
    assert options["only-dir"] == "models" and options["metadata-cache:ttl-secs"] == "-1"
    assert models["csi"]["volumeAttributes"]["fileCacheCapacity"] == "500Gi"
    mounts = {m["name"]: m for m in template["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["models"] == {"name": "models", "mountPath": "/models", "readOnly": True}
    assert env_of(template)["KUBERL_MODELS_DIR"]["value"] == "/models"
    assert not [e for d in docs for e in schema_errors(d)]


def test_should_show_a_read_only_sub_path_of_the_claim_when_models_enabled_on_lustre() -> None:
    docs = render(*LUSTRE, "storage.models.enabled=true", "storage.lustre.mountOptions={flock}")
    template = head_template(docs)
    assert "models" not in {v["name"] for v in template["spec"]["volumes"]}
    views = [m for m in template["spec"]["containers"][0]["volumeMounts"] if m["name"] == "shared"]
    assert views == [
        {"name": "shared", "mountPath": "/data"},
        {"name": "shared", "mountPath": "/models", "subPath": "models", "readOnly": True},
    ]
    assert one(docs, "PersistentVolume")["spec"]["mountOptions"] == ["flock"]
    assert not [e for d in docs for e in schema_errors(d)]


# ----- RayJob -------------------------------------------------------------------------------------

JOB = ("job.enabled=true", "experiment=gemma3-1b-math")


def test_should_render_a_valid_rayjob_instead_of_the_raycluster_when_job_enabled() -> None:
    docs = render(*JOB)
    assert not [d for d in docs if d["kind"] in ("RayCluster", "Pod")]  # no cluster to `helm test`
    job = one(docs, "RayJob")
    assert not schema_errors(job)
    spec = job["spec"]
    assert (spec["backoffLimit"], spec["shutdownAfterJobFinishes"], spec["ttlSecondsAfterFinished"]) == (
        10,
        True,
        600,
    )
    assert spec["submissionMode"] == "K8sJobMode" and "activeDeadlineSeconds" not in spec
    assert job["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    # the same cluster as the RayCluster path renders, less the upgrade strategy KubeRay refuses there
    cluster = dict(one(render("experiment=gemma3-1b-math"), "RayCluster")["spec"])
    del cluster["upgradeStrategy"]
    assert spec["rayClusterSpec"] == cluster


def test_should_resume_the_experiment_on_shared_storage_when_the_rayjob_entrypoint_runs() -> None:
    spec = one(render(*JOB, "job.overrides={grpo.max_num_steps=500,policy.learning_rate=1e-6}"), "RayJob")[
        "spec"
    ]
    assert spec["entrypoint"] == (
        "exec python -m trainer experiment=gemma3-1b-math checkpointing.resume=auto logger.log_dir=/data/logs/exp/exp1 "
        "checkpointing.checkpoint_dir=/data/checkpoints/exp/exp1 'grpo.max_num_steps=500' 'policy.learning_rate=1e-6'"
    )


def test_should_set_retry_and_cleanup_from_values_when_job_keys_are_given() -> None:
    spec = one(render(*JOB, "job.backoffLimit=3", "job.ttlSecondsAfterFinished=60",
                      "job.activeDeadlineSeconds=86400"), "RayJob")["spec"]  # fmt: skip
    assert (spec["backoffLimit"], spec["shutdownAfterJobFinishes"]) == (3, True)
    assert (spec["ttlSecondsAfterFinished"], spec["activeDeadlineSeconds"]) == (60, 86400)


@pytest.mark.parametrize(
    "ttl", [(), ("job.ttlSecondsAfterFinished=600",), ("job.ttlSecondsAfterFinished=0",)]
)
def test_should_render_no_ttl_when_shutdown_after_job_finishes_is_false(ttl) -> None:
    """KubeRay 1.6 refuses shutdownAfterJobFinishes=false with ttlSecondsAfterFinished > 0 (validation.go):
    one --set must not yield a RayJob that never starts."""
    job = one(render(*JOB, "job.shutdownAfterJobFinishes=false", *ttl), "RayJob")
    assert job["spec"]["shutdownAfterJobFinishes"] is False
    assert "ttlSecondsAfterFinished" not in job["spec"]
    assert not schema_errors(job)


def test_should_say_the_cluster_stays_when_installed_with_shutdown_after_job_finishes_false() -> None:
    out = run_helm("install", "r", str(CHART), "--dry-run=client", "-n", "exp", "--set", "storage.gcsfuse.bucketName=b",
                   *(a for s in (*JOB, "job.shutdownAfterJobFinishes=false") for a in ("--set", s)))  # fmt: skip
    notes = out.stdout.split("NOTES:", 1)[1]
    assert "The cluster stays up after the job ends" in notes and "deleted 600s after" not in notes


# ----- upgrades -----------------------------------------------------------------------------------


def test_should_recreate_pods_on_upgrade_in_the_raycluster_and_not_in_a_rayjob_when_rendered() -> None:
    """KubeRay 1.6 leaves running pods alone on a spec change without `upgradeStrategy: Recreate`, and
    refuses the field in a cluster a RayJob creates."""
    cluster = one(render(), "RayCluster")
    assert cluster["spec"]["upgradeStrategy"] == {"type": "Recreate"}
    assert not schema_errors(cluster)
    job = one(render(*JOB), "RayJob")
    assert "upgradeStrategy" not in job["spec"]["rayClusterSpec"] and "upgradeStrategy" not in job["spec"]
    assert not schema_errors(job)
    assert one(render("upgradeStrategy=None"), "RayCluster")["spec"]["upgradeStrategy"] == {"type": "None"}
    assert "/upgradeStrategy" in lint_failure("upgradeStrategy=RollingUpdate")


# ----- the RayJob's submitter ---------------------------------------------------------------------


def test_should_run_a_small_submitter_beside_the_head_with_its_pull_secrets_when_job_enabled() -> None:
    docs = render(*JOB, "imagePullSecrets[0].name=regcred", "head.nodeSelector.pool=cpu-head",
                  "head.tolerations[0].key=dedicated", "head.tolerations[0].operator=Exists",
                  "serviceAccount.name=rl-sa")  # fmt: skip
    job = one(docs, "RayJob")
    assert not schema_errors(job)
    assert job["spec"]["submitterConfig"] == {"backoffLimit": 100}  # KubeRay's default is 2
    pod = job["spec"]["submitterPodTemplate"]["spec"]
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # a Kubernetes Job's pod
    assert pod["imagePullSecrets"] == head["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["nodeSelector"] == head["nodeSelector"] == {"pool": "cpu-head"}
    assert pod["tolerations"] == head["tolerations"] == [{"key": "dedicated", "operator": "Exists"}]
    assert pod["serviceAccountName"] == head["serviceAccountName"] == "rl-sa"
    (container,) = pod["containers"]
    assert container["name"] == "ray-job-submitter" and container["image"] == head["containers"][0]["image"]
    assert "command" not in container  # KubeRay fills in `ray job submit ... ; ray job logs --follow`
    assert container["resources"] == {
        "requests": {"cpu": "200m", "memory": "512Mi"},
        "limits": {"cpu": "1", "memory": "1Gi"},  # a CPU limit: a log follower never needs more
    }


def test_should_take_the_submitters_retries_and_resources_from_values_when_given() -> None:
    spec = one(
        render(*JOB, "job.submitter.backoffLimit=7", "job.submitter.resources.requests.cpu=1"), "RayJob"
    )["spec"]
    assert spec["submitterConfig"]["backoffLimit"] == 7
    assert spec["submitterPodTemplate"]["spec"]["containers"][0]["resources"]["requests"]["cpu"] == 1


def test_should_fail_naming_the_key_when_a_rayjob_has_no_experiment() -> None:
    out = run_helm(
        "template", "x", str(CHART), "--set", "storage.gcsfuse.bucketName=b", "--set", "job.enabled=true"
    )
    assert out.returncode != 0 and "experiment is required when job.enabled" in out.stderr


def test_should_reject_the_experiment_as_an_override_when_linting() -> None:
    assert "/job/overrides/0" in lint_failure(
        "job.enabled=true", "experiment=tiny", "job.overrides={experiment=tiny}"
    )


def test_should_print_how_to_follow_the_rayjob_when_installed_with_job_enabled() -> None:
    out = run_helm("install", "gemma3-1b-math", str(CHART), "--dry-run=client", "-n", "exp",
                   "--set", "storage.gcsfuse.bucketName=b", "--set", "experiment=gemma3-1b-math",
                   "--set", "job.enabled=true")  # fmt: skip
    assert out.returncode == 0, out.stderr
    notes = out.stdout.split("NOTES:", 1)[1]
    assert "kubectl get rayjob gemma3-1b-math -n exp -w" in notes
    assert "\n  python -m trainer experiment=gemma3-1b-math checkpointing.resume=auto" in notes
    assert "make submit" not in notes and "helm test" not in notes


@pytest.mark.parametrize(("wait", "pull"), [(900, 900), (300, 1200)])
def test_should_give_helm_test_the_heads_cold_pull_on_top_of_the_wait_when_notes_print_its_timeout(
    wait, pull
) -> None:
    out = run_helm("install", "r", str(CHART), "--dry-run=client", "-n", "exp", "--set", "storage.gcsfuse.bucketName=b",
                   "--set", f"tests.timeoutSeconds={wait}", "--set", f"tests.imagePullSeconds={pull}")  # fmt: skip
    notes = out.stdout.split("NOTES:", 1)[1]
    timeout = int(notes.split("helm test r -n exp --timeout ", 1)[1].split("s", 1)[0])
    assert timeout == wait + pull


def test_should_run_the_helm_test_pod_on_the_heads_node_when_rendered() -> None:
    """The head pulled the image there already, so the test pod pulls nothing before its wait starts."""
    docs = render("head.nodeSelector.pool=cpu-head", release="rl-exp")
    pod = one(docs, "Pod")
    (term,) = pod["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["labelSelector"]["matchLabels"] == {"ray.io/cluster": "rl-exp", "ray.io/node-type": "head"}
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert pod["spec"]["nodeSelector"] == {"pool": "cpu-head"}
    assert one(docs, "RayCluster")["metadata"]["name"] == "rl-exp"  # KubeRay's ray.io/cluster label value
    assert not schema_errors(pod)
