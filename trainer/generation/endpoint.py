"""An OpenAI-compatible chat endpoint over one generation engine, for harnesses that drive rollouts and
for people who want to talk to the policy being trained (``generation.endpoint``).

``POST /v1/chat/completions`` (messages, tools, n, temperature, top_p, max_tokens or max_completion_tokens,
logprobs, seed, stop) and ``GET /v1/models``. The messages (and tools) go through the policy tokenizer's chat
template with ``generation.chat_template_kwargs``, exactly as the trainer's own prompts do
(:func:`trainer.data.prompts.encode_prompt`; tools through the template's ``tools=``, or in the system turn
where the template has none), and the engine samples from the ids. Each answer is OpenAI's shape plus what a
harness needs to keep its trajectory token-exact (CONTRIBUTING.md: Trajectories are tokens):
``prompt_token_ids`` and, per choice, ``token_ids``, the sampled ids themselves (logprobs beside them), so
nobody re-tokenises decoded text. Tool calls in a sample's text are parsed with the environments' own parser
(:func:`trainer.envs.tool_calls.parse_tool_calls`, Hermes' ``<tool_call>`` JSON) into ``message.tool_calls``
(finish_reason ``tool_calls``); a malformed call stays in ``content`` as written.

Tokens in, tokens out: a harness sends each later turn of an episode as the whole conversation again, the
assistant messages this endpoint answered with among it. Rendering that through the chat template would write
the model's earlier turns as the template writes them (a tool call's JSON re-serialised, Qwen3's template
dropping an earlier turn's ``<think>`` block, whitespace added), not as they were sampled, and the turns would
no longer join into one token-exact sample (:func:`trainer.envs.base.chain`). So every sampled choice is kept
(:class:`Continuations`, bounded) under the conversation it ends: the request's messages, tools and the
assistant message returned for it. A request whose last assistant message is one of them is prompted with
that request's prompt ids + the ids sampled for it + the template's glue for only the messages after it
(:class:`trainer.data.prompts.TurnEncoder`, as the trainer's own environments are); any other request is
rendered whole, and one whose last assistant message was not found is counted (``unmatched``) and logged
once, with the reason. The match is exact: the tool calls' ids are the endpoint's own, and two samples that
end the same conversation with the same message but different ids cannot be told apart, so neither is continued.

Safety (CONTRIBUTING.md: Secure by default): every request carries ``Authorization: Bearer <token>``, compared
in constant time, with the endpoint's own token: ``$KUBERL_ENDPOINT_TOKEN``
(``generation.endpoint.token_env``), else one the driver makes at random for the run and hands to the engines
and its in-process callers (:func:`read_token`). Never Ray's token (``RAY_AUTH_TOKEN``): a harness that may
call the endpoint must not be able to submit Ray jobs, so an endpoint whose token is Ray's does not start. It
listens on the pod's own address ($POD_IP, from the chart's downward API) or 127.0.0.1, never on every
interface unless ``generation.endpoint.bind`` says so, and the chart's NetworkPolicy admits only the release's
own pods.

Bounds: connections are held by one acceptor thread until their headers are whole and only then handed to a
fixed pool of ``workers`` (:class:`_Server`), so idle connections and slow clients hold a file descriptor each
(at most ``max_connections``), not a thread, and are closed at their ``idle_timeout_s`` or
``header_timeout_s``; a body and an answer take at most ``read_timeout_s``; a client that goes away costs a
debug line, not a traceback. Each request is refused with a 4xx that names the key raising its limit past
``max_body_bytes``, ``max_n`` samples, ``max_tokens`` and ``max_prompt_tokens``; one engine call carries at
most ``max_batch_prompts`` requests.

One engine serves both the trainer and the endpoint, one call at a time (:class:`EngineGate`): a request
waits while the trainer generates or a refit loads weights, at most ``wait_timeout_s``, behind at most
``max_waiting`` others, and otherwise gets a 503 that says why; the trainer's calls go first. Requests that
wait together go to the engine as one call (:meth:`ChatEndpoint.sample`): a harness's concurrent rollouts
are sampled as a batch, as the trainer's own are. Each
request's prompt ids, sampled ids and logprobs are kept in a ring bounded in count and bytes
(:class:`RequestLog`) that the driver may drain through the actor.

The server is the standard library's HTTP request handler behind the acceptor and pool above (no dependency,
and none on vLLM); its owner (:class:`~trainer.generation.worker.GenerationWorker`) starts it and shuts it down
with itself.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import logging
import os
import queue
import secrets
import selectors
import socket
import threading
import time
import uuid
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler
from typing import Any

import torch

from trainer.config import EndpointConfig, GenerationConfig
from trainer.data.prompts import TurnEncoder, encode_prompt
from trainer.envs.tool_calls import HERMES, ToolCallParser, content_of, offer_tools, takes_tools
from trainer.generation import tool_parsers
from trainer.generation.base import Completion, GenerationEngine, SamplingParams

MAX_HEADER_BYTES = 64 * 2**10  # a request's line and headers; more is refused (431) before a worker sees it
# Token ids the continuations keep (int32: 128 MiB), the least recently used dropped first: a harness's
# rollouts in flight need only their last turn each (256 rollouts of 32k tokens fill a quarter of it).
CONTINUATION_TOKENS = 2**25

log = logging.getLogger(__name__)


class EndpointError(RuntimeError):
    """The endpoint cannot start (no token, address taken); the message is one line, for people."""


class Busy(Exception):
    """The engine is not free for a request (HTTP 503); the message says why."""


class BadRequest(Exception):
    """A request the endpoint cannot serve (HTTP 400); the message names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class _Conn:
    """One client connection: its socket, the bytes read from it and not yet handled, and until when it may
    stay open without a whole request's headers."""

    __slots__ = ("sock", "addr", "buf", "deadline", "started")

    def __init__(self, sock: socket.socket, addr: Any, buf: bytes, deadline: float, started: bool):
        self.sock, self.addr, self.buf, self.deadline, self.started = sock, addr, buf, deadline, started


def _headers_end(buf: bytes) -> bool:
    return b"\r\n\r\n" in buf or b"\n\n" in buf  # http.client reads bare newlines too


class _Reader:
    """A request's bytes: those the acceptor read first, then the socket's, all by one ``deadline``
    (``rfile`` for :class:`~http.server.BaseHTTPRequestHandler`: ``readline`` and ``read``). What is left after
    a request (a pipelined next one) goes back to the acceptor with the connection."""

    def __init__(self, sock: socket.socket, buf: bytes, deadline: float):
        self.sock, self.buf, self.deadline = sock, bytearray(buf), deadline

    def _fill(self) -> bool:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request was not read within its timeout")
        self.sock.settimeout(left)
        data = self.sock.recv(1 << 16)  # socket.timeout is a TimeoutError: the handler closes the connection
        self.buf += data
        return bool(data)

    def readline(self, limit: int = -1) -> bytes:
        while True:
            end = self.buf.find(b"\n") + 1
            if end and (limit < 0 or end <= limit):
                break
            if 0 <= limit <= len(self.buf):
                end = limit
                break
            if not self._fill():
                end = len(self.buf)
                break
        out = bytes(self.buf[:end])
        del self.buf[:end]
        return out

    def read(self, n: int) -> bytes:
        while len(self.buf) < n and self._fill():
            pass
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out


class _Writer:
    """``wfile``: unbuffered, every write sent whole (the socket's timeout bounds a client that never reads)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def write(self, data: bytes) -> int:
        self.sock.sendall(data)
        return len(data)

    def flush(self) -> None:
        pass


class _Server:
    """The endpoint's HTTP server: one acceptor thread and a fixed pool of workers, instead of the standard
    library's thread per connection. The acceptor holds every connection that has no whole request yet (a new
    one, a kept-alive one between requests, a slow client still sending its headers) in a selector, at the cost
    of a file descriptor and its bytes so far, and closes it at its deadline: ``idle_timeout_s`` without a byte,
    ``header_timeout_s`` from the first byte to the end of the headers. Only a connection whose headers have all
    arrived goes to a worker, which reads its body and answers within ``read_timeout_s``, then hands a
    kept-alive connection back. So idle and slow clients cannot hold the workers, and connections past
    ``max_connections`` are closed as soon as they are accepted."""

    # The listen backlog: the standard library's 5 overflows when a harness opens dozens of connections at
    # once, and a connection the kernel drops waits a second for its retried SYN.
    request_queue_size = 1024

    def __init__(self, host: str, port: int, handler: type[BaseHTTPRequestHandler], cfg: EndpointConfig):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET  # a pod IP (or bind) in an IPv6 cluster
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(self.request_queue_size)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self.socket, self.handler, self.cfg = sock, handler, cfg
        self.server_address = sock.getsockname()
        self.refused = 0  # connections closed on accepting: max_connections were open
        self.timed_out = 0  # connections closed at their idle or header deadline
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()  # a worker hands a connection back; shutdown
        self._wake_r.setblocking(False)
        self._returned: collections.deque[_Conn] = collections.deque()
        self._ready: queue.SimpleQueue[_Conn | None] = queue.SimpleQueue()  # whole headers, for a worker
        self._lock = threading.Lock()
        self._open = 0
        self._active: set[_Conn] = set()  # connections a worker holds
        self._stopping = False
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        self._selector.register(self.socket, selectors.EVENT_READ, "accept")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._threads = [threading.Thread(target=self._accept_loop, name="kuberl-endpoint", daemon=True)]
        self._threads += [
            threading.Thread(target=self._work, name=f"kuberl-endpoint-worker-{i}", daemon=True)
            for i in range(self.cfg.workers)
        ]
        for t in self._threads:
            t.start()

    def shutdown(self, grace_s: float = 5.0) -> None:
        """Stop accepting, close every connection, end the threads (a worker still in the engine ends when its
        call does: it is a daemon, and the gate is already closed to whatever would follow)."""
        with self._lock:
            self._stopping = True
            active = list(self._active)
        self._wake()
        for conn in active:  # a worker reading or writing returns at once
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for _ in range(self.cfg.workers):
            self._ready.put(None)
        deadline = time.monotonic() + grace_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        # What no thread took any more: handed back, or queued for a worker as the pool ended.
        left = list(self._returned)
        self._returned.clear()
        while not self._ready.empty():
            queued = self._ready.get_nowait()
            if queued is not None:
                left.append(queued)
        for conn in left:
            self._close(conn)
        self._wake_r.close()
        self._wake_w.close()

    @property
    def open_connections(self) -> int:
        with self._lock:
            return self._open

    # -- the acceptor ----------------------------------------------------------------------------------

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:  # its buffer is full: a wake-up is pending anyway
            pass

    def _accept_loop(self) -> None:
        sweep = time.monotonic()
        try:
            while not self._stopping:
                for key, _ in self._selector.select(timeout=0.25):
                    if key.data == "accept":
                        self._accept()
                    elif key.data == "wake":
                        self._take_back()
                    else:
                        self._receive(key.data)
                now = time.monotonic()
                if now - sweep >= 0.25:
                    sweep = now
                    self._expire(now)
        finally:
            for key in list(self._selector.get_map().values()):
                if isinstance(key.data, _Conn):
                    self._close(key.data)
            self._selector.close()
            self.socket.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of file descriptors, or the client reset it already
                log.debug("generation.endpoint: accept failed: %s", e)
                return
            with self._lock:
                full = self._open >= self.cfg.max_connections
                if not full:
                    self._open += 1
            if full:
                self.refused += 1
                sock.close()
                continue
            sock.setblocking(False)
            conn = _Conn(sock, addr, b"", time.monotonic() + self.cfg.idle_timeout_s, started=False)
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _receive(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client went away
            self._selector.unregister(conn.sock)
            self._close(conn)
            return
        conn.buf += data
        self._check(conn, registered=True)

    def _check(self, conn: _Conn, registered: bool) -> None:
        """A connection with bytes: to a worker once its headers are whole; refused once they are too long."""
        if conn.buf and not conn.started:
            conn.started = True
            conn.deadline = time.monotonic() + self.cfg.header_timeout_s
        if _headers_end(conn.buf[: MAX_HEADER_BYTES + 2]):
            if registered:
                self._selector.unregister(conn.sock)
            self._ready.put(conn)
        elif len(conn.buf) > MAX_HEADER_BYTES:
            if registered:
                self._selector.unregister(conn.sock)
            self._reply_and_close(conn, 431, f"the request's headers are over {MAX_HEADER_BYTES} bytes")
        elif not registered:
            self._selector.register(conn.sock, selectors.EVENT_READ, conn)

    def _take_back(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        while self._returned:
            conn = self._returned.popleft()
            conn.sock.setblocking(False)
            conn.started = False
            conn.deadline = time.monotonic() + self.cfg.idle_timeout_s
            self._check(conn, registered=False)

    def _expire(self, now: float) -> None:
        for key in list(self._selector.get_map().values()):
            conn = key.data
            if isinstance(conn, _Conn) and conn.deadline <= now:
                self._selector.unregister(conn.sock)
                self.timed_out += 1
                if conn.started:  # headers begun and not finished in time: say so
                    self._reply_and_close(
                        conn,
                        408,
                        "the request's headers did not arrive within "
                        f"generation.endpoint.header_timeout_s={self.cfg.header_timeout_s:g}s",
                    )
                else:
                    self._close(conn)

    def _reply_and_close(self, conn: _Conn, status: int, message: str) -> None:
        """A last answer, sent only as far as the socket takes it at once (the client may not be reading)."""
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": None}})
        reason = {408: "Request Timeout", 431: "Request Header Fields Too Large"}[status]
        data = (
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n{body}"
        ).encode()
        try:
            conn.sock.send(data)
        except OSError:
            pass
        self._close(conn)

    def _close(self, conn: _Conn) -> None:
        try:
            conn.sock.close()
        finally:
            with self._lock:
                self._open -= 1

    # -- the workers -----------------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            conn = self._ready.get()
            if conn is None:
                return
            with self._lock:
                if self._stopping:
                    conn.sock.close()
                    self._open -= 1
                    continue
                self._active.add(conn)
            keep = False
            try:
                keep = self._serve(conn)
            except OSError as e:  # the client went away (a broken pipe, a reset) or stopped sending: one line
                log.debug("generation.endpoint: connection from %s ended: %s", conn.addr, e)
            except Exception as e:  # a fault of ours: one line, and the worker lives on
                log.warning("generation.endpoint: a request failed: %s: %s", type(e).__name__, e)
            with self._lock:
                self._active.discard(conn)
                keep = keep and not self._stopping
                if keep:
                    self._returned.append(conn)
            if keep:
                self._wake()
            else:
                self._close(conn)

    def _serve(self, conn: _Conn) -> bool:
        """One request on ``conn``; whether the connection stays open for another."""
        conn.sock.setblocking(True)
        handler = self.handler(conn, conn.addr, self)  # type: ignore[arg-type]  # serves it in its constructor
        conn.buf = bytes(handler.rfile.buf)  # type: ignore[attr-defined]  # a _Reader (_handler's setup)
        return not handler.close_connection


class EngineGate:
    """One engine, two kinds of callers, one call at a time: the trainer's own calls (generation, refits),
    which wait as long as they must and go first, and the endpoint's requests, which wait at most
    ``wait_timeout_s``, behind at most ``max_waiting`` others."""

    def __init__(self, max_waiting: int = 16, wait_timeout_s: float = 300):
        self.max_waiting, self.wait_timeout_s = max_waiting, wait_timeout_s
        self._cond = threading.Condition()
        self._busy = False
        self._waiting = 0  # requests waiting
        self._trainer_waiting = 0
        self._closed = False

    @contextmanager
    def trainer(self) -> Iterator[None]:
        with self._cond:
            self._trainer_waiting += 1
            try:
                while self._busy:
                    self._cond.wait()
            finally:
                self._trainer_waiting -= 1
            self._busy = True
        try:
            yield
        finally:
            self._release()

    @contextmanager
    def request(self, served: threading.Event | None = None) -> Iterator[bool]:
        """The engine for one request: yields True holding it, or False, without it, once ``served`` is set
        (another request's call took this one along, :meth:`ChatEndpoint.sample`); set ``served`` before
        releasing the engine, whose release wakes the waiters."""
        with self._cond:
            if self._closed:
                raise Busy("the endpoint is shutting down")
            if (self._busy or self._trainer_waiting) and self._waiting >= self.max_waiting:
                raise Busy(
                    f"{self._waiting} requests already wait for the engine "
                    "(generation.endpoint.max_waiting); retry later"
                )
            self._waiting += 1
            try:
                deadline = time.monotonic() + self.wait_timeout_s
                while (self._busy or self._trainer_waiting) and not self._closed:
                    if served is not None and served.is_set():
                        break
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise Busy(
                            "the engine stayed busy with training's own generation or a weight refit for "
                            f"generation.endpoint.wait_timeout_s={self.wait_timeout_s:g}s; retry later"
                        )
                    self._cond.wait(left)
                if served is not None and served.is_set():
                    holds = False
                elif self._closed:
                    raise Busy("the endpoint is shutting down")
                else:
                    self._busy = holds = True
            finally:
                self._waiting -= 1
        try:
            yield holds
        finally:
            if holds:
                self._release()

    def close(self) -> None:
        """Turn away every waiting and later request (the trainer's calls still pass)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _release(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()


@dataclass
class _Job:
    """One request's share of an engine call: its prompt, and what the call gave it."""

    prompt: list[int]
    n: int
    params: SamplingParams
    served: threading.Event = field(default_factory=threading.Event)
    samples: list[Completion] | None = None
    error: BaseException | None = None

    def joins(self, other: _Job) -> bool:
        """Whether one engine call can carry both: the same n and sampling arguments, seeded or not alike."""
        return (
            self.n == other.n
            and replace(self.params, seed=None) == replace(other.params, seed=None)
            and (self.params.seed is None) == (other.params.seed is None)
        )


class RequestLog:
    """The last ``limit`` requests' tokens, at most ``max_bytes`` of them (each record's JSON size), oldest
    dropped first, for the driver to drain (:meth:`ChatEndpoint.drain_requests`). Nothing in the training loop
    drains it today (env.verifiers trains on the answers its harness kept), so the bounds are what keeps it
    from growing with every request a harness sends."""

    def __init__(self, limit: int, max_bytes: int):
        self.limit, self.max_bytes = limit, max_bytes
        self._records: collections.deque[tuple[dict, int]] = collections.deque()
        self._lock = threading.Lock()
        self.bytes = 0  # the records' JSON size, now
        self.dropped = 0  # records pushed out (or too large to keep) before anyone drained them

    def add(self, record: dict) -> None:
        size = len(json.dumps(record, default=str))
        with self._lock:
            if size > self.max_bytes:
                self.dropped += 1
                return
            self._records.append((record, size))
            self.bytes += size
            while len(self._records) > self.limit or self.bytes > self.max_bytes:
                _, gone = self._records.popleft()
                self.bytes -= gone
                self.dropped += 1

    def drain(self) -> list[dict]:
        with self._lock:
            out = [record for record, _ in self._records]
            self._records.clear()
            self.bytes = 0
            return out


class Continuations:
    """What the endpoint sampled, by the conversation each sample ends (a digest of the request's messages,
    tools and the assistant message returned): the prompt ids and sampled ids, up to ``max_tokens`` ids in
    all, the least recently used dropped first. A conversation two samples ended alike with different ids
    is marked ambiguous (counted as one id): continuing either would train on ids the harness's next turn
    may not follow."""

    def __init__(self, max_tokens: int = CONTINUATION_TOKENS):
        self.max_tokens = max_tokens
        # key -> (prompt + sampled ids, how many of them were sampled, the request's id); None: ambiguous
        self._entries: collections.OrderedDict[bytes, tuple[array, int, str] | None] = (
            collections.OrderedDict()
        )
        self._tokens = 0
        self._lock = threading.Lock()

    def add(self, key: bytes, prompt: list[int], sampled: list[int], rid: str) -> None:
        ids = array("i", prompt + sampled)
        with self._lock:
            if key in self._entries:
                held = self._entries[key]
                if held is not None and held[0] != ids:
                    self._tokens -= len(held[0]) - 1
                    self._entries[key] = None
                self._entries.move_to_end(key)
                return
            if len(ids) > self.max_tokens:
                return  # over the whole budget: a later turn of it is rendered whole
            self._entries[key] = (ids, len(sampled), rid)
            self._tokens += len(ids)
            while self._tokens > self.max_tokens:
                _, old = self._entries.popitem(last=False)
                self._tokens -= len(old[0]) if old is not None else 1

    def find(self, key: bytes) -> tuple[list[int], list[int], str] | str:
        """(prompt ids, sampled ids, the request's id) of the sample that ended this conversation, or why none."""
        with self._lock:
            if key not in self._entries:
                return (
                    "no sample of this endpoint ends the conversation so far (the harness changed an earlier "
                    "message or the assistant's, or it was dropped to keep the map within "
                    f"{self.max_tokens} tokens)"
                )
            self._entries.move_to_end(key)
            held = self._entries[key]
        if held is None:
            return "two samples ended the conversation so far with the same message and different ids"
        ids, sampled, rid = held
        cut = len(ids) - sampled
        return ids[:cut].tolist(), ids[cut:].tolist(), rid

    def __len__(self) -> int:
        return len(self._entries)


def _canonical(message: dict) -> str:
    """A message as the conversation's digest reads it: every field the harness sent (an earlier request's
    messages come back as they were)."""
    return json.dumps(message, sort_keys=True, default=str)


def _answered(message: dict) -> str:
    """An assistant message as the endpoint returns it and a harness sends it back: its text (None and "" alike)
    and its tool calls' ids, names and arguments (a JSON string or the object), nothing else."""
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        calls.append([call.get("id"), fn.get("name"), args])
    return json.dumps([message.get("content") or "", calls], sort_keys=True, default=str)


def _conversation_key(tools: list | None, history: list[dict], answer: dict) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(tools or None, sort_keys=True, default=str).encode())
    for m in history:  # json.dumps escapes newlines: the separator is unambiguous
        h.update(b"\n" + _canonical(m).encode())
    h.update(b"\n\n" + _answered(answer).encode())
    return h.digest()


MIN_TOKEN_CHARS = 16
_generated: str | None = None  # this process's own token, when $token_env holds none
_generated_lock = threading.Lock()


def read_token(env: str) -> str:
    """The endpoint's bearer token: ``$env`` (``generation.endpoint.token_env``), else one made at random
    once per process. The driver calls it before it starts the generation actors and hands them the same
    token with their arguments (:class:`~trainer.generation.placement.DisaggregatedGenerator`), as it reads
    their addresses back, so its in-process callers (env.verifiers) hold it and nobody else does. Never Ray's
    token: whoever may call the endpoint must not be able to submit Ray jobs (EndpointError otherwise)."""
    global _generated
    token = os.environ.get(env, "")
    if not token:
        with _generated_lock:
            if _generated is None:
                _generated = secrets.token_urlsafe(32)
            token = _generated
    check_token(token, f"${env}")
    return token


def check_token(token: str, where: str) -> None:
    """EndpointError unless ``token`` is long enough and is not Ray's (``$RAY_AUTH_TOKEN``)."""
    if len(token) < MIN_TOKEN_CHARS:
        raise EndpointError(
            f"generation.endpoint: the token in {where} has {len(token)} characters, fewer than "
            f"{MIN_TOKEN_CHARS}; set a random one (python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    ray_token = os.environ.get("RAY_AUTH_TOKEN", "")
    if ray_token and hmac.compare_digest(token.encode(), ray_token.encode()):
        raise EndpointError(
            f"generation.endpoint: the token in {where} is Ray's ($RAY_AUTH_TOKEN); the endpoint needs a token "
            "of its own (unset it for a random one per run, or set another in generation.endpoint.token_env)"
        )


def bind_address(bind: str | None) -> str:
    """``generation.endpoint.bind``, else the pod's own address ($POD_IP), else the loopback."""
    return bind or os.environ.get("POD_IP") or "127.0.0.1"


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or OpenAI's list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise BadRequest(f"{where}: only text content parts are supported", where)
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(f"{where} must be a string or a list of text parts", where)


def _messages(raw: Any) -> list[dict]:
    """OpenAI messages as chat templates take them: text content, tool-call arguments as objects."""
    if not isinstance(raw, list) or not raw:
        raise BadRequest("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a role", f"messages[{i}]")
        msg = {k: v for k, v in m.items() if v is not None}
        msg["content"] = _text(m.get("content"), f"messages[{i}].content")
        calls = []
        for call in m.get("tool_calls") or []:
            fn = dict(call.get("function") or {})
            args = fn.get("arguments")
            if isinstance(args, str):  # OpenAI sends a JSON string; templates render an object
                try:
                    fn["arguments"] = json.loads(args)
                except ValueError:
                    pass
            calls.append({**call, "function": fn})
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _int(body: dict, key: str, low: int, high: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
        bound = f"an integer >= {low}" + (f" and <= {high}" if high else "")
        raise BadRequest(f"{key}={value!r} must be {bound}", key)
    return value


def _float(body: dict, key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise BadRequest(f"{key}={value!r} must be a number in [{low:g}, {high:g}]", key)
    return float(value)


class ChatEndpoint:
    """The endpoint over ``engine``; :meth:`start` listens, :meth:`shutdown` stops listening for good."""

    def __init__(
        self,
        engine: GenerationEngine,
        tokenizer,
        gen: GenerationConfig,
        model_name: str,
        max_model_len: int | None = None,
        gate: EngineGate | None = None,
        token: str | None = None,
        tool_parser: str = HERMES,
    ):
        """``token``: the bearer token requests must carry (the driver's, handed to the actor); None: the
        endpoint's own, from :func:`read_token`. ``tool_parser``: env.tool_parser, the family's format that the
        answers' tool calls are read in (:mod:`trainer.generation.tool_parsers`)."""
        cfg: EndpointConfig = gen.endpoint
        self._token = token
        self.engine, self.tokenizer, self.gen, self.cfg = engine, tokenizer, gen, cfg
        self.model_name, self.max_model_len = model_name, max_model_len
        self.gate = gate or EngineGate(cfg.max_waiting, cfg.wait_timeout_s)
        self.log = RequestLog(cfg.record_limit, cfg.record_bytes)
        self.continuations = Continuations()
        self.continued = 0  # requests prompted from the ids sampled for an earlier one
        self.unmatched = 0  # requests whose last assistant message no sample here ended: rendered whole
        self._unmatched_logged = False
        self._counts_lock = threading.Lock()  # the counters and the encoders, from the server's threads
        self._encoders: collections.OrderedDict[str, TurnEncoder] = collections.OrderedDict()
        self.tool_parser = tool_parser
        self._parsers: collections.OrderedDict[str, ToolCallParser] = collections.OrderedDict()
        self.takes_tools = takes_tools(tokenizer)  # whether the chat template renders tools= itself
        # The owner's intra-op threads: a request runs the engine from a server thread, whose OpenMP
        # team would otherwise take every core (and vLLM's CPU attention checks it against its plan).
        self.threads = torch.get_num_threads()
        self._server: _Server | None = None
        self._jobs: list[_Job] = []  # requests waiting for the engine, oldest first
        self._jobs_lock = threading.Lock()

    # -- serving ---------------------------------------------------------------------------------------

    def start(self, port: int | None = None) -> tuple[str, int]:
        """Listen on ``bind_address`` at the first free port of ``port`` (default ``cfg.port``) ..
        ``port + cfg.ports - 1`` (the engines of one pod take consecutive ports); returns (host, port)."""
        if self._token is None:
            self._token = read_token(self.cfg.token_env)
        check_token(
            self._token, "the token handed to the endpoint"
        )  # before binding: nothing listens without
        host = bind_address(self.cfg.bind)
        first = self.cfg.port if port is None else port
        candidates = [0] if first == 0 else list(range(first, first + self.cfg.ports))
        handler = _handler(self, self._token.encode())
        for p in candidates:
            try:
                server = _Server(host, p, handler, self.cfg)
                break
            except OSError as e:
                last = e
        else:
            raise EndpointError(
                f"generation.endpoint: no free port on {host} in {first}-{candidates[-1]} ({last.strerror}); "
                "raise generation.endpoint.ports or choose another generation.endpoint.port"
            )
        self._server = server
        server.start()
        return self.address

    @property
    def token(self) -> str | None:
        """The bearer token requests must carry (set by :meth:`start`), for in-process callers."""
        return self._token

    @property
    def address(self) -> tuple[str, int]:
        assert self._server is not None, "the endpoint is not started"
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def shutdown(self) -> None:
        """Stop listening and turn away waiting requests; idempotent."""
        self.gate.close()
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()

    def drain_requests(self) -> list[dict]:
        """Every request recorded since the last drain: ``prompt_token_ids`` and per choice ``token_ids``,
        ``logprobs`` and ``finish_reason`` (plus the request's ``id``, ``created``, ``messages``, ``tools``, and
        ``extends``: the id of the earlier request whose sampled ids its prompt continues, or None)."""
        return self.log.drain()

    # -- one request -----------------------------------------------------------------------------------

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "kuberl"}]}

    def chat(self, body: Any) -> dict:
        """One chat completion (OpenAI's response, plus ``prompt_token_ids`` and each choice's ``token_ids``)."""
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        if body.get("stream"):
            raise BadRequest("stream=true is not supported", "stream")
        if body.get("top_logprobs"):
            raise BadRequest(
                "top_logprobs is not supported (logprobs=true gives each sampled token's)", "top_logprobs"
            )
        messages = _messages(body.get("messages"))
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise BadRequest("tools must be a list", "tools")
        params, n = self._params(body)
        prompt, extends = self._prompt(messages, tools)
        if len(prompt) > self.cfg.max_prompt_tokens:
            raise BadRequest(
                f"the prompt's {len(prompt)} tokens are over the limit of {self.cfg.max_prompt_tokens} a request "
                "(generation.endpoint.max_prompt_tokens)",
                "messages",
            )
        if self.max_model_len is not None and len(prompt) + params.max_new_tokens > self.max_model_len:
            raise BadRequest(
                f"the prompt ({len(prompt)} tokens) plus max_tokens ({params.max_new_tokens}) is over the "
                f"engine's {self.max_model_len} tokens",
                "max_tokens",
            )
        samples = self.sample(prompt, n, params)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        want_logprobs = bool(body.get("logprobs"))
        choices = [self._choice(j, c, want_logprobs, tools) for j, c in enumerate(samples)]
        for choice, c in zip(choices, samples):  # what a later turn of the conversation continues from
            key = _conversation_key(tools, messages, choice["message"])
            self.continuations.add(key, prompt, c.token_ids, rid)
        self.log.add(
            {
                "id": rid,
                "created": created,
                "messages": messages,
                "tools": tools,
                "prompt_token_ids": prompt,
                "extends": extends,  # the earlier request whose sampled ids the prompt continues, if any
                "choices": [
                    {"token_ids": c.token_ids, "logprobs": c.logprobs, "finish_reason": c.finish_reason}
                    for c in samples
                ],
            }
        )
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": sum(len(c.token_ids) for c in samples),
                "total_tokens": len(prompt) * len(samples) + sum(len(c.token_ids) for c in samples),
            },
            "prompt_token_ids": prompt,
        }

    def _prompt(self, messages: list[dict], tools: list | None) -> tuple[list[int], str | None]:
        """The request's prompt ids, and the id of the earlier request they continue (module docstring), if any."""
        offered = bool(tools) and not self.takes_tools  # as a run offers them: in the system turn
        last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
        if last is not None:
            found = self.continuations.find(_conversation_key(tools, messages[:last], messages[last]))
            if isinstance(found, str):
                self._unmatched(found)
            else:
                prompt, sampled, rid = found
                history = offer_tools(messages[:last], tools or []) if offered else messages[:last]
                try:
                    glue = self._encoder(None if offered else tools).continuation(
                        history, messages[last + 1 :], sampled
                    )
                except Exception as e:  # a template that refuses the glue alone: the whole conversation
                    self._unmatched(f"the chat template cannot render the messages after it alone ({e})")
                else:
                    with self._counts_lock:
                        self.continued += 1
                    return prompt + sampled + glue, rid
        shown = offer_tools(messages, tools or []) if offered else messages
        try:
            ids = encode_prompt(
                self.tokenizer, shown, self.gen.chat_template_kwargs, None if offered else tools
            )
        except Exception as e:  # the template's own complaint (a role it does not know, a missing field)
            raise BadRequest(f"the chat template cannot render these messages: {e}", "messages") from None
        return ids, None

    def _encoder(self, tools: list | None) -> TurnEncoder:
        """The glue encoder for these tools (a harness offers the same ones every turn: a few are kept)."""
        key = json.dumps(tools or None, sort_keys=True, default=str)
        with self._counts_lock:
            enc = self._encoders.get(key)
            if enc is None:
                enc = TurnEncoder(self.tokenizer, self.gen.chat_template_kwargs, tools or None)
                self._encoders[key] = enc
                if len(self._encoders) > 8:
                    self._encoders.popitem(last=False)
            self._encoders.move_to_end(key)
        return enc

    def _unmatched(self, why: str) -> None:
        with self._counts_lock:
            self.unmatched += 1
            first, self._unmatched_logged = not self._unmatched_logged, True
        if first:
            log.warning(
                "generation.endpoint: a request's last assistant message is none it can continue from (%s); its "
                "prompt renders the whole conversation again, so its turn may not extend the sample of the turns "
                "before it (logged once; ChatEndpoint.unmatched counts them)",
                why,
            )

    def sample(self, prompt: list[int], n: int, params: SamplingParams) -> list[Completion]:
        """``n`` samples of ``prompt``. Requests that wait for the engine together go to it as one call: the
        request that gets the engine takes along every waiting request its call can carry (:meth:`_Job.joins`,
        at most ``generation.endpoint.max_batch_prompts`` prompts), so a harness's concurrent rollouts are sampled as one batch, as the
        trainer's own are, instead of one after another. A batch's seeded requests draw from their own seeds
        (``SamplingParams.seeds``), so on vLLM a request draws alike alone or batched."""
        job = _Job(prompt, n, params)
        with self._jobs_lock:
            self._jobs.append(job)
        try:
            with self.gate.request(job.served) as holds:
                if holds and not job.served.is_set():
                    self._run(self._take(job))
        except Busy:
            with self._jobs_lock:
                if job in self._jobs:  # no call took it: turned away
                    self._jobs.remove(job)
                    raise
            job.served.wait()  # a call took it along after all
        if job.error is not None:
            raise job.error
        assert job.samples is not None
        return job.samples

    def _take(self, job: _Job) -> list[_Job]:
        """``job`` and the waiting requests one call can carry with it, taken off the queue."""
        with self._jobs_lock:
            batch = [job]
            for other in self._jobs:
                if len(batch) == self.cfg.max_batch_prompts:
                    break
                if other is not job and other.joins(job):
                    batch.append(other)
            self._jobs = [j for j in self._jobs if all(j is not b for b in batch)]
        return batch

    def _run(self, batch: list[_Job]) -> None:
        """One engine call for ``batch`` (the engine held); every job served, with its samples or the error."""
        first = batch[0]
        params = first.params
        if len(batch) > 1 and params.seed is not None:  # each its own seed, whatever the call holds beside it
            params = replace(
                params, seed=None, seeds=[j.params.seed for j in batch if j.params.seed is not None]
            )
        try:
            torch.set_num_threads(self.threads)
            out = self.engine.generate([j.prompt for j in batch], first.n, params)
            for j, samples in zip(batch, out):
                j.samples = samples
        except BaseException as e:  # every request of the call answers with it
            for j in batch:
                j.error = e
            raise
        finally:
            for j in batch:
                j.served.set()

    def _params(self, body: dict) -> tuple[SamplingParams, int]:
        gen = self.gen
        cfg = self.cfg
        n = _int(body, "n", 1) or 1
        if n > cfg.max_n:
            raise BadRequest(
                f"n={n} is over the limit of {cfg.max_n} samples a request (generation.endpoint.max_n)", "n"
            )
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _int(body, key, 1)
        if max_tokens is not None and max_tokens > cfg.max_tokens:
            raise BadRequest(
                f"{key}={max_tokens} is over the limit of {cfg.max_tokens} tokens a request "
                "(generation.endpoint.max_tokens)",
                key,
            )
        temperature = _float(body, "temperature", 0.0, 2.0)
        top_p = _float(body, "top_p", 0.0, 1.0)
        if top_p == 0.0:
            raise BadRequest("top_p=0 must be in (0, 1]", "top_p")
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise BadRequest(f"seed={seed!r} must be an integer", "seed")
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
            raise BadRequest("stop must be a string or a list of non-empty strings", "stop")
        params = SamplingParams(
            max_new_tokens=max_tokens or min(gen.max_new_tokens, cfg.max_tokens),
            temperature=gen.temperature if temperature is None else temperature,
            top_p=gen.top_p if top_p is None else top_p,
            top_k=gen.top_k,
            stop_strings=list(gen.stop_strings) if stop is None else stop,
            seed=seed,
        )
        return params, n

    def _parser(self, tools: list | None) -> ToolCallParser:
        """The run's tool parser (env.tool_parser) for these tools; a few are kept, as the encoders."""
        key = json.dumps(tools or None, sort_keys=True, default=str)
        with self._counts_lock:
            parser = self._parsers.get(key)
            if parser is None:
                parser = tool_parsers.build(self.tool_parser, self.tokenizer, tools or None)
                self._parsers[key] = parser
                if len(self._parsers) > 8:
                    self._parsers.popitem(last=False)
            self._parsers.move_to_end(key)
        return parser

    def _choice(self, index: int, c: Completion, want_logprobs: bool, tools: list | None = None) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        finish = c.finish_reason
        # Hermes reads the text; another family's parser reads the turn with its special tokens kept (some
        # families' call markers are special tokens: Completion.raw_text), as the environments do.
        parser = self._parser(tools)
        if isinstance(parser, tool_parsers.VLLMToolParser):
            calls, errors, content = parser.read(c.raw_text if c.raw_text is not None else c.text)
        else:
            calls, errors = parser.parse(c.text)
            content = content_of(c.text)
        if calls and not errors:  # a malformed call stays text: the harness sees what the model wrote
            message["content"] = content or None
            message["tool_calls"] = [
                {
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])},
                }
                for call in calls
            ]
            if finish == "stop":
                finish = "tool_calls"
        logprobs = None
        if want_logprobs:
            logprobs = {
                "content": [
                    {"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []}
                    for tok, lp in zip(self._pieces(c.token_ids), c.logprobs)
                ]
            }
        return {
            "index": index,
            "message": message,
            "finish_reason": finish,
            "logprobs": logprobs,
            "token_ids": c.token_ids,
        }

    def _pieces(self, ids: list[int]) -> list[str]:
        """Each token's own text (special tokens included: they are what was sampled)."""
        return [self.tokenizer.decode([i], skip_special_tokens=False) for i in ids]


def _handler(endpoint: ChatEndpoint, token: bytes) -> type[BaseHTTPRequestHandler]:
    expected = b"Bearer " + token

    cfg = endpoint.cfg

    class Handler(BaseHTTPRequestHandler):
        """One request on a connection :class:`_Server` hands it (headers whole), read and answered within
        ``read_timeout_s``; the connection goes back to the acceptor after, unless it is to close."""

        protocol_version = "HTTP/1.1"  # keep-alive: an OpenAI client reuses its connection
        server_version = "kuberl"

        def setup(self) -> None:
            conn: _Conn = self.request  # _Server passes its _Conn
            self.connection = conn.sock
            deadline = time.monotonic() + cfg.read_timeout_s
            self.rfile = _Reader(conn.sock, conn.buf, deadline)  # type: ignore[assignment]  # readline, read
            self.wfile = _Writer(conn.sock)  # type: ignore[assignment]  # write, flush

        def handle(self) -> None:
            self.close_connection = True
            self.handle_one_request()

        def finish(self) -> None:
            pass  # the server closes the connection, or keeps it for the next request

        def log_message(self, format: str, *args: Any) -> None:
            pass  # a harness sends thousands of requests; the request log is what the driver reads

        def _send(self, status: int, payload: dict, headers: dict[str, str] | None = None) -> None:
            data = json.dumps(payload).encode()
            self.connection.settimeout(cfg.read_timeout_s)  # a client that never reads its answer
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def _error(
            self, status: int, kind: str, message: str, param: str | None = None, **headers: str
        ) -> None:
            body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
            self._send(status, body, {k.replace("_", "-"): v for k, v in headers.items()})

        def _authorized(self) -> bool:
            given = self.headers.get("Authorization", "").encode()
            if hmac.compare_digest(given, expected):
                return True
            self._error(
                401,
                "authentication_error",
                "a valid 'Authorization: Bearer <token>' header is required",
                WWW_Authenticate="Bearer",
            )
            return False

        def do_GET(self) -> None:
            if not self._authorized():
                return
            if self.path.rstrip("/") == "/v1/models":
                self._send(200, endpoint.models())
            else:
                self._error(404, "not_found", f"no route GET {self.path}")

        def do_POST(self) -> None:
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if not self._authorized():
                self.close_connection = True  # the body is not read: the connection cannot be reused
                return
            if self.path.rstrip("/") != "/v1/chat/completions":
                self.close_connection = True
                self._error(404, "not_found", f"no route POST {self.path}")
                return
            if length < 0:
                self.close_connection = True
                self._error(400, "invalid_request_error", "Content-Length must be a number of bytes")
                return
            if length > cfg.max_body_bytes:
                self.close_connection = True  # the body is not read
                self._error(
                    413,
                    "invalid_request_error",
                    f"the body's {length} bytes are over the limit of {cfg.max_body_bytes} "
                    "(generation.endpoint.max_body_bytes)",
                )
                return
            data = self.rfile.read(length)
            if len(data) < length:  # the client closed before its whole body
                self.close_connection = True
                return
            try:
                body = json.loads(data or b"null")
            except ValueError as e:
                self._error(400, "invalid_request_error", f"the body is not JSON: {e}")
                return
            try:
                self._send(200, endpoint.chat(body))
            except BadRequest as e:
                self._error(400, "invalid_request_error", str(e), e.param)
            except Busy as e:
                self._error(503, "engine_busy", str(e), Retry_After="5")
            except Exception as e:  # the engine failed: the request gets the reason, the server lives on
                self._error(500, "server_error", f"{type(e).__name__}: {e}")

    return Handler
