"""The submission path: `python -m trainer.tools.submit` and the make targets around it.

Fast tests cover the entrypoint, EXP resolution and the one-line errors people see. The slow test
starts a real local Ray cluster with `make up`, runs `make submit EXP=tiny` against it through the
Ray Jobs API, checks what the trainer wrote, runs the chart's `helm test` check against the same
cluster, and stops it with `make down`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.cli import no_cluster_env, run_main
from trainer.ports import free_port
from trainer.tools import submit

REPO = Path(__file__).resolve().parents[1]


def _cli(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """A process of its own, for what Ray's client reads once per process: the auth mode and the token."""
    return subprocess.run(
        [sys.executable, "-m", "trainer.tools.submit", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=timeout,
    )


def _main(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """``_cli`` without the new interpreter: the command is the point, not the process (tests.cli)."""
    return run_main(submit.main, args, env)


def _one_line_error(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kuberl: "), out.stderr
    return lines[0]


def _free_port() -> int:
    return free_port("127.0.0.1")  # outside the ephemeral range (trainer.ports)


# ----- entrypoint and EXP -------------------------------------------------------------------------


def test_should_write_where_the_cluster_says_when_no_dir_is_overridden() -> None:
    command = submit.entrypoint("tiny", ["grpo.max_num_steps=2"])
    # exec: the driver is the process Ray signals at a stop, never a child the shell forks later
    assert command.startswith("exec python -m trainer experiment=tiny ")
    # Ray runs the entrypoint with a shell on the head: check the expansion with a real one.
    argv = command.replace("python -m trainer", "printf '%s\\n'")
    out = subprocess.run(
        ["sh", "-c", argv], capture_output=True, text=True, env={"KUBERL_LOG_DIR": "/data/logs"}
    )
    assert out.stdout.split() == ["experiment=tiny", "logger.log_dir=/data/logs", "grpo.max_num_steps=2"]
    served = {"KUBERL_REWARD_SERVER_URL": "http://rel-reward-server:8000", "KUBERL_REWARD_SERVER_MODEL": "rm"}
    out = subprocess.run(["sh", "-c", argv], capture_output=True, text=True, env=served)
    assert out.stdout.split() == [
        "experiment=tiny",
        "reward_server.url=http://rel-reward-server:8000",
        "reward_server.model=rm",
        "grpo.max_num_steps=2",
    ]  # the release's reward server, as the chart's RayJob command passes it


def test_should_keep_the_users_directory_when_log_dir_is_overridden() -> None:
    command = submit.entrypoint("tiny", ["logger.log_dir=/tmp/my logs"])
    assert "KUBERL_LOG_DIR" not in command and "KUBERL_CHECKPOINT_DIR" in command
    assert "'logger.log_dir=/tmp/my logs'" in command


def test_should_map_an_experiment_to_its_release_and_values_file_when_resolving() -> None:
    release = submit.resolve("gemma3-27b-gsm8k")
    assert (release.name, release.values.name, release.experiment) == (
        "gemma3-27b-gsm8k-h200",
        "gemma3-27b-gsm8k-h200.yaml",
        "gemma3-27b-gsm8k",
    )
    by_file = submit.resolve("qwen2.5-coder-7b-code-b200")
    assert (by_file.name, by_file.experiment) == ("qwen2-5-coder-7b-code-b200", "qwen2.5-coder-7b-code")
    assert submit.resolve("tiny").values is None


@pytest.mark.parametrize("exp", ["gemma3-1b-math-b200", "gemma3-1b-math", "gemma3-1b"])
def test_should_find_the_same_release_when_install_and_submit_name_it_differently(exp: str) -> None:
    release = submit.resolve(exp, need_values=True)
    assert (release.name, release.values.name, release.experiment) == (
        "gemma3-1b-math-b200",
        "gemma3-1b-math-b200.yaml",
        "gemma3-1b-math",
    )


def test_should_resolve_the_one_experiment_a_prefix_starts_when_exp_is_typed_short() -> None:
    release = submit.resolve("gemma3-27b")
    assert (release.experiment, release.values.name) == ("gemma3-27b-gsm8k", "gemma3-27b-gsm8k-h200.yaml")


def test_should_list_the_candidates_in_one_line_when_a_prefix_is_ambiguous(tmp_path: Path) -> None:
    line = _one_line_error(_main(no_cluster_env(tmp_path), "resolve", "gemma3"))
    assert "EXP=gemma3 matches several experiments (gemma3-1b-math, gemma3-27b-gsm8k)" in line


def test_should_name_an_existing_experiment_in_every_values_file_when_resolved() -> None:
    for path in sorted((REPO / "values").glob("*.yaml")):
        experiment = yaml.safe_load(path.read_text())["experiment"]
        assert submit.check_experiment(experiment) == experiment


def test_should_resolve_the_release_name_notes_print_when_its_values_file_has_dots() -> None:
    release = submit.resolve("qwen2-5-coder-7b-code-b200")
    assert (release.name, release.values.name, release.experiment) == (
        "qwen2-5-coder-7b-code-b200",
        "qwen2.5-coder-7b-code-b200.yaml",
        "qwen2.5-coder-7b-code",
    )


def test_should_pick_one_values_file_by_release_name_when_two_run_the_same_experiment(
    tmp_path, monkeypatch
) -> None:
    for stem in ("gemma3-1b-math-b200", "gemma3-1b-math-h200"):
        (tmp_path / f"{stem}.yaml").write_text("experiment: gemma3-1b-math\n")
    monkeypatch.setattr(submit, "VALUES", tmp_path)
    with pytest.raises(submit.SubmitError, match="several values files run gemma3-1b-math"):
        submit.resolve("gemma3-1b-math")
    release = submit.resolve("gemma3-1b-math-h200")  # what NOTES print: the release name
    assert (release.name, release.values.name, release.experiment) == (
        "gemma3-1b-math-h200", "gemma3-1b-math-h200.yaml", "gemma3-1b-math"
    )  # fmt: skip


def test_should_read_the_one_name_limit_from_the_chart_when_naming_releases() -> None:
    chart = yaml.safe_load((REPO / "charts" / "kuberl" / "Chart.yaml").read_text())
    assert submit.max_name_length() == int(chart["annotations"]["kuberl.dev/max-name-length"]) == 47


@pytest.mark.parametrize(
    "raw",
    ["e" * 46, "e" * 47, "e" * 48, "e" * 46 + ".y", "e" * 46 + ".y2z3", "e" * 45 + "-q1.2", "e" * 53],
    ids=lambda raw: f"{len(raw)}-chars",
)
def test_should_name_the_same_cluster_as_the_chart_when_the_name_is_at_the_limit(raw: str) -> None:
    """`make submit` port-forwards `<release>-head-svc`: the release `make install` gives helm, and the
    RayCluster the chart names from it (even when helm gets the long name itself), must agree."""
    helm = REPO / "bin" / "helm"
    if not helm.exists():
        pytest.skip("bin/helm is missing: run `make helm`")
    name = submit.release_name(raw)
    assert len(name) <= 47 and name == raw.replace(".", "-")[:47].rstrip("-")
    for helm_release in {name, raw.replace(".", "-")}:  # via make install, or helm install by hand
        out = subprocess.run([str(helm), "template", helm_release, str(REPO / "charts" / "kuberl"),
                              "--set", "storage.gcsfuse.bucketName=b", "--show-only", "templates/raycluster.yaml"],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert yaml.safe_load(out.stdout)["metadata"]["name"] == name


def test_should_drop_trailing_dashes_when_the_cut_lands_on_them() -> None:
    assert submit.release_name("r" * 46 + "-tail") == "r" * 46
    assert submit.release_name("r" * 44 + "---x") == "r" * 44


# ----- one-line errors ----------------------------------------------------------------------------


def test_should_list_the_experiments_when_exp_is_unknown(tmp_path: Path) -> None:
    line = _one_line_error(_main(no_cluster_env(tmp_path), "submit", "gemma4-1t"))
    assert "unknown experiment 'gemma4-1t'" in line and "tiny" in line


def test_should_say_how_to_get_a_cluster_when_none_is_reachable(tmp_path: Path) -> None:
    line = _one_line_error(_main(no_cluster_env(tmp_path), "submit", "tiny"))
    assert "make up" in line and "RAY_ADDRESS" in line


def test_should_name_the_address_when_ray_address_is_unreachable(tmp_path: Path) -> None:
    address = f"http://127.0.0.1:{_free_port()}"
    line = _one_line_error(
        _main(no_cluster_env(tmp_path, RAY_ADDRESS=address, RAY_AUTH_TOKEN="t" * 64), "status")
    )
    assert f"cannot reach the Ray Jobs API at {address}" in line


@pytest.mark.integration  # a Python interpreter of its own
def test_should_say_where_a_token_goes_when_token_auth_is_on_and_there_is_none(tmp_path: Path) -> None:
    env = no_cluster_env(
        tmp_path, RAY_ADDRESS="http://127.0.0.1:1", RAY_AUTH_MODE="token", HOME=str(tmp_path)
    )
    env.pop("RAY_AUTH_TOKEN", None)
    # A process of its own: one that has read a token before (a test that joined a Ray instance) keeps it.
    line = _one_line_error(_cli(env, "status"))
    assert "there is no Ray token here" in line and "RAY_AUTH_TOKEN" in line


def test_should_ask_for_a_job_id_when_logs_has_none(tmp_path: Path) -> None:
    assert "make logs JOB=" in _one_line_error(_main(no_cluster_env(tmp_path), "logs"))


def test_should_reject_an_override_without_a_value_when_submitting(tmp_path: Path) -> None:
    assert "not key=value" in _one_line_error(
        _main(no_cluster_env(tmp_path), "submit", "tiny", "grpo.max_num_steps")
    )


# A stand-in for kubectl (no Kubernetes API here): a context, namespace `team`, one installed
# RayCluster whose head reads HF_TOKEN from Secret hf-token, and no Secrets at all.
FAKE_KUBECTL = """#!/bin/bash
case "$*" in
  "config current-context") echo test-ctx ;;
  "config view --minify -o jsonpath={..namespace}") echo team ;;
  "get raycluster gemma3-1b-math-b200 -n team -o json") cat "$(dirname "$0")/raycluster.json" ;;
  "get raycluster "*) echo 'Error from server (NotFound): rayclusters.ray.io "x" not found' >&2; exit 1 ;;
  "get secret kuberay-made -n team -o jsonpath={.data.auth_token}") printf %s "$(printf 's3cret' | base64)" ;;
  "get secret "*) echo "Error from server (NotFound): secrets \\"$3\\" not found" >&2; exit 1 ;;
  *) echo "unexpected kubectl $*" >&2; exit 3 ;;
esac
"""


@pytest.fixture
def fake_kube(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubectl").write_text(FAKE_KUBECTL)
    (bin_dir / "kubectl").chmod(0o755)
    env = [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}]
    cluster = {
        "spec": {"headGroupSpec": {"template": {"spec": {"containers": [{"name": "ray-head", "env": env}]}}}}
    }
    (bin_dir / "raycluster.json").write_text(json.dumps(cluster))
    return no_cluster_env(tmp_path, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_should_say_how_to_create_the_secret_when_the_hf_token_secret_is_missing(fake_kube) -> None:
    line = _one_line_error(_main(fake_kube, "submit", "gemma3-1b-math"))
    assert "Secret hf-token (for HF_TOKEN) is missing in namespace team" in line
    assert "kubectl create secret generic hf-token -n team --from-literal=token=" in line


def test_should_name_the_token_secret_when_the_raycluster_uses_token_auth_and_the_secret_is_missing(
    fake_kube, tmp_path
) -> None:
    cluster = {
        "metadata": {"name": "gemma3-1b-math-b200"},
        "spec": {
            "authOptions": {"mode": "token", "secretName": "gemma3-1b-math-b200-ray-auth"},
            "headGroupSpec": {"template": {"spec": {"containers": [{"name": "ray-head"}]}}},
        },
    }
    (tmp_path / "bin" / "raycluster.json").write_text(json.dumps(cluster))
    line = _one_line_error(_main(fake_kube, "status", "--exp", "gemma3-1b-math"))
    assert "cannot read the Ray token from Secret gemma3-1b-math-b200-ray-auth in namespace team" in line
    assert "auth_token" in line


def test_should_read_the_secret_kuberay_makes_when_authoptions_names_none(fake_kube, monkeypatch) -> None:
    monkeypatch.setenv("PATH", fake_kube["PATH"])
    monkeypatch.setenv("KUBECONFIG", fake_kube["KUBECONFIG"])
    # KubeRay's default: mode token, a Secret named after the cluster
    assert (
        submit.ray_token(
            {"metadata": {"name": "kuberay-made"}, "spec": {"authOptions": {"mode": "token"}}}, "team"
        )
        == "s3cret"
    )
    assert (
        submit.ray_token({"metadata": {"name": "x"}, "spec": {"authOptions": {"mode": "disabled"}}}, "team")
        is None
    )
    assert submit.ray_token({"metadata": {"name": "x"}, "spec": {"authOptions": {}}}, "team") is None


def test_should_name_the_secret_as_kuberay_does_when_the_release_starts_with_a_digit() -> None:
    # utils.CheckName, which the chart's kuberl.authSecret mirrors (tests/charts/test_security.py)
    assert submit.kuberay_secret_name("gemma3-1b-math-b200") == "gemma3-1b-math-b200"
    assert submit.kuberay_secret_name("7b-run") == "rb-run"
    assert submit.kuberay_secret_name("a" * 47) == "a" * 47


def test_should_say_to_install_the_release_when_its_raycluster_is_missing(fake_kube) -> None:
    line = _one_line_error(_main(fake_kube, "submit", "qwen2.5-coder-7b-code"))
    assert "no RayCluster qwen2-5-coder-7b-code-b200 in namespace team" in line and "make install" in line


# ----- end to end on a real local Ray cluster -----------------------------------------------------


def _make(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "--no-print-directory", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def local_cluster(tmp_path_factory):
    """`make up` on free ports with 2 (logical) GPUs, `make down` afterwards, nothing left behind."""
    tmp = tmp_path_factory.mktemp("cluster")
    env = no_cluster_env(tmp)
    port, dashboard = _free_port(), _free_port()
    up = _make(
        env, "up", f"RAY_PORT={port}", f"RAY_DASHBOARD_PORT={dashboard}", "RAY_NUM_GPUS=2", timeout=240
    )
    assert up.returncode == 0, up.stdout + up.stderr
    assert f"dashboard http://127.0.0.1:{dashboard}" in up.stdout
    try:
        yield env, tmp, port, dashboard
    finally:
        down = _make(env, "down", timeout=120)
        assert down.returncode == 0, down.stdout + down.stderr
        assert not submit._stragglers(Path(f"/tmp/kuberl-ray-{port}")), (
            "processes of the local cluster survived make down"
        )
        assert not Path(f"/tmp/kuberl-ray-{port}").exists()


@pytest.mark.slow
def test_should_train_tiny_and_write_tensorboard_and_jsonl_when_submitted_to_a_local_cluster(
    local_cluster,
) -> None:
    env, tmp, _, dashboard = local_cluster
    logs, ckpt = tmp / "logs", tmp / "checkpoints"
    out = _make(
        env,
        "submit",
        "EXP=tiny",
        # A short run: enough for event files and rollouts on the paths given.
        f"OVERRIDES=logger.log_dir={logs} checkpointing.checkpoint_dir={ckpt} grpo.max_num_steps=4 cluster.cpu_workers_per_node=1",
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    job_id = out.stdout.split("job ", 1)[1].split()[0]
    assert job_id.startswith("kuberl-tiny-")
    assert f"dashboard: http://127.0.0.1:{dashboard}/#/jobs/{job_id}" in out.stdout
    assert out.stdout.rstrip().endswith(f"job {job_id} SUCCEEDED")
    run_dirs = list((logs / "tiny").iterdir())
    assert len(run_dirs) == 1
    assert list(run_dirs[0].glob("events.out.tfevents.*"))
    rows = (run_dirs[0] / "train_data_step1.jsonl").read_text().splitlines()
    assert rows and json.loads(rows[0])

    status = _make(env, "status")
    assert status.returncode == 0 and job_id in status.stdout and "SUCCEEDED" in status.stdout
    logs_out = _make(env, "logs", f"JOB={job_id}")
    assert logs_out.returncode == 0 and logs_out.stdout.rstrip().endswith(f"job {job_id} SUCCEEDED")
    assert "no job nope" in _one_line_error(_cli(env, "logs", "nope"))


@pytest.mark.slow
def test_should_pass_the_helm_test_check_only_when_ray_reports_the_gpus_asked_for(local_cluster) -> None:
    helm = REPO / "bin" / "helm"
    if not helm.exists():
        pytest.skip("bin/helm is missing: run `make helm`")
    rendered = subprocess.run(
        [str(helm), "template", "t", str(REPO / "charts/kuberl"), "--set", "storage.gcsfuse.bucketName=b"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    pod = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "Pod")
    script = pod["spec"]["containers"][0]["args"][0]
    env, tmp, port, _ = local_cluster
    token = subprocess.run(
        [str(Path(sys.executable).parent / "ray"), "get-auth-token"], env=env, capture_output=True, text=True
    ).stdout.strip()
    # As the pod has it: RAY_AUTH_MODE and RAY_AUTH_TOKEN from the release's Secret, no ~/.ray
    pod_env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert (
        pod_env["RAY_AUTH_MODE"]["value"] == "token"
        and "secretKeyRef" in pod_env["RAY_AUTH_TOKEN"]["valueFrom"]
    )
    home = tmp / "test-pod-home"
    home.mkdir(exist_ok=True)
    env = dict(
        env, PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}", RAY_HEAD=f"127.0.0.1:{port}",
        HOME=str(home), RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token,
    )  # fmt: skip
    refused = subprocess.run(
        ["bash", "-c", script], env=dict(env, RAY_AUTH_TOKEN="0" * 64, WANT_GPUS="2", TIMEOUT_S="0"),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert refused.returncode == 1 and "FAIL: ray status cannot reach the head" in refused.stdout
    ok = subprocess.run(
        ["bash", "-c", script],
        env=dict(env, WANT_GPUS="2", TIMEOUT_S="60"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0 and "ok: ray status reports 2 GPUs" in ok.stdout, ok.stdout + ok.stderr
    bad = subprocess.run(
        ["bash", "-c", script],
        env=dict(env, WANT_GPUS="16", TIMEOUT_S="0"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 1 and "FAIL: ray status reports 2 GPUs; the values ask for 16" in bad.stdout


@pytest.mark.slow
def test_should_stop_a_running_job_when_make_stop_is_given_its_id(local_cluster) -> None:
    env, tmp, _, _ = local_cluster
    out = _cli(
        env,
        "submit",
        "--no-follow",
        "tiny",
        "grpo.max_num_steps=100000",
        "cluster.cpu_workers_per_node=1",
        f"logger.log_dir={tmp / 'stop-logs'}",
    )
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.split("job ", 1)[1].split()[0]
    assert f"make stop JOB={job_id}" in out.stdout
    stop = _make(env, "stop", f"JOB={job_id}", timeout=120)
    assert stop.returncode == 0 and stop.stdout.strip().endswith(f"job {job_id} STOPPED"), (
        stop.stdout + stop.stderr
    )
    # STOPPED is Ray's word; the job's driver itself must be gone too, not left running without a job.
    deadline = time.monotonic() + 30
    while (drivers := _processes_naming(str(tmp / "stop-logs"))) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not drivers, f"the stopped job's driver is still running: {drivers}"


@pytest.mark.slow
def test_should_refuse_a_client_without_the_token_and_run_its_job_with_it_when_the_cluster_uses_token_auth(
    local_cluster,
) -> None:
    env, tmp, _, dashboard = local_cluster
    token = subprocess.run(
        [str(Path(sys.executable).parent / "ray"), "get-auth-token"], env=env, capture_output=True, text=True
    ).stdout.strip()
    assert token, "make up made no token"
    # A client of its own: a home without ~/.ray/auth_token, the cluster only by address.
    home = tmp / "client-home"
    home.mkdir()
    client = dict(env, HOME=str(home), RAY_ADDRESS=f"http://127.0.0.1:{dashboard}")
    client.pop("RAY_AUTH_MODE", None)
    client.pop("RAY_AUTH_TOKEN", None)
    job = ["submit", "--no-follow", "tiny", "grpo.max_num_steps=1", "cluster.cpu_workers_per_node=1",
           f"logger.log_dir={tmp / 'auth-logs'}", f"checkpointing.checkpoint_dir={tmp / 'auth-ckpt'}"]  # fmt: skip
    line = _one_line_error(_cli(client, *job))
    assert "uses token authentication and refused this client" in line and "RAY_AUTH_TOKEN" in line
    wrong = _one_line_error(_cli(dict(client, RAY_AUTH_TOKEN="0" * 64), "status"))
    assert "refused this client" in wrong

    out = _cli(dict(client, RAY_AUTH_TOKEN=token), *job)
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.split("job ", 1)[1].split()[0]
    stop = _cli(dict(client, RAY_AUTH_TOKEN=token), "stop", job_id, timeout=200)
    assert stop.returncode == 0 and stop.stdout.strip().endswith(("STOPPED", "SUCCEEDED")), (
        stop.stdout + stop.stderr
    )


def _processes_naming(text: str) -> list[str]:
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if text in cmdline and (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(f"{proc.name}: {cmdline[:160]}")
        except OSError:
            continue
    return found
