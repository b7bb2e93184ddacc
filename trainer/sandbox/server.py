"""The sandbox service: ``python -m trainer.sandbox.server`` runs model-written programs for the release's reward tasks.

A small HTTP server (standard library only) in a pod of its own, which holds no Ray token, no service-account
token and no shared storage: programs, their tests and limits in, verdicts out (:mod:`trainer.sandbox.wire`),
each program run through :func:`trainer.sandbox.executor.run_tests` under bubblewrap and its seccomp filter. An
escape from the sandbox then lands in a pod that can reach nothing worth having, not on a Ray worker.

Routes:

- ``POST /v1/run`` (``Authorization: Bearer <token>``, JSON body ``{"programs": [...]}``): 200 with
  ``{"results": [...]}``, one per program in order. 401 without the token or with any other (Ray's included),
  411 without a Content-Length, 413 over the body limit, 400 naming the field and the limit for a bad or
  too large program (too many programs, tests or seconds), 503 with ``Retry-After`` while the queue is full or
  the server drains. ``{"programs": []}`` answers ``{"results": []}``: how a client checks its token.
- ``GET /healthz`` (no token: for the kubelet's probes): 200 ``{"status": "ok", "backend": ..., "seccomp": ...,
  "workers": N}``.

Every error is ``{"error": "<one line>"}``. The environment: ``KUBERL_SANDBOX_TOKEN`` (or
``KUBERL_SANDBOX_TOKEN_FILE``, a mounted Secret's file) is the bearer token, at least 16 characters, required;
``KUBERL_SANDBOX_HOST`` (default ``$POD_IP``, else 127.0.0.1) and ``KUBERL_SANDBOX_PORT`` (default 8090) where it
listens (``--host``/``--port`` win; port 0 picks a free one, printed in the first line on stdout); ``KUBERL_SANDBOX_WORKERS``
how many programs run at once (default: the CPUs its cgroup grants). The sandbox's own variables apply
(``KUBERL_SANDBOX``, ``KUBERL_SANDBOX_WITHOUT_SECCOMP``, ``KUBERL_SANDBOX_PYTHON``, ``KUBERL_SANDBOX_PCH``,
``KUBERL_SANDBOX_TMP``: :mod:`trainer.sandbox.backends`).

It refuses to start, in one line and with exit status 2, without a token, with ``RAY_AUTH_TOKEN`` or
``RAY_AUTH_TOKEN_PATH`` in its environment (model code must not run beside the Ray token), and where
bubblewrap (with its seccomp filter) cannot start, unless ``KUBERL_SANDBOX=rlimit-without-isolation`` says so.
It holds: a fixed set of connection threads (a connection beyond them waits in a short queue, then gets a
503), a deadline for reading each request and writing each answer (a slow client loses its connection, not a
thread for ever), a body limit checked before the body is read, the token checked before that, and a bounded
number of programs admitted at once. SIGTERM stops accepting, finishes the requests it holds (each bounded by
its programs' own deadlines) and exits 0.
"""

from __future__ import annotations

import argparse
import hmac
import http.server
import json
import logging
import math
import os
import queue
import shutil
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import trainer.sandbox.backends as backends
import trainer.sandbox.executor as executor
import trainer.sandbox.pch as pch
import trainer.sandbox.wire as wire
from trainer.sandbox.executor import BatchResult, RunResult
from trainer.sandbox.limits import ERROR

log = logging.getLogger("kuberl-sandbox")

TOKEN_ENV, TOKEN_FILE_ENV, MIN_TOKEN_CHARS = wire.TOKEN_ENV, wire.TOKEN_FILE_ENV, wire.MIN_TOKEN_CHARS
RUN_PATH, HEALTH_PATH = wire.RUN_PATH, wire.HEALTH_PATH
RAY_TOKEN_ENVS = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
DEFAULT_PORT = 8090
SOCKET_TIMEOUT_S = 10.0  # any one read or write on a connection
READ_TIMEOUT_S = 60.0  # the whole request line, headers and body
WRITE_TIMEOUT_S = 60.0  # the whole answer
MAX_BODY_MB = 32.0
QUEUE_PER_WORKER = 32  # programs admitted (running or waiting) per worker before a 503


class StartupError(Exception):
    """The server cannot start: one line."""


def cpu_count() -> int:
    """The CPUs this process may use: its affinity, capped by its cgroup's quota (a pod's CPU limit)."""
    n = len(os.sched_getaffinity(0))
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            n = min(n, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)


def read_token() -> str:
    """The bearer token from ``KUBERL_SANDBOX_TOKEN`` or the file ``KUBERL_SANDBOX_TOKEN_FILE`` names."""
    token, path = os.environ.get(TOKEN_ENV, ""), os.environ.get(TOKEN_FILE_ENV, "")
    if token and path:
        raise StartupError(f"set one of {TOKEN_ENV} and {TOKEN_FILE_ENV}, not both")
    if path:
        try:
            with open(path) as f:
                token = f.read().strip()
        except OSError as e:
            raise StartupError(f"{TOKEN_FILE_ENV}={path}: cannot read it ({e.strerror})") from None
    if not token:
        raise StartupError(
            f"no token: set {TOKEN_ENV} (or {TOKEN_FILE_ENV}) to the bearer token its callers send; "
            "it never listens unauthenticated"
        )
    if len(token) < MIN_TOKEN_CHARS:
        raise StartupError(
            f"the token has {len(token)} characters, fewer than {MIN_TOKEN_CHARS}; set a random one "
            "(python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    return token


def refuse_ray_token() -> None:
    for name in RAY_TOKEN_ENVS:
        if os.environ.get(name):
            raise StartupError(
                f"{name} is set in its environment: model code must not run beside the Ray token; "
                "remove it from the sandbox server's pod"
            )


class SandboxServer(http.server.HTTPServer):
    """The listening socket, a fixed set of connection threads, the sandbox pool and a read/write watchdog."""

    allow_reuse_address = True
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[str, int],
        token: str,
        backend: backends.Backend,
        workers: int,
        caps: wire.Caps | None = None,
        max_body_bytes: int = int(MAX_BODY_MB * (1 << 20)),
        read_timeout_s: float = READ_TIMEOUT_S,
    ):
        super().__init__(address, Handler)
        self.read_timeout_s = read_timeout_s
        self.token = token.encode()
        self.backend = backend
        self.workers = workers
        self.caps = caps or wire.Caps()
        self.max_body_bytes = max_body_bytes
        self.max_admitted = workers * QUEUE_PER_WORKER
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="sandbox")
        self.draining = False
        self._admitted = 0
        self._lock = threading.Lock()
        self._deadlines: dict[socket.socket, float] = {}
        self._stop = threading.Event()
        n_handlers = max(8, 4 * workers)
        self._conns: queue.Queue = queue.Queue(maxsize=n_handlers)
        self._threads = [
            threading.Thread(target=self._serve_conns, name=f"conn-{i}", daemon=True)
            for i in range(n_handlers)
        ]
        self._threads.append(threading.Thread(target=self._watchdog, name="watchdog", daemon=True))
        for t in self._threads:
            t.start()

    # --- connections: a fixed set of threads, a short queue, a 503 beyond it ---------------------------

    def process_request(self, request, client_address) -> None:
        try:
            self._conns.put_nowait((request, client_address))
        except queue.Full:
            try:
                request.settimeout(1.0)
                request.sendall(
                    _raw_reply(503, {"error": "the sandbox server is busy; retry"}, retry_after=1)
                )
            except OSError:
                pass
            self.shutdown_request(request)

    def _serve_conns(self) -> None:
        while True:
            item = self._conns.get()
            if item is None:
                return
            request, address = item
            try:
                self.finish_request(request, address)
            except Exception:  # a handler bug costs one connection, never the server
                log.exception("the request from %s failed", address[0])
            finally:
                self.unwatch(request)
                self.shutdown_request(request)

    def watch(self, sock: socket.socket, seconds: float) -> None:
        """Shut ``sock`` down if it is still watched ``seconds`` from now (a slow or stalled client)."""
        with self._lock:
            self._deadlines[sock] = time.monotonic() + seconds

    def unwatch(self, sock: socket.socket) -> None:
        with self._lock:
            self._deadlines.pop(sock, None)

    def _watchdog(self) -> None:
        while not self._stop.wait(0.25):
            now = time.monotonic()
            with self._lock:
                late = [s for s, t in self._deadlines.items() if t < now]
                for s in late:
                    del self._deadlines[s]
            for s in late:
                try:
                    s.shutdown(socket.SHUT_RDWR)  # the handler's blocked read or write returns at once
                except OSError:
                    pass

    # --- programs ------------------------------------------------------------------------------------

    def admit(self, n: int) -> bool:
        with self._lock:
            if self.draining or (self._admitted and self._admitted + n > self.max_admitted):
                return False
            self._admitted += n
            return True

    def release(self, n: int) -> None:
        with self._lock:
            self._admitted -= n

    def run(self, programs: list[wire.Program]) -> list[dict]:
        futures = [self.pool.submit(_run_one, p) for p in programs]
        return [wire.result_to_json(f.result()) for f in futures]

    def drain(self) -> None:
        """After serve_forever returned: finish the connections taken, then the programs, then close."""
        self.draining = True
        for _ in range(len(self._threads) - 1):
            self._conns.put(None)
        for t in self._threads[:-1]:
            t.join()
        self._stop.set()
        self._threads[-1].join()
        self.pool.shutdown(wait=True)
        self.server_close()


def _run_one(p: wire.Program):
    try:
        return executor.run_tests(p.language, p.source, list(p.inputs), p.limits, **p.kwargs())
    except Exception as e:  # our bug, not the program's: that program's verdicts say error
        log.exception("run_tests failed")
        return BatchResult(
            [RunResult(ERROR) for _ in p.inputs], error=f"the sandbox server failed: {type(e).__name__}: {e}"
        )


def _raw_reply(status: int, body: dict, retry_after: int | None = None) -> bytes:
    data = json.dumps(body).encode()
    reason = http.server.BaseHTTPRequestHandler.responses.get(status, ("",))[0]
    head = f"HTTP/1.0 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
    if retry_after is not None:
        head += f"Retry-After: {retry_after}\r\n"
    return (head + "Connection: close\r\n\r\n").encode() + data


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # one request per connection: no idle keep-alive holds a thread
    server_version = "kuberl-sandbox"
    sys_version = ""
    timeout = SOCKET_TIMEOUT_S
    server: SandboxServer

    def setup(self) -> None:
        super().setup()
        self.server.watch(self.connection, self.server.read_timeout_s)
        self._started = time.monotonic()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        log.debug("%s %s", self.address_string(), format % args)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        self._reply(code, {"error": message or self.responses.get(code, ("error",))[0]})

    def _reply(self, status: int, body: dict, retry_after: int | None = None) -> None:
        data = json.dumps(body).encode()
        self.server.watch(self.connection, WRITE_TIMEOUT_S)
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status == 401:
                self.send_header("WWW-Authenticate", 'Bearer realm="kuberl-sandbox"')
            if retry_after is not None:
                self.send_header("Retry-After", str(retry_after))
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()
        except OSError:  # the client went away: nothing to tell it
            self.close_connection = True
        path = getattr(self, "path", "")
        if path == RUN_PATH or status >= 500:
            log.info("%s %s %d %.2fs", self.command, path, status, time.monotonic() - self._started)

    def do_GET(self) -> None:
        if self.path != HEALTH_PATH:
            self._reply(404, {"error": f"no route {self.path}; POST {RUN_PATH}, GET {HEALTH_PATH}"})
        elif self.server.draining:
            self._reply(503, {"status": "draining"})
        else:
            self._reply(
                200,
                {
                    "status": "ok",
                    "backend": self.server.backend.kind,
                    "seccomp": self.server.backend.seccomp is not None,
                    "workers": self.server.workers,
                },
            )

    def _authorized(self) -> bool:
        header = self.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        # compare_digest on bytes of any length: the time it takes says nothing about the token
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.server.token)

    def do_POST(self) -> None:
        if self.path != RUN_PATH:
            self._reply(404, {"error": f"no route {self.path}; POST {RUN_PATH}, GET {HEALTH_PATH}"})
            return
        if not self._authorized():
            self._reply(
                401, {"error": "missing or wrong bearer token (Authorization: Bearer <KUBERL_SANDBOX_TOKEN>)"}
            )
            return
        length = self.headers.get("Content-Length")
        if length is None:
            self._reply(411, {"error": "a Content-Length header is required"})
            return
        try:
            n = int(length)
            if n < 0:
                raise ValueError
        except ValueError:
            self._reply(400, {"error": f"Content-Length={length!r} is not a byte count"})
            return
        if n > self.server.max_body_bytes:
            self._reply(
                413,
                {
                    "error": f"the body has {n} bytes, over this server's limit of {self.server.max_body_bytes}"
                },
            )
            return
        try:
            body = self.rfile.read(n)
        except OSError:
            self.close_connection = True
            return
        if len(body) < n:  # the client hung up, or the read deadline passed
            return
        self.server.unwatch(self.connection)
        try:
            programs = self._programs(body)
        except wire.BadRequest as e:
            self._reply(e.status, {"error": str(e)})
            return
        if not self.server.admit(len(programs)):
            self._reply(503, {"error": "the sandbox server is busy or draining; retry"}, retry_after=1)
            return
        try:
            results = self.server.run(programs)
        finally:
            self.server.release(len(programs))
        self._reply(200, {"results": results})

    def _programs(self, body: bytes) -> list[wire.Program]:
        try:
            request = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise wire.BadRequest(f"the body is not JSON ({e})") from None
        if not isinstance(request, dict) or not isinstance(request.get("programs"), list):
            raise wire.BadRequest('the body must be {"programs": [...]}')
        unknown = sorted(set(request) - {"programs"})
        if unknown:
            raise wire.BadRequest(f'{unknown[0]} is not a field; the body is {{"programs": [...]}}')
        raw = request["programs"]
        caps = self.server.caps
        if len(raw) > caps.max_programs:
            raise wire.BadRequest(
                f"programs has {len(raw)} entries, over this server's limit of {caps.max_programs}"
            )
        return [wire.program_from_json(f"programs[{i}]", p, caps) for i, p in enumerate(raw)]


def _int_env(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    try:
        return int(value) if value else default
    except ValueError:
        raise StartupError(f"{name}={value!r} is not a whole number") from None


def _parse(argv: list[str] | None) -> argparse.Namespace:
    env = os.environ
    p = argparse.ArgumentParser(prog="python -m trainer.sandbox.server", description=__doc__.splitlines()[0])
    p.add_argument("--host", default=env.get("KUBERL_SANDBOX_HOST") or env.get("POD_IP") or "127.0.0.1")
    p.add_argument("--port", type=int, default=_int_env("KUBERL_SANDBOX_PORT", DEFAULT_PORT))
    p.add_argument("--workers", type=int, default=_int_env("KUBERL_SANDBOX_WORKERS", 0) or None)
    p.add_argument("--max-body-mb", type=float, default=MAX_BODY_MB)
    p.add_argument("--max-programs", type=int, default=wire.Caps.max_programs)
    p.add_argument("--max-tests", type=int, default=wire.Caps.max_tests)
    p.add_argument("--read-timeout-s", type=float, default=READ_TIMEOUT_S, help="to read a whole request")
    return p.parse_args(argv)


def serve(args: argparse.Namespace) -> None:
    refuse_ray_token()
    token = read_token()
    for name in (TOKEN_ENV, TOKEN_FILE_ENV):  # nothing it starts (compilers, bubblewrap) inherits it
        os.environ.pop(name, None)
    try:
        backend = backends.resolve()
    except backends.SandboxUnavailable as e:
        raise StartupError(str(e)) from None
    workers = args.workers or cpu_count()
    if min(workers, args.max_programs, args.max_tests, args.max_body_mb, args.read_timeout_s) <= 0:
        raise StartupError(
            "--workers, --max-programs, --max-tests, --max-body-mb and --read-timeout-s must be > 0"
        )
    gxx = shutil.which("g++")
    if gxx:
        pch.include_dir(gxx, executor.CPP_STD)  # starts building the precompiled header in the background
    caps = wire.Caps(max_programs=args.max_programs, max_tests=args.max_tests)
    try:
        server = SandboxServer(
            (args.host, args.port),
            token,
            backend,
            workers,
            caps,
            int(args.max_body_mb * (1 << 20)),
            args.read_timeout_s,
        )
    except OSError as e:
        raise StartupError(f"cannot listen on {args.host}:{args.port} ({e.strerror or e})") from None

    stopping = threading.Event()

    def stop(signum, _frame) -> None:
        if not stopping.is_set():
            stopping.set()
            log.info("%s: finishing the requests in hand, then exiting", signal.Signals(signum).name)
            threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    host, port = str(server.server_address[0]), int(server.server_address[1])
    print(
        f"kuberl-sandbox: listening on http://{host}:{port} ({backend.kind}"
        f"{' + seccomp' if backend.seccomp is not None else ', no seccomp filter'}, {workers} workers)",
        flush=True,
    )
    server.serve_forever(poll_interval=0.2)
    server.drain()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="kuberl-sandbox: %(message)s", stream=sys.stderr)
    try:
        serve(_parse(argv))
    except (
        StartupError,
        ValueError,
    ) as e:  # ValueError: a variable that is not a number (KUBERL_SANDBOX_PORT=x)
        print(f"kuberl-sandbox: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
