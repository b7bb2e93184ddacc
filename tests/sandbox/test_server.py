"""The sandbox service for real: ``python -m trainer.sandbox.server`` on 127.0.0.1, the code rewards calling it
through ``KUBERL_SANDBOX_URL``.

The hostile tables of ``test_hostile.py`` go through it in shared requests beside honest programs: every hostile
one scores 0 (or its table's lower score), every honest one 1, and nothing escapes (the canary lives, no file
is written outside, no host socket is reached, the server's token is nowhere to be read, no sandbox process
outlives the server). Then the edges: the token (none, a wrong one, Ray's), the server's start-up refusals, its
limits (4xx naming each), and the client's retries (a 503, a server restarted mid-request) and its failure
path (nothing listening: LOST verdicts and a warning, never an exception).
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from trainer import rewards
from trainer.config import EnvConfig, RewardSpec
from trainer.ports import free_port
from trainer.sandbox import LOST, OK, backends, remote, run_tests, wire

from . import test_hostile as hostile
from .conftest import sandbox_processes

# integration: the server, and the programs it runs, are processes of their own
pytestmark = [pytest.mark.timeout(240), pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]
TOKEN = "sandbox-test-" + uuid.uuid4().hex
SERVER_ENV_DROP = (
    "RAY_AUTH_TOKEN",
    "RAY_AUTH_TOKEN_PATH",
    remote.URL_ENV,
    wire.TOKEN_FILE_ENV,
    "KUBERL_SANDBOX",
)


def _bwrap_problem() -> str | None:
    try:
        backends.resolve("bwrap")
    except backends.SandboxUnavailable as e:
        return str(e)
    return None


class Server:
    """One ``python -m trainer.sandbox.server`` process: started, read for its port, stopped with SIGTERM."""

    def __init__(self, port: int = 0, extra_env: dict | None = None, args: tuple = ()):
        env = {k: v for k, v in os.environ.items() if k not in SERVER_ENV_DROP}
        env.update({wire.TOKEN_ENV: TOKEN, "KUBERL_SANDBOX_WORKERS": "4"}, **(extra_env or {}))
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "trainer.sandbox.server",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                *args,
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        line = _readline(self.proc, 60)
        if "listening on http://127.0.0.1:" not in line:
            self.stop()
            raise AssertionError(f"the server did not start: {line!r} {self.stderr()[-2000:]}")
        self.port = int(line.split("127.0.0.1:")[1].split()[0])
        self.url = f"http://127.0.0.1:{self.port}"

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.proc.stdout.close()
        # nothing it started outlives it (sandboxes are told apart by their uids only as root)
        deadline = time.monotonic() + 5
        while left := sandbox_processes({self.proc.pid}):
            assert time.monotonic() < deadline, f"sandbox processes outlived the server: {left}"
            time.sleep(0.1)
        self.log.close()
        return rc


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout)
    return box[0] if box else ""


@pytest.fixture(scope="module")
def server():
    why = _bwrap_problem()
    if why:
        pytest.skip(f"bubblewrap unavailable here ({why}); the server refuses to start without it")
    s = Server(args=("--read-timeout-s", "3"))
    yield s
    assert s.stop() == 0, s.stderr()[-2000:]


@pytest.fixture
def use(monkeypatch):
    """Point this process's sandbox calls at ``url`` (a fresh client: its settings as the test set them)."""

    def point(url: str) -> None:
        monkeypatch.setenv(remote.URL_ENV, url)
        monkeypatch.setenv(wire.TOKEN_ENV, TOKEN)
        monkeypatch.delenv(wire.TOKEN_FILE_ENV, raising=False)
        monkeypatch.setattr(remote, "_clients", {})

    return point


def _post(port: int, body: bytes | None, headers: dict, path: str = wire.RUN_PATH, method: str = "POST"):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body, headers)
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, json.loads(data) if data else None
    finally:
        conn.close()


def _auth(token: str = TOKEN) -> dict:
    return {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}


# --- the hostile set, through the server ---------------------------------------------------------------


def _hostile_table(tmp_path: Path, port: int) -> tuple[list[tuple], list[str]]:
    """(name, reward, ground truth, response, expected score) for every hostile and honest sample, and the
    host paths that must still not exist after."""
    gt = hostile.GT
    table = [(f"py:{k}", "code_unit_tests", gt, hostile.py(v), 0.0) for k, v in hostile.PY_HOSTILE.items()]
    table += [(f"cpp:{k}", "cpp_contest", gt, hostile.cpp(c), v) for k, (c, v) in hostile.CPP_HOSTILE.items()]
    targets = [
        str(tmp_path / "escaped"),
        str(REPO / f"escaped-{uuid.uuid4().hex}"),
        f"/tmp/kuberl-escape-{uuid.uuid4().hex}",
    ]
    seekers = {
        "read_etc_passwd": "try:\n    open('/etc/passwd').read()\n    print(42)\nexcept OSError:\n    print(0)",
        "write_outside": (
            "wrote = False\n"
            f"for path in {targets!r}:\n"
            "    try:\n"
            "        open(path, 'w').write('pwned')\n"
            f"        wrote |= path != {targets[2]!r}\n"  # its own /tmp is writable: the host's must stay untouched
            "    except OSError:\n"
            "        pass\n"
            "print(42 if wrote else 0)"
        ),
        "connect_to_a_host_socket": (
            "import socket\ns = socket.socket()\ns.settimeout(1)\n"
            f"print(42 if s.connect_ex(('127.0.0.1', {port})) == 0 else 0)"
        ),
        "find_the_servers_token": (
            "import os\n"
            f"found = any({TOKEN!r} in v for v in os.environ.values())\n"
            "for pid in os.listdir('/proc'):\n"
            "    try:\n"
            f"        found |= {TOKEN!r}.encode() in open('/proc/' + pid + '/environ', 'rb').read()\n"
            "    except (OSError, ValueError):\n"
            "        pass\n"
            "print(42 if found else 0)"
        ),
        "kill_everything": (
            "import os, signal\n"
            "for target in [os.getppid(), -1] + [int(p) for p in os.listdir('/proc') if p.isdigit()]:\n"
            "    try:\n"
            "        if target != os.getpid():\n"
            "            os.kill(target, signal.SIGKILL)\n"
            "    except OSError:\n"
            "        pass\n"
            "print(42)"
        ),
    }
    table += [(f"py:{k}", "code_unit_tests", gt, hostile.py(v), 0.0) for k, v in seekers.items()]
    honest_cpp = (
        '```cpp\n#include <cstdio>\nint main(){int a,b;scanf("%d %d",&a,&b);printf("%d\\n",a+b);}\n```'
    )
    for i in range(3):  # honest samples interleaved with the hostile ones, in the same requests
        table.insert(6 * i, (f"honest_py_{i}", "code_unit_tests", hostile.GOOD, hostile.GOOD_PY, 1.0))
    table.insert(9, ("honest_cpp", "cpp_contest", hostile.GOOD, honest_cpp, 1.0))
    return table, targets


def test_should_score_every_hostile_program_zero_and_honest_ones_one_when_run_through_the_server(
    server, use, tmp_path, canary
):
    use(server.url)
    with hostile._listening_host_socket() as (host_socket, port):
        table, targets = _hostile_table(tmp_path, port)
        c = remote.client()
        t0 = time.monotonic()
        with ThreadPoolExecutor(remote.MAX_BATCH) as pool:  # as the reward task does: programs share requests
            scores = list(pool.map(lambda row: rewards.get(row[1])(row[2], row[3]), table))
        took = time.monotonic() - t0
        with pytest.raises(TimeoutError):
            host_socket.accept()
    wrong = {row[0]: (s.value, row[4]) for row, s in zip(table, scores, strict=True) if s.value != row[4]}
    assert not wrong, f"scored otherwise than expected (got, expected): {wrong}"
    assert all(not s.correct for row, s in zip(table, scores, strict=True) if row[4] < 1.0)
    assert c.requests < len(table) / 2, f"{c.requests} requests for {len(table)} programs: no batching"
    assert not any(os.path.exists(t) for t in targets), "a hostile program wrote outside its sandbox"
    assert took < 180
    status, health = _post(server.port, None, {}, wire.HEALTH_PATH, "GET")
    assert (
        status == 200 and health["status"] == "ok" and health["seccomp"] is True
    )  # the server is still fine


# --- authentication ------------------------------------------------------------------------------------


def test_should_refuse_a_request_when_it_carries_no_token_a_wrong_one_or_rays(server, monkeypatch):
    body = json.dumps({"programs": [{"language": "python", "source": "print(1)", "inputs": [""]}]}).encode()
    ray_token = "ray-" + uuid.uuid4().hex
    monkeypatch.setenv("RAY_AUTH_TOKEN", ray_token)  # what a Ray pod holds: never accepted
    for headers in (
        {},
        {"Authorization": f"Bearer {TOKEN[:-1]}"},
        {"Authorization": f"Bearer {ray_token}"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": TOKEN},
    ):
        status, answer = _post(server.port, body, headers)
        assert status == 401 and "token" in answer["error"], (headers, status, answer)
    status, answer = _post(server.port, body, _auth())
    assert status == 200 and answer["results"][0]["runs"][0]["status"] == OK


def test_should_never_send_rays_token_when_the_client_is_given_it(server, use, monkeypatch):
    use(server.url)
    monkeypatch.setenv("RAY_AUTH_TOKEN", TOKEN)  # the sandbox token set to Ray's by mistake
    r = run_tests("python", "print(1)", [""])
    assert r.runs[0].status == LOST and "Ray's token" in (r.error or "")
    with pytest.raises(backends.SandboxUnavailable, match="Ray's token"):
        remote.check()


@pytest.mark.parametrize(
    "env, says",
    [
        (
            {"RAY_AUTH_TOKEN": "x" * 32},
            "RAY_AUTH_TOKEN is set in its environment: model code must not run beside the Ray token",
        ),
        ({"RAY_AUTH_TOKEN_PATH": "/tmp/t"}, "RAY_AUTH_TOKEN_PATH is set in its environment"),
        ({wire.TOKEN_ENV: ""}, f"no token: set {wire.TOKEN_ENV}"),
        ({wire.TOKEN_ENV: "short"}, "fewer than 16"),
        ({"KUBERL_SANDBOX": "rlimit"}, f"KUBERL_SANDBOX={backends.UNISOLATED}"),
        ({"KUBERL_SANDBOX_PORT": "http"}, "KUBERL_SANDBOX_PORT='http' is not a whole number"),
    ],
)
def test_should_refuse_to_start_in_one_line_when_its_environment_is_unsafe_or_wrong(env, says):
    base = {k: v for k, v in os.environ.items() if k not in SERVER_ENV_DROP}
    p = subprocess.run(
        [sys.executable, "-m", "trainer.sandbox.server", "--host", "127.0.0.1", "--port", "0"],
        cwd=REPO,
        env={**base, wire.TOKEN_ENV: TOKEN, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and p.stdout == "", (p.stdout, p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("kuberl-sandbox: error:")]
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in p.stderr, p.stderr


def test_should_start_from_a_token_file_and_answer_health_probes_without_a_token(tmp_path):
    if _bwrap_problem():
        pytest.skip("bubblewrap unavailable here")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    s = Server(extra_env={wire.TOKEN_ENV: "", wire.TOKEN_FILE_ENV: str(token_file)})
    try:
        status, health = _post(s.port, None, {}, wire.HEALTH_PATH, "GET")
        assert status == 200 and health == {"status": "ok", "backend": "bwrap", "seccomp": True, "workers": 4}
        assert _post(s.port, b'{"programs": []}', _auth())[0] == 200
    finally:
        assert s.stop() == 0


# --- limits --------------------------------------------------------------------------------------------


def _program(**overrides) -> dict:
    return {"language": "python", "source": "print(1)", "inputs": [""], **overrides}


@pytest.mark.parametrize(
    "body, status, says",
    [
        ({"programs": [_program()] * 65}, 400, "programs has 65 entries, over this server's limit of 64"),
        (
            {"programs": [_program(inputs=[""] * 513)]},
            400,
            "programs[0].inputs has 513 tests, over this server's limit of 512",
        ),
        (
            {"programs": [_program(limits={"time_s": 600})]},
            400,
            "programs[0].limits.time_s=600 is over this server's limit of 60",
        ),
        (
            {"programs": [_program(limits={"memory_mb": 1 << 20})]},
            400,
            "programs[0].limits.memory_mb=1048576 is over",
        ),
        (
            {"programs": [_program(compile_limits={"wall_s": 1e6})]},
            400,
            "programs[0].compile_limits.wall_s=1e+06 is over",
        ),
        (
            {"programs": [_program(language="bash")]},
            400,
            "programs[0].language='bash': expected one of python, cpp",
        ),
        ({"programs": [_program(limits={"rm_rf": 1})]}, 400, "programs[0].limits.rm_rf is not a limit"),
        ({"programs": [_program(inputs="1 2")]}, 400, "programs[0].inputs must be a list of strings"),
        (
            {"programs": [_program(output_caps=[1, 2])]},
            400,
            "output_caps must be null or one integer per input",
        ),
        ({"programs": []}, 200, None),
    ],
)
def test_should_refuse_requests_over_its_limits_with_a_4xx_naming_the_limit(server, body, status, says):
    got, answer = _post(server.port, json.dumps(body).encode(), _auth())
    assert got == status, answer
    assert answer == {"results": []} if says is None else says in answer["error"]


def test_should_refuse_a_body_over_the_limit_before_reading_it(server):
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    answer = b""
    try:
        head = (
            f"POST {wire.RUN_PATH} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Length: {64 << 20}\r\n\r\n"
        )
        sock.sendall(head.encode())  # and never the 64 MiB
        while chunk := sock.recv(65536):
            answer += chunk
    finally:
        sock.close()
    assert (
        answer.decode().startswith("HTTP/1.0 413")
        and "over this server's limit of 33554432" in answer.decode()
    )


@pytest.mark.parametrize(
    "raw, status, says",
    [
        (f"POST {wire.RUN_PATH} HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\n\r\n", 411, "Content-Length"),
        (
            f"POST {wire.RUN_PATH} HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: 3\r\n\r\nabc",
            400,
            "not JSON",
        ),
        ("POST /v1/other HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 404, "no route /v1/other"),
        ("DELETE /v1/run HTTP/1.1\r\n\r\n", 501, "Unsupported method"),
    ],
    ids=["no-length", "not-json", "no-route", "bad-method"],  # the token is random: no id may hold it (xdist)
)
def test_should_answer_malformed_requests_in_one_json_line(server, raw, status, says):
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    try:
        sock.sendall(raw.encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    finally:
        sock.close()
    head, _, body = data.decode().partition("\r\n\r\n")
    assert head.split()[1] == str(status), data
    assert says in json.loads(body)["error"]


def test_should_drop_a_client_that_dribbles_its_request_at_the_read_deadline(server):
    """A byte a second beats any per-read timeout; the whole request's deadline (3 s here) still ends it, and the
    server serves others meanwhile."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    t0 = time.monotonic()
    try:
        sock.sendall(b"POST /v1/run HTTP/1.1\r\n")
        assert _post(server.port, b'{"programs": []}', _auth())[0] == 200
        with pytest.raises(OSError):
            for _ in range(30):
                sock.sendall(b"X")  # a header that never ends
                time.sleep(1.0)
        assert time.monotonic() - t0 < 15
    finally:
        sock.close()


# --- the client: batching, retries, failure -------------------------------------------------------------


def test_should_share_one_request_when_callers_run_programs_at_once(server, use, monkeypatch):
    use(server.url)
    monkeypatch.setattr(
        remote, "BATCH_WAIT_S", 1.0
    )  # generous on a loaded machine: all 8 join the first batch
    barrier = threading.Barrier(8)

    def call(i: int):
        barrier.wait()
        return run_tests("python", "print(int(input()) * 2)", [f"{i}\n"])

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, range(8)))
    assert [r.runs[0].stdout for r in results] == [f"{2 * i}\n".encode() for i in range(8)]
    assert remote.client().requests <= 2  # a first caller may send alone before the others count as calling


def test_should_batch_a_reward_tasks_samples_when_the_runner_scores_them(server, use):
    """What ``_score_task`` does with a task of code samples: threads, so their programs share requests."""
    from trainer.rewards import runner

    use(server.url)
    specs = [RewardSpec("code_unit_tests")]
    items = [(hostile.GOOD, hostile.GOOD_PY, None, None)] * 12
    results = runner._each(lambda item: runner.score_one(specs, *item), items, ["code_unit_tests"])
    assert [r.total for r in results] == [1.0] * 12
    assert remote.client().requests <= 3
    assert (
        runner.sandbox_resource(["code_unit_tests"]) is None
    )  # no sandbox group needed: the service runs them
    runner.RewardRunner(EnvConfig(specs))  # its start-up check passes


class _Flaky(http.server.BaseHTTPRequestHandler):
    """Answers 503 to the first ``fail`` requests, then a canned verdict."""

    fail = 2
    seen = 0

    def do_POST(self):
        type(self).seen += 1
        self.rfile.read(int(self.headers["Content-Length"]))
        if type(self).seen <= self.fail:
            body, status = b'{"error": "busy"}', 503
        else:
            run = {
                "status": "ok",
                "returncode": 0,
                "stdout_b64": "NDIK",
                "stderr_b64": "",
                "cpu_s": 0,
                "wall_s": 0,
            }
            body = json.dumps(
                {
                    "results": [
                        {"runs": [run], "compile": None, "error": None, "backend": "bwrap", "wall_s": 0}
                    ]
                }
            ).encode()
            status = 200
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def _fake(handler):
    httpd = http.server.HTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        t.join()


def test_should_retry_with_backoff_when_the_server_answers_503(use, monkeypatch):
    monkeypatch.setattr(remote, "BACKOFF_S", 0.05)
    monkeypatch.setattr(_Flaky, "seen", 0)
    with _fake(_Flaky) as url:
        use(url)
        r = run_tests("python", "print(42)", [""])
        assert r.runs[0].status == OK and r.runs[0].stdout == b"42\n"
        assert _Flaky.seen == 3 and remote.client().requests == 3


def test_should_retry_and_finish_when_the_server_restarts_mid_request(use, tmp_path):
    if _bwrap_problem():
        pytest.skip("bubblewrap unavailable here")
    port = free_port("127.0.0.1")
    first = Server(port)
    use(first.url)
    box = {}
    # Runs 2 s of wall time: the server is killed under it, and the retry runs it again on the new one.
    call = threading.Thread(
        target=lambda: box.update(r=run_tests("python", "import time\ntime.sleep(2)\nprint('done')", [""])),
        daemon=True,
    )
    call.start()
    time.sleep(1.0)
    assert first.stop(signal.SIGKILL) == -signal.SIGKILL  # mid-request: the connection breaks
    second = Server(port)
    try:
        call.join(60)
        assert not call.is_alive(), "the client never returned"
        r = box["r"]
        assert r.error is None and r.runs[0].status == OK and r.runs[0].stdout == b"done\n", r
        assert remote.client().requests >= 2
    finally:
        assert second.stop() == 0


def test_should_score_as_lost_with_a_warning_when_the_server_is_gone(use, monkeypatch, caplog):
    monkeypatch.setattr(remote, "ATTEMPTS", 3)
    monkeypatch.setattr(remote, "BACKOFF_S", 0.05)
    port = free_port("127.0.0.1")  # nothing listens there
    use(f"http://127.0.0.1:{port}")
    with caplog.at_level(logging.WARNING, logger="trainer.sandbox.remote"):
        r = run_tests("python", "print(42)", ["", ""])
        py = rewards.get("code_unit_tests")(hostile.GOOD, hostile.GOOD_PY)
        cpp = rewards.get("cpp_contest")(hostile.GOOD, "```cpp\nint main(){}\n```")
    assert [x.status for x in r.runs] == [LOST, LOST] and "gave up after 3 attempts" in r.error
    assert "cannot connect" in r.error
    assert py.value == 0.0 and not py.correct and "lost" in py.note
    assert cpp.value == -1.0 and not cpp.correct
    warned = [rec.getMessage() for rec in caplog.records if "score as lost" in rec.getMessage()]
    assert len(warned) == 3 and all(f"127.0.0.1:{port}" in w for w in warned)
    assert remote.client().requests == 9


def test_should_stop_the_run_in_one_line_when_the_service_is_unusable_at_start(use, monkeypatch, server):
    from trainer.rewards import runner

    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # a local run: no waiting for the service to come up
    use(f"http://127.0.0.1:{free_port('127.0.0.1')}")
    with pytest.raises(backends.SandboxUnavailable) as e:
        runner.RewardRunner(EnvConfig([RewardSpec("code_unit_tests")]))
    assert "\n" not in str(e.value) and str(e.value).startswith(f"{remote.URL_ENV}=http://127.0.0.1:")
    monkeypatch.setenv(wire.TOKEN_ENV, "wrong-" + TOKEN)
    monkeypatch.setenv(remote.URL_ENV, server.url)
    with pytest.raises(backends.SandboxUnavailable, match="it refused the token") as e:
        runner.RewardRunner(EnvConfig([RewardSpec("code_unit_tests")]))
    assert "\n" not in str(e.value)
