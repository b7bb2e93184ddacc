"""Where model code runs: :func:`run_tests` decides, in this one place, between here and the sandbox service.

Without ``KUBERL_SANDBOX_URL`` (local runs, tests) it is :func:`trainer.sandbox.executor.run_tests` in this
process, exactly as before. With it (the chart sets it, and ``KUBERL_SANDBOX_TOKEN`` or
``KUBERL_SANDBOX_TOKEN_FILE``, in the pods that score rewards) every program goes to the release's sandbox
service (``python -m trainer.sandbox.server``), and this process never runs model code at all.

The call is idempotent, so a connection that fails or breaks (the server restarting mid-batch) and a 5xx
answer (a 503 from a full queue or a draining server) are retried, :data:`ATTEMPTS` times in all, with
exponential backoff and jitter (``Retry-After`` honoured, up to :data:`MAX_BACKOFF_S`). An answer that does not
come within the programs' own deadlines (what the executor allows them, summed, plus slack) is not retried: the
server was busy, and asking again would double its load. A 4xx (a wrong token, a program over the server's
limits) is final. A call that fails for good never raises: its programs come back with every verdict
:data:`~trainer.sandbox.limits.LOST`, ``error`` saying why, and one warning per failed request; a code reward
scores such a sample as it scores a sandbox that died (0, or -1 for ``cpp_contest``).

Batching: concurrent calls in one process (the reward task scores its samples on threads,
``trainer.rewards.runner``) join one request of up to :data:`MAX_BATCH` programs: the first caller waits up to
:data:`BATCH_WAIT_S` for the others when others are calling, a call that fills a batch sends it at once, and a
lone caller never waits. :func:`check` is the driver's start-up check: the service answers an authenticated empty
batch, or the run stops with one line.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import random
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

import trainer.sandbox.backends as backends
import trainer.sandbox.executor as executor
import trainer.sandbox.wire as wire
from trainer.sandbox.executor import LANGUAGES, BatchResult, RunResult
from trainer.sandbox.limits import COMPILE_LIMITS, LOST, Limits

log = logging.getLogger(__name__)

URL_ENV = "KUBERL_SANDBOX_URL"
MAX_BATCH = 16  # programs per request
BATCH_WAIT_S = 0.05  # how long the first of several concurrent callers waits for the others
ATTEMPTS = 6  # tries per request, the first included
BACKOFF_S = 0.5  # before the second try; doubled each time, with jitter
MAX_BACKOFF_S = 8.0
CONNECT_TIMEOUT_S = 10.0
ANSWER_SLACK_S = 30.0  # on top of the programs' own deadlines: queueing, start-up, transfer
MAX_ANSWER_S = 900.0
RETRIED = frozenset({500, 502, 503, 504})


class RemoteError(Exception):
    """A request that failed; ``retryable`` when asking again may help (connection, 5xx)."""

    def __init__(self, message: str, retryable: bool, retry_after: float | None = None):
        super().__init__(message)
        self.retryable = retryable
        self.retry_after = retry_after  # seconds, from a 503's Retry-After


def configured() -> str:
    """The sandbox service's URL, or "" when programs run here."""
    return os.environ.get(URL_ENV, "").strip()


def run_tests(
    language: str,
    source: str,
    inputs: list[str | bytes],
    limits: Limits | None = None,
    *,
    output_caps: list[int] | None = None,
    compile_limits: Limits = COMPILE_LIMITS,
    stop_on: tuple[str, ...] = (),
    python_mode: str = "fork",
    backend: str | None = None,
) -> BatchResult:
    """:func:`trainer.sandbox.executor.run_tests`, here or in the sandbox service (``KUBERL_SANDBOX_URL``); the
    service picks its own backend, so ``backend`` applies only here."""
    if not configured():
        return executor.run_tests(
            language,
            source,
            inputs,
            limits,
            output_caps=output_caps,
            compile_limits=compile_limits,
            stop_on=stop_on,
            python_mode=python_mode,
            backend=backend,
        )
    if language not in LANGUAGES:  # our misuse raises, as it does here
        raise ValueError(f"sandbox language {language!r}: expected one of {', '.join(LANGUAGES)}")
    if python_mode not in ("fork", "exec"):
        raise ValueError(
            f"python_mode {python_mode!r}: expected 'fork' (a forked interpreter per test) or 'exec'"
        )
    program = wire.Program(
        language,
        source,
        [
            x.decode("utf-8", "surrogateescape") if isinstance(x, bytes | bytearray) else str(x)
            for x in inputs
        ],
        limits or Limits(),
        compile_limits,
        None if output_caps is None else [int(c) for c in output_caps],
        tuple(stop_on),
        python_mode,
    )
    try:
        c = client()
    except backends.SandboxUnavailable as e:
        log.warning("%s; the program scores as lost", e)
        return lost(program, str(e))
    return c.run(program)


def lost(program: wire.Program, why: str) -> BatchResult:
    """What a program whose request failed for good comes back as: every test LOST, no compile result."""
    return BatchResult(
        [RunResult(LOST) for _ in program.inputs], error=f"sandbox service: {why}", backend="remote"
    )


def concurrency() -> int:
    """How many programs a caller should have in flight at once to fill batches (1: runs are local)."""
    return MAX_BATCH if configured() else 1


@dataclass
class _Job:
    program: wire.Program
    result: BatchResult | None = None
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Batch:
    jobs: list[_Job] = field(default_factory=list)
    closed: bool = False


class Client:
    """Sends programs to one sandbox service, batched, retried; never raises on what the service does."""

    def __init__(
        self,
        url: str,
        token: str,
        *,
        max_batch: int | None = None,
        batch_wait_s: float | None = None,
        attempts: int | None = None,
        backoff_s: float | None = None,
    ):
        """None: the module's setting (MAX_BATCH, BATCH_WAIT_S, ATTEMPTS, BACKOFF_S), read now."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise backends.SandboxUnavailable(
                f"{URL_ENV}={url!r}: expected http://HOST:PORT or https://HOST:PORT (the sandbox service)"
            )
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise backends.SandboxUnavailable(f"{URL_ENV}={url!r}: the port is not a number") from None
        self.url, self.https, self.host, self.port = url, parts.scheme == "https", parts.hostname, port
        self.prefix = parts.path.rstrip("/")
        self._auth = f"Bearer {token}"
        self.max_batch = max(1, MAX_BATCH if max_batch is None else max_batch)
        self.batch_wait_s = BATCH_WAIT_S if batch_wait_s is None else batch_wait_s
        self.attempts = max(1, ATTEMPTS if attempts is None else attempts)
        self.backoff_s = BACKOFF_S if backoff_s is None else backoff_s
        self.requests = 0  # HTTP requests sent, retries included
        self._lock = threading.Lock()
        self._open: _Batch | None = None
        self._callers = 0

    # --- batching --------------------------------------------------------------------------------------

    def run(self, program: wire.Program) -> BatchResult:
        job = _Job(program)
        with self._lock:
            self._callers += 1
        try:
            batch = self._join(job)
            if batch is not None:
                self._send(batch)
            job.done.wait()  # the sender sets it whatever happens (_send's finally)
        finally:
            with self._lock:
                self._callers -= 1
        assert job.result is not None
        return job.result

    def _join(self, job: _Job) -> _Batch | None:
        """Add ``job`` to the open batch; the batch to send if this caller is to send it, else None."""
        with self._lock:
            b = self._open
            lead = b is None or b.closed
            if lead:
                b = self._open = _Batch()
            assert b is not None
            b.jobs.append(job)
            if len(b.jobs) >= self.max_batch or (lead and self._callers <= 1):
                b.closed = True
                return b
            if not lead:
                return None
        time.sleep(self.batch_wait_s)  # the others calling now join this batch meanwhile
        with self._lock:
            if b.closed:  # one of them filled and sent it
                return None
            b.closed = True
            return b

    def _send(self, batch: _Batch) -> None:
        jobs = batch.jobs
        try:
            results = self.post([j.program for j in jobs])
            for j, r in zip(jobs, results, strict=True):
                j.result = r
        except Exception as e:  # RemoteError, or anything else: the samples lose their score, the run goes on
            why = str(e) if isinstance(e, RemoteError) else f"{type(e).__name__}: {e}"
            log.warning("sandbox service %s: %s; %d program(s) score as lost", self.url, why, len(jobs))
            for j in jobs:
                j.result = lost(j.program, why)
        finally:
            for j in jobs:
                if j.result is None:
                    j.result = lost(j.program, "no answer")
                j.done.set()

    # --- one request, retried ------------------------------------------------------------------------

    def post(self, programs: list[wire.Program]) -> list[BatchResult]:
        """One request for ``programs``, retried; RemoteError when it fails for good."""
        body = json.dumps({"programs": [wire.program_to_json(p) for p in programs]}).encode()
        answer_s = min(MAX_ANSWER_S, ANSWER_SLACK_S + sum(p.budget_s() for p in programs))
        last: RemoteError | None = None
        for attempt in range(self.attempts):
            if attempt:
                time.sleep(self._backoff(attempt, last))
            try:
                raw = self._request(body, answer_s)
            except RemoteError as e:
                if not e.retryable:
                    raise
                last = e
                continue
            try:
                results = raw["results"]
                if not isinstance(results, list) or len(results) != len(programs):
                    raise ValueError(f"{len(results)} results for {len(programs)} programs")
                return [
                    wire.result_from_json(r, len(p.inputs)) for r, p in zip(results, programs, strict=True)
                ]
            except (KeyError, TypeError, ValueError) as e:
                raise RemoteError(f"a garbled answer ({e})", retryable=False) from None
        raise RemoteError(f"gave up after {self.attempts} attempts; the last: {last}", retryable=False)

    def _backoff(self, attempt: int, last: RemoteError | None) -> float:
        wait = min(MAX_BACKOFF_S, self.backoff_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
        if last is not None and last.retry_after:
            return max(wait, min(MAX_BACKOFF_S, last.retry_after))
        return wait

    def _connection(self) -> http.client.HTTPConnection:
        if self.https:
            import ssl

            return http.client.HTTPSConnection(
                self.host, self.port, timeout=CONNECT_TIMEOUT_S, context=ssl.create_default_context()
            )
        return http.client.HTTPConnection(self.host, self.port, timeout=CONNECT_TIMEOUT_S)

    def _request(self, body: bytes, answer_s: float) -> dict:
        conn = self._connection()
        with self._lock:
            self.requests += 1
        try:
            try:
                conn.connect()
            except OSError as e:  # refused, unreachable, no DNS yet: the server is not (yet) there
                raise RemoteError(f"cannot connect ({e})", retryable=True) from None
            assert conn.sock is not None
            conn.sock.settimeout(answer_s)
            try:
                conn.request(
                    "POST",
                    self.prefix + wire.RUN_PATH,
                    body,
                    {"Authorization": self._auth, "Content-Type": "application/json"},
                )
                resp = conn.getresponse()
                data = resp.read()
            except TimeoutError:
                raise RemoteError(f"no answer within {answer_s:.0f}s", retryable=False) from None
            except (OSError, http.client.HTTPException) as e:  # reset or closed mid-request: a restart
                raise RemoteError(f"the connection broke ({type(e).__name__}: {e})", retryable=True) from None
        finally:
            conn.close()
        try:
            answer = json.loads(data) if data else {}
        except ValueError:
            answer = {}
        if resp.status == 200:
            if not isinstance(answer, dict):
                raise RemoteError("a garbled answer (not a JSON object)", retryable=False)
            return answer
        said = answer.get("error") if isinstance(answer, dict) else None
        said = str(said or data[:200].decode("utf-8", "replace") or resp.reason)
        if resp.status in (401, 403):
            raise RemoteError(
                f"it refused the token ({resp.status}: {said}); {wire.TOKEN_ENV} must be the server's",
                retryable=False,
            )
        try:
            retry_after = float(resp.getheader("Retry-After") or 0) or None
        except ValueError:
            retry_after = None
        raise RemoteError(f"{resp.status}: {said}", retryable=resp.status in RETRIED, retry_after=retry_after)


_clients: dict[tuple[str, str], Client] = {}
_clients_lock = threading.Lock()


def _token() -> str:
    token, path = os.environ.get(wire.TOKEN_ENV, ""), os.environ.get(wire.TOKEN_FILE_ENV, "")
    if path and not token:
        try:
            with open(path) as f:
                token = f.read().strip()
        except OSError as e:
            raise backends.SandboxUnavailable(
                f"{wire.TOKEN_FILE_ENV}={path}: cannot read it ({e.strerror})"
            ) from None
    if not token:
        raise backends.SandboxUnavailable(
            f"{URL_ENV} is set but neither {wire.TOKEN_ENV} nor {wire.TOKEN_FILE_ENV} is: the sandbox service "
            "takes no request without its token"
        )
    ray_token = os.environ.get("RAY_AUTH_TOKEN", "")
    if ray_token and token == ray_token:
        raise backends.SandboxUnavailable(
            f"{wire.TOKEN_ENV} is Ray's token ($RAY_AUTH_TOKEN); the sandbox service has a token of its own, and "
            "Ray's is never sent to it"
        )
    return token


def client() -> Client:
    """The client for the configured service (one per URL and token in a process); SandboxUnavailable when the
    configuration is wrong."""
    key = (configured(), _token())
    with _clients_lock:
        if key not in _clients:
            _clients[key] = Client(*key)
        return _clients[key]


def check(wait_s: float = 0.0) -> None:
    """The driver's start-up check: the service takes an authenticated empty batch within ``wait_s`` (a pod that
    is still starting), or SandboxUnavailable, one line, says what is wrong."""
    c = Client(configured(), _token(), attempts=1)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            c.post([])
            return
        except RemoteError as e:
            if not e.retryable or time.monotonic() >= deadline:
                raise backends.SandboxUnavailable(
                    f"{URL_ENV}={c.url}: the sandbox service is not usable ({e}); code rewards have nowhere to "
                    f"run: check its pod and its token, or unset {URL_ENV} to run programs in process"
                ) from None
            time.sleep(2.0)
