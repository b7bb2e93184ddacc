"""``python -m trainer.tools.submit``: run experiments on a Ray cluster through the Ray Jobs API.

The Makefile's cluster targets call it (``make submit EXP=... OVERRIDES="k=v ..."`` and friends):

  submit EXP [k=v ...]   submit ``python -m trainer experiment=EXP k=v ...`` as a Ray job, print the job
                         id and the dashboard URL, and follow the logs to the end
  status                 list the jobs;  logs JOB;  stop JOB
  up | down              start or stop a local Ray cluster on 127.0.0.1, so ``submit`` works on one machine
  tensorboard            TensorBoard over the cluster's log directory
  resolve EXP            print the Helm release and values file for EXP (``make install`` uses it)

Which cluster: ``RAY_ADDRESS`` (the dashboard, http://HOST:8265) when set; else the local cluster
that ``up`` started; else, with a kube context, the release's RayCluster, reached by port-forwarding
its head service. Every one of them uses Ray's token auth: on GKE the token is read from the Secret
the RayCluster's ``authOptions`` names, locally from ``~/.ray/auth_token`` (``up`` makes it), and with
``RAY_ADDRESS`` from ``RAY_AUTH_TOKEN``. A cluster that refuses the token is one line, as is any other
failure. The job runs the trainer that is already there (the image, or this venv for the
local cluster): the repository is never uploaded. Logs and checkpoints go where the cluster's
KUBERL_LOG_DIR and KUBERL_CHECKPOINT_DIR point (the chart's shared storage), unless overridden.

Every failure people can fix (no cluster, missing Secret, unknown EXP) is one line, no traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from trainer.ports import free_port

PACKAGE = Path(__file__).resolve().parents[1]  # trainer/
REPO = PACKAGE.parent
EXPERIMENTS = PACKAGE / "conf" / "experiment"
VALUES = REPO / "values"
DASHBOARD_PORT = 8265
TENSORBOARD_PORT = 6006
STOP_WAIT_S = (
    60  # SIGTERM to SIGKILL at `make stop`: above checkpointing.preemption_grace_s (25) plus shutdown
)
# What the cluster tells the trainer (where to write; the release's reward server, when it runs one): the chart
# and `up` set these on every Ray process, and a job's command passes each that is set and not overridden.
DIR_OVERRIDES = (
    ("logger.log_dir", "KUBERL_LOG_DIR"),
    ("checkpointing.checkpoint_dir", "KUBERL_CHECKPOINT_DIR"),
    ("reward_server.url", "KUBERL_REWARD_SERVER_URL"),
    ("reward_server.model", "KUBERL_REWARD_SERVER_MODEL"),
)


class SubmitError(Exception):
    """Something people can fix: the message names it and says how, in one line."""


# ----- experiments and releases -------------------------------------------------------------------


def experiments() -> list[str]:
    return sorted(p.stem for p in EXPERIMENTS.glob("*.yaml"))


def check_experiment(name: str) -> str:
    known = experiments()
    if not name:
        raise SubmitError(f"EXP is not set: make submit EXP=NAME, NAME one of {', '.join(known)}")
    if name not in known:
        raise SubmitError(
            f"unknown experiment {name!r}: choose one of {', '.join(known)} (trainer/conf/experiment/)"
        )
    return name


def _values_experiment(path: Path) -> str:
    import yaml

    return str((yaml.safe_load(path.read_text()) or {}).get("experiment") or "")


def max_name_length() -> int:
    """The one name-length limit, in charts/kuberl/Chart.yaml (`kuberl.dev/max-name-length`, KubeRay's
    47 for RayJobs), which the chart's `kuberl.fullname` cuts to as well."""
    import yaml

    chart = yaml.safe_load((REPO / "charts" / "kuberl" / "Chart.yaml").read_text())
    return int(chart["annotations"]["kuberl.dev/max-name-length"])


def release_name(name: str) -> str:
    """Helm release names are DNS labels: `qwen2.5-coder-7b-code` becomes `qwen2-5-coder-7b-code`, cut
    to the chart's name limit, so the release, its RayCluster and `<release>-head-svc` share one name."""
    return re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[: max_name_length()].rstrip("-")


@dataclass
class Release:
    name: str  # Helm release, also the RayCluster name
    values: Path | None  # values/*.yaml, None for an experiment without one (tiny on a local cluster)
    experiment: str  # the Hydra experiment it runs


def resolve(exp: str, need_values: bool = False) -> Release:
    """EXP is a values file's stem (`gemma3-1b-math-b200`), an experiment name (`gemma3-1b-math`) or
    the start of exactly one of them (`gemma3-27b`). The release is named after the values file, so
    `make install` and `make submit` find the same RayCluster whichever of the names was typed."""
    if not exp:
        stems = ", ".join(p.stem for p in sorted(VALUES.glob("*.yaml")))
        raise SubmitError(f"EXP is not set: pass EXP=NAME, a values file ({stems}) or an experiment")
    by_stem = VALUES / f"{exp}.yaml"
    if by_stem.is_file():
        return Release(release_name(exp), by_stem, _values_experiment(by_stem) or exp)
    # The release name NOTES prints (`qwen2-5-coder-7b-code-b200`): one values file, even when several
    # run the same experiment.
    by_release = [p for p in sorted(VALUES.glob("*.yaml")) if release_name(p.stem) == exp]
    if len(by_release) == 1:
        return Release(exp, by_release[0], _values_experiment(by_release[0]) or exp)
    matches = [p for p in sorted(VALUES.glob("*.yaml")) if _values_experiment(p) == exp]
    if len(matches) > 1:
        names = ", ".join(p.stem for p in matches)
        raise SubmitError(f"several values files run {exp}: pick one with EXP= one of {names}")
    if matches:
        return Release(release_name(matches[0].stem), matches[0], exp)
    if exp in experiments():
        if need_values:
            stems = ", ".join(p.stem for p in sorted(VALUES.glob("*.yaml")))
            raise SubmitError(
                f"no values file for {exp!r} in values/: use one of {stems}, or add values/{exp}.yaml"
            )
        return Release(release_name(exp), None, exp)
    return _resolve_prefix(exp, need_values)


def _resolve_prefix(exp: str, need_values: bool) -> Release:
    """`gemma3-27b` as people type it: the one experiment (or values file) it starts, else one line."""
    stems = {p.stem: _values_experiment(p) for p in sorted(VALUES.glob("*.yaml")) if p.stem.startswith(exp)}
    names = {e for e in experiments() if e.startswith(exp)} | set(stems.values())
    if len(names) == 1:
        (name,) = names
        return resolve(next(iter(stems)) if len(stems) == 1 else name, need_values)
    if names:
        raise SubmitError(f"EXP={exp} matches several experiments ({', '.join(sorted(names))}): pick one")
    if need_values:
        all_stems = ", ".join(p.stem for p in sorted(VALUES.glob("*.yaml")))
        raise SubmitError(
            f"no values file for {exp!r} in values/: use one of {all_stems}, or add values/{exp}.yaml"
        )
    return Release(release_name(exp), None, check_experiment(exp))


# ----- the local cluster (`up` / `down`) ----------------------------------------------------------


def state_dir() -> Path:
    return Path(os.environ.get("KUBERL_STATE_DIR") or REPO / ".cache" / "kuberl")


def _state_file() -> Path:
    return state_dir() / "local-ray.json"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of someone else's took the group id: not ours
        return False
    return True


def local_state() -> dict | None:
    """The cluster `up` started, if its processes still run."""
    try:
        state = json.loads(_state_file().read_text())
    except (OSError, ValueError):
        return None
    return state if _group_alive(int(state["pgid"])) else None


def _free_port() -> int:
    return free_port("127.0.0.1")  # outside the ephemeral range (trainer.ports)


def _port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _dashboard_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/api/version", timeout=2):
            return True
    except urllib.error.HTTPError:  # it answers (401 where Ray's token auth is on): it is up
        return True
    except OSError:
        return False


def cmd_up(args: argparse.Namespace) -> int:
    state = local_state()
    if state:
        print(f"local Ray cluster already up: dashboard {state['dashboard']} (make down stops it)")
        return 0
    for port, var in ((args.port, "RAY_PORT"), (args.dashboard_port, "RAY_DASHBOARD_PORT")):
        if _port_in_use(port):
            raise SubmitError(f"port {port} on 127.0.0.1 is taken (another Ray?): make up {var}=<free port>")
    ray = Path(sys.executable).parent / "ray"
    if not ray.exists():
        raise SubmitError("the `ray` command is not in this environment: run make setup")
    # Our own temp dir keeps the address out of /tmp/ray, so other Ray users on this machine never
    # attach to this cluster by accident, and `down` can delete everything it made.
    temp_dir = Path(f"/tmp/kuberl-ray-{args.port}")
    dashboard = f"http://127.0.0.1:{args.dashboard_port}"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a head joins nothing
    # The job's `python -m trainer` must be this venv's python.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("KUBERL_LOG_DIR", str(Path(args.log_dir).resolve()))
    env.setdefault("KUBERL_CHECKPOINT_DIR", str(Path(args.checkpoint_dir).resolve()))
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    # `make stop` sends SIGTERM, then SIGKILL after this many seconds (Ray's default is 3): time for
    # the trainer to reach a safe point and save what fits in checkpointing.preemption_grace_s.
    env.setdefault("RAY_JOB_STOP_WAIT_TIME_S", str(STOP_WAIT_S))
    # Ray's token auth, on explicitly: the jobs API on this port accepts only holders of
    # ~/.ray/auth_token (made here if missing), i.e. this user.
    env["RAY_AUTH_MODE"] = os.environ.get("RAY_AUTH_MODE") or "token"
    if env["RAY_AUTH_MODE"] == "token":
        subprocess.run([str(ray), "get-auth-token", "--generate"], env=env, capture_output=True, check=False)
    cmd = [
        str(ray), "start", "--head", "--block", "--disable-usage-stats",
        "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1",
        f"--port={args.port}", f"--dashboard-port={args.dashboard_port}",
        # Ray's fixed defaults for these would collide with any other Ray on the machine.
        f"--ray-client-server-port={_free_port()}", f"--dashboard-agent-listen-port={_free_port()}",
        f"--metrics-export-port={_free_port()}", f"--temp-dir={temp_dir}",
        f"--num-cpus={args.num_cpus}", f"--num-gpus={args.num_gpus}",
    ]  # fmt: skip
    state_dir().mkdir(parents=True, exist_ok=True)
    log_path = state_dir() / "ray-start.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd,
            env=env,
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + args.timeout
    while not _dashboard_ready(dashboard):
        if proc.poll() is not None:
            last = [ln for ln in log_path.read_text().splitlines() if ln.strip()][-1:] or ["no output"]
            raise SubmitError(f"ray start exited ({last[0].strip()}); full log: {log_path}")
        if time.monotonic() > deadline:
            _stop_group(proc.pid)
            raise SubmitError(
                f"the local Ray dashboard did not answer within {args.timeout}s; log: {log_path}"
            )
        time.sleep(0.5)
    state = {
        "pgid": proc.pid, "dashboard": dashboard, "gcs": f"127.0.0.1:{args.port}", "temp_dir": str(temp_dir),
        "log_dir": env["KUBERL_LOG_DIR"], "checkpoint_dir": env["KUBERL_CHECKPOINT_DIR"],
        "auth_mode": env["RAY_AUTH_MODE"],
    }  # fmt: skip
    _state_file().write_text(json.dumps(state, indent=2) + "\n")
    print(f"local Ray cluster up: dashboard {dashboard}, {args.num_cpus} CPUs, {args.num_gpus} GPUs")
    print(f"logs and checkpoints: {state['log_dir']}, {state['checkpoint_dir']}")
    print("next: make submit EXP=tiny   (make down stops it)")
    return 0


def _stop_group(pgid: int, grace_s: float = 5.0) -> None:
    """SIGTERM the process group `up` started (ray start, GCS, raylet, workers), then SIGKILL."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not _group_alive(pgid):
                return
            time.sleep(0.2)


def _stragglers(temp_dir: Path) -> list[int]:
    """Ray workers start their own sessions, so the group misses them; they name our temp dir."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if f"{temp_dir}/".encode() in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def cmd_down(args: argparse.Namespace) -> int:
    try:
        state = json.loads(_state_file().read_text())
    except (OSError, ValueError):
        print("no local Ray cluster is up (make up starts one)")
        return 0
    _stop_group(int(state["pgid"]))
    temp_dir = Path(state["temp_dir"])
    for pid in _stragglers(temp_dir):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if temp_dir.name.startswith("kuberl-ray-"):
        shutil.rmtree(temp_dir, ignore_errors=True)
    _state_file().unlink(missing_ok=True)
    print(f"local Ray cluster stopped ({state['dashboard']})")
    return 0


# ----- Kubernetes ---------------------------------------------------------------------------------


def _kubectl(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["kubectl", *args], capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise SubmitError("kubectl is not installed: install it, or set RAY_ADDRESS") from None
    except subprocess.TimeoutExpired:
        raise SubmitError(f"kubectl {' '.join(args[:2])} timed out: is the cluster reachable?") from None


def kube_context() -> str | None:
    if not shutil.which("kubectl"):
        return None
    out = _kubectl("config", "current-context", timeout=10)
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def kube_namespace(namespace: str | None) -> str:
    if namespace:
        return namespace
    out = _kubectl("config", "view", "--minify", "-o", "jsonpath={..namespace}", timeout=10)
    return out.stdout.strip() or "default"


def _kube_error(out: subprocess.CompletedProcess, context: str) -> SubmitError:
    first = (out.stderr.strip().splitlines() or ["no output"])[0]
    if "doesn't have a resource type" in first:
        return SubmitError(
            "KubeRay is not installed in this cluster: install the kuberay-operator Helm chart first"
        )
    return SubmitError(f"cannot reach Kubernetes (context {context}): {first}")


def _find_release(namespace: str, context: str) -> str:
    out = _kubectl("get", "rayclusters", "-n", namespace, "-l", "app.kubernetes.io/name=kuberl", "-o", "name")
    if out.returncode != 0:
        raise _kube_error(out, context)
    names = [line.split("/", 1)[-1] for line in out.stdout.split()]
    if len(names) == 1:
        return names[0]
    if not names:
        raise SubmitError(f"no kuberl RayCluster in namespace {namespace}: make install EXP=... first")
    raise SubmitError(f"several kuberl RayClusters in {namespace} ({', '.join(names)}): pass EXP=")


def check_raycluster(name: str, namespace: str, context: str) -> dict:
    """The installed RayCluster, and every Secret its head reads must exist (the Ray token's is read
    by :func:`ray_token`)."""
    out = _kubectl("get", "raycluster", name, "-n", namespace, "-o", "json")
    if out.returncode != 0:
        if "NotFound" in out.stderr or "not found" in out.stderr:
            raise SubmitError(
                f"no RayCluster {name} in namespace {namespace} (context {context}): make install EXP=... first"
            )
        raise _kube_error(out, context)
    cluster = json.loads(out.stdout)
    containers = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    for env in (e for c in containers for e in c.get("env", [])):
        ref = (env.get("valueFrom") or {}).get("secretKeyRef")
        if not ref or ref.get("optional"):
            continue
        secret = _kubectl("get", "secret", ref["name"], "-n", namespace, "-o", "name")
        if secret.returncode != 0:
            raise SubmitError(
                f"Secret {ref['name']} (for {env['name']}) is missing in namespace {namespace}: "
                f"kubectl create secret generic {ref['name']} -n {namespace} --from-literal={ref['key']}=..."
            )
    return cluster


def ray_token(cluster: dict, namespace: str) -> str | None:
    """The token of a RayCluster with token auth (``spec.authOptions``), from its Secret; None without.

    KubeRay turns auth on for ``mode: token`` only (``utils.IsAuthEnabled``), and without a
    ``secretName`` it makes a Secret named after the cluster (the chart's default); the key is always
    ``auth_token``."""
    options = cluster.get("spec", {}).get("authOptions") or {}
    if options.get("mode") != "token":
        return None
    secret = options.get("secretName") or kuberay_secret_name(cluster.get("metadata", {}).get("name", ""))
    out = _kubectl("get", "secret", secret, "-n", namespace, "-o", "jsonpath={.data.auth_token}")
    if out.returncode != 0 or not out.stdout.strip():
        why = (out.stderr.strip().splitlines() or ["it has no key auth_token"])[0]
        raise SubmitError(
            f"cannot read the Ray token from Secret {secret} in namespace {namespace} ({why}): "
            "KubeRay (1.6 or later) makes it for the RayCluster unless auth.existingSecret names one, which must "
            "exist with key auth_token; and you need `get` on Secrets there"
        )
    import base64

    return base64.b64decode(out.stdout.strip()).decode().strip()


def kuberay_secret_name(cluster: str) -> str:
    """The Secret KubeRay makes for a cluster's token (``utils.CheckName``): its name, cut to the last 50
    characters, with a leading digit or punctuation replaced by ``r``."""
    name = cluster[-50:]
    if name and not name[0].isalpha():
        name = "r" + name[1:]
    return name


@contextmanager
def port_forward(service: str, namespace: str, remote_port: int, local_port: int = 0) -> Iterator[int]:
    """`kubectl port-forward` to a service for the duration of the block; yields the local port."""
    proc = subprocess.Popen(
        ["kubectl", "port-forward", "-n", namespace, f"svc/{service}", f"{local_port or ''}:{remote_port}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        match = re.search(r"127\.0\.0\.1:(\d+)", line)
        if not match:
            err = (proc.stderr.read() if proc.stderr and proc.poll() is not None else "").strip()
            raise SubmitError(
                f"kubectl port-forward svc/{service} failed: {(err or line or 'no output').splitlines()[0]}"
            )
        yield int(match.group(1))
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()


# ----- which cluster ------------------------------------------------------------------------------


@dataclass
class Target:
    dashboard: str  # http://HOST:PORT of the Ray dashboard (the Jobs API)
    kind: str  # "address" | "local" | "kube"
    job_env: dict[str, str] = field(default_factory=dict)
    token: str | None = None  # Ray's auth token, sent as a bearer header; None: Ray's own lookup
    log_dir: str | None = None  # where TensorBoard should look, when known here
    kube: tuple[str, str] | None = None  # (RayCluster, namespace)


def _normalize_address(address: str) -> str:
    if address.startswith("ray://"):
        raise SubmitError(
            f"RAY_ADDRESS={address} is a Ray Client address: set the dashboard, http://HOST:8265"
        )
    return address if "://" in address else f"http://{address}"


@contextmanager
def connect(exp: str | None = None, namespace: str | None = None) -> Iterator[Target]:
    address = os.environ.get("RAY_ADDRESS")
    if address:
        token = os.environ.get("RAY_AUTH_TOKEN") or None
        yield Target(_normalize_address(address), "address", _local_job_env(), token=token)
        return
    state = local_state()
    if state:
        os.environ["RAY_AUTH_MODE"] = state.get("auth_mode", "token")  # this client speaks the cluster's auth
        yield Target(state["dashboard"], "local", _local_job_env(), log_dir=state.get("log_dir"))
        return
    context = kube_context()
    if not context:
        raise SubmitError(
            "no Ray cluster: `make up` starts a local one; for GKE, `make install EXP=...` with a kube context; "
            "or set RAY_ADDRESS=http://HOST:8265"
        )
    ns = kube_namespace(namespace)
    name = resolve(exp).name if exp else _find_release(ns, context)
    token = ray_token(check_raycluster(name, ns, context), ns)
    with port_forward(f"{name}-head-svc", ns, DASHBOARD_PORT) as port:
        yield Target(f"http://127.0.0.1:{port}", "kube", token=token, kube=(name, ns))


def _local_job_env() -> dict[str, str]:
    """On a local cluster the token comes from this shell; on GKE the pods read it from the Secret."""
    return {k: os.environ[k] for k in ("HF_TOKEN", "WANDB_API_KEY") if os.environ.get(k)}


def job_client(target: Target):
    import logging

    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    logging.getLogger("ray").setLevel(logging.WARNING)  # after import: Ray sets its own level

    headers = {"Authorization": f"Bearer {target.token}"} if target.token else None
    try:
        return JobSubmissionClient(target.dashboard, headers=headers)
    except AuthenticationError as e:  # 401 without a token, 403 with a wrong one
        hint = {
            "address": "set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN to the cluster's token (kubectl get secret "
            "<release> -o jsonpath={.data.auth_token} | base64 -d), or use make submit EXP=... with a kube context",
            "local": "make down && make up makes a new token in ~/.ray/auth_token",
            "kube": "the token in the RayCluster's Secret is not the one its pods started with: "
            "restart the head pod after changing it",
        }
        reason = str(e).split(":", 1)[0].strip()
        if reason not in ("Authentication required", "Authentication failed"):  # Ray's client found no token
            raise SubmitError(
                f"RAY_AUTH_MODE=token but there is no Ray token here (RAY_AUTH_TOKEN, ~/.ray/auth_token) for "
                f"{target.dashboard}: {hint[target.kind]}"
            ) from None
        raise SubmitError(
            f"the Ray cluster at {target.dashboard} uses token authentication and refused this client "
            f"({reason}): {hint[target.kind]}"
        ) from None
    except Exception as e:  # ConnectionError, or a non-Ray server answering on that port
        hint = {
            "address": "check RAY_ADDRESS",
            "local": "make down && make up",
            "kube": "is the head pod running?",
        }
        raise SubmitError(
            f"cannot reach the Ray Jobs API at {target.dashboard} ({type(e).__name__}): {hint[target.kind]}"
        ) from None


def _job_call(fn, job_id: str, *args):
    try:
        return fn(job_id, *args)
    except RuntimeError as e:
        if "404" in str(e) or "does not exist" in str(e):
            raise SubmitError(f"no job {job_id} on this cluster: make status lists the jobs") from None
        raise


# ----- jobs ---------------------------------------------------------------------------------------


def entrypoint(experiment: str, overrides: list[str]) -> str:
    """`exec python -m trainer experiment=EXP ...`, writing where the cluster says unless overridden.

    Ray runs the entrypoint with a shell on the head, so `${VAR:+key=$VAR}` adds the override only
    where the cluster sets VAR (the chart, `make up`). `exec` makes the driver the very process Ray
    started: a stop that comes before the shell has forked signals the shell alone, and the driver
    it forks a moment later would run on with no job (Ray's fallback for that kills only the
    supervisor's direct children)."""
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    parts = ["exec", "python", "-m", "trainer", f"experiment={experiment}"]
    parts += [f"${{{var}:+{key}=${var}}}" for key, var in DIR_OVERRIDES if key not in given]
    return " ".join(parts + [shlex.quote(o) for o in overrides])


def _check_overrides(overrides: list[str]) -> None:
    for o in overrides:
        if "=" not in o and not o.startswith("~"):
            raise SubmitError(f'override {o!r} is not key=value: OVERRIDES="grpo.max_num_steps=10 ..."')
        if o.split("=", 1)[0] == "experiment":
            raise SubmitError("set the experiment with EXP=, not in OVERRIDES")


def follow(client, job_id: str) -> str:
    """Stream the job's logs until it ends; return its final status."""
    import asyncio

    async def tail() -> None:
        async for chunk in client.tail_job_logs(job_id):
            sys.stdout.write(chunk)
            sys.stdout.flush()

    try:
        asyncio.run(tail())
    except Exception:  # the log stream broke (a port-forward hiccup): poll instead
        shown = 0
        while not client.get_job_status(job_id).is_terminal():
            logs = client.get_job_logs(job_id)
            sys.stdout.write(logs[shown:])
            shown = len(logs)
            time.sleep(2)
        sys.stdout.write(client.get_job_logs(job_id)[shown:])
    while not (status := client.get_job_status(job_id)).is_terminal():
        time.sleep(0.5)
    return str(status.value)


def cmd_submit(args: argparse.Namespace) -> int:
    release = resolve(args.exp)
    experiment = check_experiment(release.experiment)
    _check_overrides(args.overrides)
    command = entrypoint(experiment, args.overrides)
    with connect(args.exp, args.namespace) as target:
        client = job_client(target)
        job_id = f"kuberl-{release_name(experiment)}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
        runtime_env = {"env_vars": target.job_env} if target.job_env else None
        client.submit_job(
            entrypoint=command,
            submission_id=job_id,
            runtime_env=runtime_env,
            metadata={"experiment": experiment},
        )
        print(f"job {job_id} submitted: {command}")
        print(
            f"dashboard: {target.dashboard}/#/jobs/{job_id}"
            + (" (while this port-forward runs)" if target.kube else "")
        )
        if args.no_follow:
            print(f"follow: make logs JOB={job_id}   stop: make stop JOB={job_id}")
            return 0
        try:
            status = follow(client, job_id)
        except KeyboardInterrupt:
            print(
                f"\nstopped following; the job keeps running: make logs JOB={job_id}, make stop JOB={job_id}"
            )
            return 130
    print(f"job {job_id} {status}")
    return 0 if status == "SUCCEEDED" else 1


def cmd_status(args: argparse.Namespace) -> int:
    with connect(args.exp, args.namespace) as target:
        jobs = job_client(target).list_jobs()
    print(f"cluster: {target.dashboard} ({target.kind})")
    if not jobs:
        print("no jobs yet: make submit EXP=...")
        return 0
    for job in sorted(jobs, key=lambda j: j.start_time or 0):
        started = time.strftime("%Y-%m-%d %H:%M", time.localtime((job.start_time or 0) / 1000))
        exp = (job.metadata or {}).get("experiment", "-")
        print(f"{job.submission_id or job.job_id:44} {job.status.value:10} {started}  {exp}")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    if not args.job:
        raise SubmitError("JOB is not set: make logs JOB=<id> (make status lists them)")
    with connect(args.exp, args.namespace) as target:
        client = job_client(target)
        if _job_call(client.get_job_status, args.job).is_terminal():
            sys.stdout.write(client.get_job_logs(args.job))
            status = str(client.get_job_status(args.job).value)
        else:
            try:
                status = follow(client, args.job)
            except KeyboardInterrupt:
                return 130
    print(f"job {args.job} {status}")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    if not args.job:
        raise SubmitError("JOB is not set: make stop JOB=<id> (make status lists them)")
    with connect(args.exp, args.namespace) as target:
        client = job_client(target)
        _job_call(client.stop_job, args.job)
        print(f"stopping job {args.job}: SIGTERM sent; the trainer stops at its next safe point and saves "
              "if that fits in checkpointing.preemption_grace_s", flush=True)  # fmt: skip
        # Ray sends SIGKILL after RAY_JOB_STOP_WAIT_TIME_S (`up`: STOP_WAIT_S; the chart: the pods'
        # terminationGracePeriodSeconds, 120 by default): wait a little longer than either.
        deadline = time.monotonic() + 150
        while not (status := client.get_job_status(args.job)).is_terminal() and time.monotonic() < deadline:
            time.sleep(1)
    print(f"job {args.job} {status.value}")
    return 0


def cmd_tensorboard(args: argparse.Namespace) -> int:
    if not os.environ.get("RAY_ADDRESS") and not local_state() and kube_context():
        ns = kube_namespace(args.namespace)
        name = resolve(args.exp).name if args.exp else _find_release(ns, kube_context() or "")
        with port_forward(f"{name}-head-svc", ns, TENSORBOARD_PORT, args.port) as port:
            print(f"TensorBoard of {name}: http://127.0.0.1:{port}  (Ctrl-C stops the port-forward)")
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                return 0
    state = local_state() or {}
    log_dir = state.get("log_dir") or os.environ.get("KUBERL_LOG_DIR") or str(REPO / "logs")
    tensorboard = Path(sys.executable).parent / "tensorboard"
    print(f"TensorBoard over {log_dir}: http://127.0.0.1:{args.port}  (Ctrl-C stops it)")
    try:
        return subprocess.call(
            [str(tensorboard), "--logdir", log_dir, "--host", "127.0.0.1", "--port", str(args.port)]
        )
    except KeyboardInterrupt:
        return 0


def cmd_resolve(args: argparse.Namespace) -> int:
    release = resolve(args.exp, need_values=True)
    print(release.name, release.values.relative_to(REPO) if release.values else "")
    return 0


# ----- command line -------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer.tools.submit", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, fn, help: str, exp: bool = True) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help)
        sp.set_defaults(fn=fn)
        if exp:
            sp.add_argument("--namespace", "-n", default=os.environ.get("NAMESPACE") or None)
        return sp

    sp = add("submit", cmd_submit, "submit an experiment and follow its logs")
    sp.add_argument("exp", nargs="?", default="")
    sp.add_argument("overrides", nargs="*", help="Hydra overrides, key=value")
    sp.add_argument("--no-follow", action="store_true", help="return after printing the job id")
    sp = add("status", cmd_status, "list the cluster's jobs")
    sp.add_argument("--exp", default=os.environ.get("EXP") or None)
    for name, fn, help in (
        ("logs", cmd_logs, "print or follow a job's logs"),
        ("stop", cmd_stop, "stop a job"),
    ):
        sp = add(name, fn, help)
        sp.add_argument("job", nargs="?", default="")
        sp.add_argument("--exp", default=os.environ.get("EXP") or None)
    sp = add("tensorboard", cmd_tensorboard, "TensorBoard over the cluster's logs")
    sp.add_argument("--exp", default=os.environ.get("EXP") or None)
    sp.add_argument("--port", type=int, default=TENSORBOARD_PORT)
    sp = add("up", cmd_up, "start a local Ray cluster on 127.0.0.1", exp=False)
    sp.add_argument("--port", type=int, default=int(os.environ.get("RAY_PORT") or 6379))
    sp.add_argument(
        "--dashboard-port", type=int, default=int(os.environ.get("RAY_DASHBOARD_PORT") or DASHBOARD_PORT)
    )
    # Ray's CPU count is bookkeeping here: policy ranks, generation and rewards share the real cores.
    sp.add_argument("--num-cpus", type=int, default=max(os.cpu_count() or 1, 8))
    sp.add_argument("--num-gpus", type=int, default=0)
    sp.add_argument("--log-dir", default=str(REPO / "logs"))
    sp.add_argument("--checkpoint-dir", default=str(REPO / "checkpoints"))
    sp.add_argument("--timeout", type=float, default=120.0)
    add("down", cmd_down, "stop the local Ray cluster", exp=False)
    sp = add("resolve", cmd_resolve, "print the release name and values file for EXP", exp=False)
    sp.add_argument("exp", nargs="?", default="")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except SubmitError as e:
        print(f"kuberl: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
