"""The reward model server (rewardServer.enabled): `vllm serve <model> --runner pooling` as a group of its own,
a Deployment and a ClusterIP Service of the release's, which the trainer's `reward_server` reward calls. Its key
comes from a Secret (the chart's, random once and read back on upgrade, or an existing one) as VLLM_API_KEY in
the server and REWARD_SERVER_API_KEY in the Ray pods, never a literal; the RayJob's entrypoint gets
reward_server.url and .model; its NetworkPolicy admits the release's Ray pods alone, whatever
networkPolicy.enabled says, because vLLM checks the key on /v1 and /v2 routes only. Rendered by a real `helm`
binary and checked against the strict Kubernetes schemas; the rendered command is parsed by vLLM's own
`vllm serve` parser, and vLLM's own middleware shows which routes the key guards."""

from __future__ import annotations

import base64

import pytest
import yaml
from chartlib import (
    CHART,
    deployment,
    env_of,
    gpu_group,
    lint_failure,
    one,
    pod_labels,
    render,
    run_helm,
    schema_errors,
    selects,
)

RS = (
    "rewardServer.enabled=true",
    "rewardServer.model=/data/models/skywork-rm",
    "rewardServer.servedModelName=rm",
)
HUB = ("rewardServer.enabled=true", "rewardServer.model=Skywork/Skywork-Reward-V2-Qwen3-0.6B")
JOB = ("job.enabled=true", "experiment=tiny")
LUSTRE = ("storage.type=lustre", "storage.lustre.volumeHandle=p/us-central1-b/i", "storage.lustre.ip=10.90.1.4",
          "storage.lustre.filesystem=fs")  # fmt: skip
URL = "http://exp1-reward-server.exp.svc:8000"


def _valid(docs: list[dict]) -> list[dict]:
    errors = [e for d in docs for e in schema_errors(d)]
    assert not errors, "\n".join(errors)
    return docs


def _cluster_spec(docs: list[dict]) -> dict:
    job = [d for d in docs if d["kind"] == "RayJob"]
    return job[0]["spec"]["rayClusterSpec"] if job else one(docs, "RayCluster")["spec"]


def _ray_templates(docs: list[dict]) -> dict[str, dict]:
    spec = _cluster_spec(docs)
    found = {"head": spec["headGroupSpec"]["template"]}
    found.update({g["groupName"]: g["template"] for g in spec["workerGroupSpecs"]})
    return found


def _server(docs: list[dict]) -> dict:
    """The server's pod spec."""
    return deployment(docs, "reward-server")["spec"]["template"]["spec"]


def _named(docs: list[dict], kind: str, name: str) -> dict:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def _policies(docs: list[dict]) -> dict[str, dict]:
    return {p["metadata"]["name"]: p["spec"] for p in docs if p["kind"] == "NetworkPolicy"}


def _template_failure(*sets: str) -> str:
    args = ["template", "exp1", str(CHART), "--set", "storage.gcsfuse.bucketName=b"]
    for s in sets:
        args += ["--set", s]
    out = run_helm(*args)
    assert out.returncode != 0, f"rendered with {sets}"
    return out.stderr


def _entrypoint(docs: list[dict]) -> list[str]:
    return one(docs, "RayJob")["spec"]["entrypoint"].split()


# ----- disabled -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sets", [(), JOB, ("sandbox.enabled=true",)], ids=["raycluster", "rayjob", "sandbox"]
)
def test_should_render_nothing_of_the_server_when_disabled(sets) -> None:
    docs = _valid(render(*sets))
    assert not [d for d in docs if "reward-server" in d["metadata"]["name"]]
    for name, template in _ray_templates(docs).items():
        assert not [e for e in env_of(template) if "REWARD_SERVER" in e], name
    if sets == JOB:
        assert not [a for a in _entrypoint(docs) if "reward_server" in a]
    main = _policies(docs)["exp1"]
    sandbox = [{"key": "kuberl.dev/role", "operator": "NotIn", "values": ["sandbox"]}]
    expected = sandbox if "sandbox.enabled=true" in sets else None
    assert main["podSelector"].get("matchExpressions") == expected


# ----- the server ---------------------------------------------------------------------------------


@pytest.mark.parametrize("sets", [(), JOB], ids=["raycluster", "rayjob"])
def test_should_run_vllm_serve_with_the_pooling_runner_behind_a_cluster_ip_service_when_enabled(sets) -> None:
    docs = _valid(render(*RS, *sets))
    pod = _server(docs)
    (c,) = pod["containers"]
    # the job image, under its tini, as the Ray pods run it
    assert c["image"] == _ray_templates(docs)["head"]["spec"]["containers"][0]["image"] and c["command"] == [
        "/usr/bin/tini",
        "--",
        "vllm",
        "serve",
    ]
    assert c["args"] == ["/data/models/skywork-rm", "--runner", "pooling", "--served-model-name", "rm",
                         "--host", "$(POD_IP)", "--port", "8000",
                         "--middleware", "trainer.rewards.reward_server.RequireToken"]  # fmt: skip
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    service = _named(docs, "Service", "exp1-reward-server")
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}
    ]
    labels = deployment(docs, "reward-server")["spec"]["template"]["metadata"]["labels"]
    assert selects({"matchLabels": service["spec"]["selector"]}, labels)
    # the Service selects the server's pods and no other pod of the release
    others = {
        r for r, pod in pod_labels(docs).items() if selects({"matchLabels": service["spec"]["selector"]}, pod)
    }
    assert others == {"reward-server"}


def test_should_check_health_without_the_key_and_wait_for_the_model_to_load_when_probing() -> None:
    (c,) = _server(_valid(render(*RS, "rewardServer.startupSeconds=600")))["containers"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    # the liveness probe waits until the model is loaded: 600 s of startup before a restart
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] == 600


def test_should_run_as_non_root_with_nothing_it_does_not_need_when_enabled() -> None:
    pod = _server(_valid(render(*RS, "sandbox.enabled=true", "auth.existingSecret=ray-token")))
    (c,) = pod["containers"]
    assert pod["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}, "runAsNonRoot": True,
                                      "runAsUser": 1000, "runAsGroup": 1000}  # fmt: skip
    assert "fsGroup" not in pod["securityContext"]  # no recursive chown of a Lustre file system
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                                    "readOnlyRootFilesystem": True}  # fmt: skip
    assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
    assert not pod.get("hostNetwork") and not [v for v in pod["volumes"] if "hostPath" in v]
    # no Ray token, no sandbox token, no Ray environment: only its own key
    secrets = [
        e["valueFrom"]["secretKeyRef"]["name"] for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})
    ]
    assert secrets == ["exp1-reward-server"]
    assert not [e for e in c["env"] if e["name"].startswith(("RAY_", "KUBERL_"))]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["HOME"] == "/tmp" and env["USER"]  # torch's compile cache asks for a user name
    assert {"name": "cache", "mountPath": "/tmp"} in c["volumeMounts"]


def test_should_hold_its_gpus_on_the_presets_pool_as_a_worker_group_does_when_enabled() -> None:
    docs = _valid(render(*RS, "rewardServer.gpus=2", "rewardServer.extraArgs={--tensor-parallel-size,2}",
                         "rewardServer.nodeSelector.pool=rm", "sandbox.enabled=true", "capacity.type=spot"))  # fmt: skip
    pod, train = _server(docs), _ray_templates(docs)["train"]["spec"]
    resources = pod["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 2 and resources["requests"]["nvidia.com/gpu"] == 2
    assert resources["limits"]["memory"] == resources["requests"]["memory"] == "64Gi"  # bounds /dev/shm
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-b200", "cloud.google.com/gke-spot": "true",
                                   "node.kubernetes.io/instance-type": "a4-highgpu-8g", "pool": "rm"}  # fmt: skip
    assert pod["tolerations"] == train["tolerations"]
    assert (
        pod["affinity"]["podAntiAffinity"] == train["affinity"]["podAntiAffinity"]
    )  # off the sandbox's nodes
    assert pod["containers"][0]["args"][-2:] == ["--tensor-parallel-size", "2"]
    # on-demand: off spot and flex-start nodes, as the GPU workers
    on_demand = _server(render(*RS))
    assert (
        on_demand["affinity"]["nodeAffinity"]
        == _ray_templates(render(*RS))["train"]["spec"]["affinity"]["nodeAffinity"]
    )


# ----- the key ------------------------------------------------------------------------------------


@pytest.mark.parametrize("sets", [(), JOB], ids=["raycluster", "rayjob"])
def test_should_give_the_server_and_every_ray_container_the_key_from_one_secret_and_never_a_literal(
    sets,
) -> None:
    docs = _valid(render(*RS, *sets))
    secret = _named(docs, "Secret", "exp1-reward-server")
    assert secret["metadata"]["labels"]["app.kubernetes.io/component"] == "reward-server"
    key = base64.b64decode(secret["data"]["token"]).decode()
    assert len(key) >= 32 and key.isalnum()
    ref = {"name": "exp1-reward-server", "key": "token"}
    (c,) = _server(docs)["containers"]
    assert {e["name"]: e for e in c["env"]}["VLLM_API_KEY"]["valueFrom"] == {"secretKeyRef": ref}
    assert not [a for a in c["args"] if a.startswith("--api-key")]
    for name, template in _ray_templates(docs).items():
        env = env_of(template)
        assert env["REWARD_SERVER_API_KEY"]["valueFrom"] == {"secretKeyRef": ref}, name
        assert (
            env["KUBERL_REWARD_SERVER_URL"]["value"] == URL
            and env["KUBERL_REWARD_SERVER_MODEL"]["value"] == "rm"
        )
    # the key is in the Secret and nowhere else: not in an argument, an env value or the entrypoint
    text = yaml.safe_dump_all([d for d in docs if d["kind"] != "Secret"])
    assert key not in text and secret["data"]["token"] not in text
    # the submitter and the `helm test` pods never call it
    others = [d["spec"]["submitterPodTemplate"]["spec"] for d in docs if d["kind"] == "RayJob"]
    others += [d["spec"] for d in docs if d["kind"] == "Pod"]
    assert others and not [e for p in others for c in p["containers"] for e in c.get("env", [])
                           if e["name"] == "REWARD_SERVER_API_KEY"]  # fmt: skip


def test_should_draw_a_random_key_and_read_it_back_on_upgrade_like_the_releases_other_tokens() -> None:
    """`helm upgrade` reads the live Secret back (kuberl.generatedToken's lookup), so the key that running pods
    read never changes; `helm template` sees no cluster and draws one per render."""
    first = _named(render(*RS), "Secret", "exp1-reward-server")["data"]["token"]
    other = _named(render(*RS, release="exp2"), "Secret", "exp2-reward-server")["data"]["token"]
    assert first != other  # random, not derived from the values
    source = (CHART / "templates" / "secret.yaml").read_text()
    assert '(dict "name" (include "kuberl.rewardServerSecret" .) "component" "reward-server")' in source
    assert 'token: {{ include "kuberl.generatedToken" (dict "root" $ "name" .name) }}' in source


def test_should_use_the_named_secret_and_render_the_same_twice_when_existing_secret_is_set() -> None:
    docs = _valid(render(*RS, *JOB, "rewardServer.existingSecret=team-rm-key"))
    assert not [d for d in docs if d["kind"] == "Secret"]
    ref = {"secretKeyRef": {"name": "team-rm-key", "key": "token"}}
    (c,) = _server(docs)["containers"]
    assert {e["name"]: e for e in c["env"]}["VLLM_API_KEY"]["valueFrom"] == ref
    assert all(env_of(t)["REWARD_SERVER_API_KEY"]["valueFrom"] == ref for t in _ray_templates(docs).values())
    args = ["template", "exp1", str(CHART), "--namespace", "exp", "--set", "storage.gcsfuse.bucketName=b"]
    for s in (*RS, *JOB, "rewardServer.existingSecret=team-rm-key"):
        args += ["--set", s]
    first, second = run_helm(*args), run_helm(*args)
    assert first.returncode == 0 and first.stdout == second.stdout  # GitOps: byte-identical


# ----- the trainer's overrides --------------------------------------------------------------------


def test_should_point_the_rayjobs_reward_server_url_and_model_at_the_service_when_enabled() -> None:
    entry = _entrypoint(_valid(render(*RS, *JOB, "job.overrides={grpo.max_num_steps=5}")))
    assert f"reward_server.url={URL}" in entry and "'reward_server.model=rm'" in entry
    assert entry.index(f"reward_server.url={URL}") < entry.index("'grpo.max_num_steps=5'")  # the user's last
    # no served name: the model's own
    assert "'reward_server.model=/data/models/skywork-rm'" in _entrypoint(render(*RS[:2], *JOB))


@pytest.mark.parametrize("given", ["reward_server.url=http://rm.elsewhere:9000", "+reward_server.url=http://x:1",
                                   "~reward_server.model", "reward_server.model=mine"])  # fmt: skip
def test_should_leave_a_key_to_the_user_when_job_overrides_set_it(given) -> None:
    """Hydra refuses a key given twice: the user's override stands alone."""
    entry = _entrypoint(render(*RS, *JOB, f"job.overrides={{{given}}}"))
    key = given.lstrip("+~").split("=")[0]
    assert [a for a in entry if key in a] == [f"'{given}'"]
    other = "reward_server.model" if key == "reward_server.url" else "reward_server.url"
    assert len([a for a in entry if other in a]) == 1


def test_should_parse_its_overrides_with_hydras_own_parser_when_rendered() -> None:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    entry = _entrypoint(render(*HUB, *JOB))
    ours = [a.strip("'") for a in entry if "reward_server" in a]
    parsed = {o.key_or_group: o.value() for o in OverridesParser.create().parse_overrides(ours)}
    assert parsed == {"reward_server.url": URL, "reward_server.model": "Skywork/Skywork-Reward-V2-Qwen3-0.6B"}


# ----- the network policy -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sets", [(), JOB, ("networkPolicy.enabled=false",)], ids=["raycluster", "rayjob", "nopolicy"]
)
def test_should_admit_only_the_ray_pods_on_its_port_when_enabled(sets) -> None:
    docs = _valid(render(*RS, "sandbox.enabled=true", "rewardServer.port=8123", *gpu_group("gen"), *sets))
    policies, labels = _policies(docs), pod_labels(docs)
    own = policies["exp1-reward-server"]  # whatever networkPolicy.enabled says
    assert {r for r, pod in labels.items() if selects(own["podSelector"], pod)} == {"reward-server"}
    assert set(own["policyTypes"]) == {"Ingress", "Egress"}
    (rule,) = own["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8123}] and len(rule["from"]) == 1
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}  # this namespace, no ipBlock
    callers = {r for r, pod in labels.items() if selects(peer["podSelector"], pod)}
    assert callers == {"head", "train", "gen"}  # not the sandbox, the submitter, the test pods or itself
    if "exp1" in policies:  # the release's policy neither selects nor admits the server
        main = policies["exp1"]
        assert not selects(main["podSelector"], labels["reward-server"])
        assert not selects(main["podSelector"], labels["sandbox"])
        for peer in [p for r in main["ingress"] for p in r.get("from", []) if "namespaceSelector" not in p]:
            assert not selects(peer["podSelector"], labels["reward-server"])
            assert selects(peer["podSelector"], labels["head"])
        # and the Ray pods may call it
        assert selects(main["egress"][0]["to"][0]["podSelector"], labels["reward-server"])


def _egress(*sets: str) -> list[dict]:
    return _policies(_valid(render(*sets)))["exp1-reward-server"]["egress"]


DNS = {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}
HTTPS = {"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}], "ports": [{"protocol": "TCP", "port": 443}]}


def test_should_let_out_only_dns_and_what_its_model_needs_when_enabled() -> None:
    on_lustre = _egress(*RS, *LUSTRE)
    assert on_lustre == [DNS]  # Lustre's client mounts in the node's network namespace
    on_bucket = _egress(*RS)  # gcsfuse's sidecar reads the bucket with Workload Identity
    cidrs = [t["ipBlock"]["cidr"] for r in on_bucket for t in r.get("to", [])]
    assert on_bucket[0] == DNS and on_bucket[-1] == HTTPS and "169.254.169.254/32" in cidrs
    on_hub = _egress(*HUB, *LUSTRE)  # a Hub download: HTTPS, no identity
    assert on_hub == [DNS, HTTPS]
    narrowed = _egress(*HUB, *LUSTRE, "networkPolicy.egress.httpsCidrs={199.36.153.8/30}")
    assert narrowed[-1]["to"] == [{"ipBlock": {"cidr": "199.36.153.8/30"}}]


def test_should_keep_the_server_out_of_the_ray_pods_disruption_budget_when_enabled() -> None:
    docs = render(*RS)
    pdb = one(docs, "PodDisruptionBudget")["spec"]
    assert not selects(pdb["selector"], pod_labels(docs)["reward-server"]) and pdb["minAvailable"] == 2


# ----- the model ----------------------------------------------------------------------------------


def test_should_mount_the_model_read_only_with_no_file_cache_and_stay_offline_when_it_is_on_storage() -> None:
    docs = _valid(render(*RS[:1], "rewardServer.model=/models/rm", "storage.models.enabled=true"))
    pod = _server(docs)
    (c,) = pod["containers"]
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/data"]["readOnly"] is True and mounts["/models"]["readOnly"] is True
    csi = [v["csi"]["volumeAttributes"] for v in pod["volumes"] if "csi" in v]
    assert len(csi) == 2 and all(a["fileCacheCapacity"] == "0" for a in csi)  # the weights are read once
    # the workers keep theirs, on local SSD; the server needs none
    assert "cloud.google.com/gke-ephemeral-storage-local-ssd" not in pod["nodeSelector"]
    assert (
        deployment(docs, "reward-server")["spec"]["template"]["metadata"]["annotations"][
            "gke-gcsfuse/volumes"
        ]
        == "true"
    )
    env = {e["name"]: e for e in c["env"]}
    assert env["HF_HUB_OFFLINE"]["value"] == "1" and "HF_TOKEN" not in env


def test_should_download_a_hub_model_into_its_own_cache_with_the_hf_token_when_given_an_id() -> None:
    docs = _valid(render(*HUB, "rewardServer.cacheSize=40Gi"))
    pod = _server(docs)
    (c,) = pod["containers"]
    assert c["args"][:5] == ["Skywork/Skywork-Reward-V2-Qwen3-0.6B", "--runner", "pooling", "--served-model-name",
                             "Skywork/Skywork-Reward-V2-Qwen3-0.6B"]  # fmt: skip
    assert {v["name"] for v in pod["volumes"]} == {"dshm", "cache"}  # no shared storage at all
    assert [v["emptyDir"]["sizeLimit"] for v in pod["volumes"] if v["name"] == "cache"] == ["40Gi"]
    env = {e["name"]: e for e in c["env"]}
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    assert env["HF_HOME"]["value"].startswith("/tmp/") and "HF_HUB_OFFLINE" not in env
    assert "annotations" not in deployment(docs, "reward-server")["spec"]["template"]["metadata"]


def test_should_run_another_image_with_its_own_vllm_when_one_is_given() -> None:
    (c,) = _server(render(*HUB, "rewardServer.image=vllm/vllm-openai:v0.11.0"))["containers"]
    assert c["image"] == "vllm/vllm-openai:v0.11.0" and c["command"] == ["vllm", "serve"]


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("rewardServer.model=/etc/rm",), "rewardServer.model /etc/rm is not on the release's shared storage: "
                                          "give a directory under /data, or a Hugging Face Hub id"),
        (("rewardServer.model=/models/rm",), "give a directory under /data, or"),  # models view off
        (("rewardServer.extraArgs={--port=9000}",), "rewardServer.extraArgs sets --port, which the chart sets itself"),
        (("rewardServer.extraArgs={--api-key,k}",), "rewardServer.extraArgs sets --api-key, which the chart sets"),
        (("rewardServer.gpus=4",), "rewardServer.gpus is 4 but rewardServer.extraArgs sets no --tensor-parallel-size"),
    ],
    ids=["outside-storage", "models-view-off", "chart-flag", "key-in-args", "gpus-unused"],
)  # fmt: skip
def test_should_refuse_in_one_line_naming_the_key_when_the_server_would_not_work(sets, message) -> None:
    err = _template_failure(*HUB, *sets)
    assert message in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("rewardServer.model=", "minLength"),
        ("rewardServer.model=a b", "does not match pattern"),
        ("rewardServer.model=a\\,b", "does not match pattern"),  # a Hydra sweep
        ("rewardServer.runAsUser=0", "minimum: got 0, want 1"),
        ("rewardServer.resources.requests.memory=null", "missing property 'memory'"),
        ("rewardServer.apiKey=k", "additional properties 'apiKey' not allowed"),
    ],
    ids=["no-model", "space", "comma", "root", "no-memory", "unknown-key"],
)
def test_should_refuse_in_lint_naming_the_key_when_the_schema_rejects_a_value(bad, message) -> None:
    out = lint_failure("rewardServer.enabled=true", "rewardServer.model=a/b", bad)
    assert message in out, out


# ----- against vLLM itself ------------------------------------------------------------------------


def _vllm_serve_args(container: dict):
    """The rendered `vllm serve` command line as vLLM's own parser reads it (the pod's address for $(POD_IP))."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    assert container["command"][-2:] == ["vllm", "serve"]
    parser = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    return parser.parse_args(["serve", *(a.replace("$(POD_IP)", "10.0.0.7") for a in container["args"])])


@pytest.mark.integration  # imports vLLM (seconds of CPU)
@pytest.mark.vllm
def test_should_pass_vllms_own_serve_parser_with_the_pooling_runner_and_no_key_in_argv_when_rendered() -> (
    None
):
    pytest.importorskip("vllm")
    sets = ("rewardServer.gpus=2", "rewardServer.extraArgs={-tp,2,--dtype,bfloat16}")
    args = _vllm_serve_args(_server(render(*RS, *sets))["containers"][0])
    assert (args.model_tag, args.runner, args.served_model_name) == (
        "/data/models/skywork-rm",
        "pooling",
        ["rm"],
    )
    assert (args.host, args.port, args.tensor_parallel_size, args.dtype) == ("10.0.0.7", 8000, 2, "bfloat16")
    assert args.api_key is None  # vLLM takes it from VLLM_API_KEY, the Secret's


@pytest.mark.integration  # imports vLLM (seconds of CPU)
@pytest.mark.vllm
def test_should_ask_for_the_key_on_every_route_but_health_when_served_from_the_rendered_command(
    monkeypatch,
) -> None:
    """vLLM's own middleware set-up, from the rendered command line with the key in VLLM_API_KEY (as the chart
    gives it): its --api-key guards /v1 alone, and the trainer's middleware (--middleware, on the job image) every
    route but /health; the NetworkPolicy, rendered whatever networkPolicy.enabled says, admits only the release's
    Ray pods besides."""
    pytest.importorskip("vllm")
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    key = "k" * 48
    monkeypatch.setenv("VLLM_API_KEY", key)
    from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware

    app = FastAPI()
    for path in ("/v1/score", "/pooling", "/classify", "/score", "/metrics", "/health"):
        app.add_api_route(path, lambda: {"ok": True}, methods=["GET"])
    init_entrypoints_middleware(_vllm_serve_args(_server(render(*RS))["containers"][0]), app, ("classify",))
    client = TestClient(app)
    assert client.get("/v1/score").status_code == 401
    assert client.get("/v1/score", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/v1/score", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    guarded = ("/pooling", "/classify", "/score", "/metrics")
    assert [client.get(p).status_code for p in (*guarded, "/health")] == [401] * 4 + [200]
    assert [client.get(p, headers={"Authorization": f"Bearer {key}"}).status_code for p in guarded] == [
        200
    ] * 4
