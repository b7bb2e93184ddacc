"""A reward model served over HTTP as a reward: ``{name: reward_server, weight: w}`` in ``env.reward_functions``,
scored by a server the run does not start, vLLM's pooling server (``vllm serve MODEL --runner pooling``; the
chart's reward-server Deployment), as OpenRLHF's ``--remote_rm_url`` and verl's reward servers score.

What the server reads is what the in-process reward model reads (:func:`trainer.rewards.reward_model.encode`):
the prompt's messages and the response, rendered by the reward model's own tokenizer and chat template
(``reward_server.tokenizer``, by default ``reward_server.model``) and sent as token ids, which vLLM scores as
they are (no re-tokenisation, no special tokens added). A response that writes ``<|im_end|>\\n<|im_start|>user``
therefore reaches the model as that text, never as a forged turn; sending text instead would let the server's
tokenizer read it as control tokens. ``reward_server.kind`` names the endpoint: ``classify`` (``POST /classify``)
or ``pooling`` (``POST /pooling``), each asked with ``use_activation: false`` for the raw logit of the one label
(vLLM's default would pass it through a sigmoid). Scores are raw, as the in-process reward model's by default.

Checked at start, on the driver, before Ray starts (:func:`check`; the run calls it through the component,
:mod:`trainer.components`), each failure one line naming the key and the fix:

- the bearer token is in ``$reward_server.api_key_env`` and the server takes it: ``GET /v1/models`` answers within
  ``reward_server.start_timeout_s`` on a cluster (its pod may still load the model; locally it asks once), and
  lists ``reward_server.model``;
- the scoring endpoint refuses a request without the token. vLLM 0.32's ``--api-key`` guards only paths under
  ``/v1``, ``/v2``, ``/inference`` and ``/cohere``: ``/classify`` and ``/pooling`` answer anyone. A server started
  with ``--middleware trainer.rewards.reward_server.RequireToken`` (:class:`RequireToken`) asks for the token on
  every path; without it the run is refused unless ``reward_server.allow_unauthenticated`` says the network
  admits the run's pods alone;
- the server renders a probe conversation into the same tokens as the local tokenizer (a tokenizer that is not
  the served model's would score every sample on ids the model never learned, silently);
- with ``reward_server.batch_invariant`` (the default), a probe sequence scores the same, bit for bit, alone and
  beside longer sequences in one request: a server whose batching moves scores by rounding would make GRPO
  advantages out of identical responses.

Scoring (:class:`RewardServerWorker`, one Ray actor of no CPU, an HTTP client): each distinct sequence of a batch
once (the reward runner already sends each distinct (prompt, response) of a chunk once), ``reward_server.batch_size``
sequences a request, ``reward_server.concurrency`` requests at once. On the CPU build of vLLM 0.32 a sequence
scores the same bit for bit alone, beside longer ones in its request, and beside concurrent requests
(tests/rewards/test_reward_server.py); the check at start holds any other server to it. A sample longer than the
server's ``max_model_len`` is never sent (vLLM would refuse the whole request): it scores
``reward_server.overlong_score`` with a note.

Failure is bounded and loud. A request takes at most ``reward_server.timeout_s`` a read; a late answer is not
retried (the server got the request, and asking again doubles its load). A connection that fails, a 5xx or a
429 is retried ``reward_server.max_retries`` times with exponential backoff and jitter (``Retry-After``
honoured); any other 4xx is final. A sample whose request failed for good scores 0 with a note that counts
against ``env.reward_failure_budget``; a batch longer than ``env.reward_timeout_s`` scores 0 in the reward
runner; more than the budget of a step's samples ends the run in one line naming the cause
(:class:`~trainer.rewards.runner.RewardFailureError`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import secrets
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from trainer.config import ConfigError, RewardServerConfig, RewardSpec
from trainer.rewards import actors
from trainer.rewards.registry import REWARD_SERVER as NAME  # the env.reward_functions entry it scores
from trainer.rewards.reward_model import encode

__all__ = ["NAME", "RequireToken", "RewardServerPool", "RewardServerWorker", "check", "component", "used"]

BACKOFF_S = 0.5  # before the first retry; doubled each time, with jitter
MAX_BACKOFF_S = 8.0
RETRIED = frozenset({429, 500, 502, 503, 504})
CLIENT_CONCURRENCY = 4  # batches the client actor runs at once: a hung one does not hold up the next
OVERLONG = "too long for the reward server"  # how the note of a sample never sent starts (not a failure)
# The probe conversation of the checks at start: plain characters every tokenizer has.
PROBE = [{"role": "user", "content": "what is 2+2?"}]


def used(specs: list[RewardSpec]) -> bool:
    return actors.used(NAME, specs)


class ServerError(Exception):
    """A request that failed; ``retryable`` when asking again may help (a connection error, a 5xx, a 429)."""

    def __init__(self, message: str, retryable: bool, retry_after: float | None = None, status: int = 0):
        super().__init__(message)
        self.retryable, self.retry_after, self.status = retryable, retry_after, status


def _token(cfg: RewardServerConfig) -> str | None:
    return os.environ.get(cfg.api_key_env) or None


class Client:
    """Requests to the server at ``url`` with the bearer ``token``, bounded and retried (module docstring)."""

    def __init__(self, cfg: RewardServerConfig, token: str | None):
        self.cfg, self.token = cfg, token
        self.url = (cfg.url or "").rstrip("/")

    def once(self, method: str, path: str, body: Any = None, auth: bool = True) -> Any:
        """One request: the answer's JSON, or ServerError."""
        headers = {"Content-Type": "application/json"}
        if auth and self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.cfg.timeout_s) as answer:  # noqa: S310  (http(s) only)
                return json.loads(answer.read())
        except urllib.error.HTTPError as e:
            detail = e.read()[:300].decode(errors="replace").strip()
            after = e.headers.get("Retry-After") if e.headers else None
            retry_after = float(after) if after and after.replace(".", "", 1).isdigit() else None
            raise ServerError(
                f"HTTP {e.code} from {path}: {detail}", e.code in RETRIED, retry_after, e.code
            ) from None
        except TimeoutError:
            raise ServerError(
                f"{path} timed out after {self.cfg.timeout_s:g}s (reward_server.timeout_s)", False
            ) from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError):
                raise ServerError(
                    f"{path} timed out after {self.cfg.timeout_s:g}s (reward_server.timeout_s)", False
                ) from None
            raise ServerError(f"cannot reach {self.url}: {e.reason}", True) from None
        except (ConnectionError, OSError) as e:  # reset mid-answer
            raise ServerError(f"connection to {self.url} failed: {e}", True) from None
        except ValueError as e:
            raise ServerError(f"{path} answered no JSON ({e})", False) from None

    def request(self, method: str, path: str, body: Any = None) -> Any:
        """:meth:`once`, retried ``reward_server.max_retries`` times when it may help."""
        for attempt in itertools.count():
            try:
                return self.once(method, path, body)
            except ServerError as e:
                if not e.retryable or attempt >= self.cfg.max_retries:
                    tries = f" (after {attempt + 1} tries)" if attempt else ""
                    raise ServerError(f"{e}{tries}", False, status=e.status) from None
                wait = min(MAX_BACKOFF_S, BACKOFF_S * 2**attempt) * random.uniform(0.5, 1.0)  # noqa: S311
                time.sleep(min(MAX_BACKOFF_S, e.retry_after) if e.retry_after is not None else wait)
        raise AssertionError("unreachable")

    def score(self, seqs: list[list[int]]) -> list[float]:
        """The raw score of each token sequence, in order: (N sequences) -> N floats."""
        path = f"/{self.cfg.kind}"
        out = self.request("POST", path, {"model": self.cfg.model, "input": seqs, "use_activation": False})
        try:
            rows = sorted(out["data"], key=lambda row: row["index"])
            values = [row["probs"] if self.cfg.kind == "classify" else row["data"] for row in rows]
        except (KeyError, TypeError) as e:
            raise ServerError(f"{path} answered without {e} in each row of its data", False) from None
        if len(values) != len(seqs) or any(not isinstance(v, list) or len(v) != 1 for v in values):
            shapes = sorted({len(v) if isinstance(v, list) else -1 for v in values})
            raise ServerError(
                f"{path} answered {len(values)} rows of {shapes} values for {len(seqs)} sequences; a reward model "
                "is a sequence classifier with one label (one value a sequence)",
                False,
            )
        return [float(v[0]) for v in values]


# ----- the checks at start ------------------------------------------------------------------------------


def _tokenizer(cfg: RewardServerConfig) -> Any:
    from trainer.models import load_tokenizer

    return load_tokenizer(cfg.tokenizer or cfg.model or "", cfg.trust_remote_code)


def _served(client: Client, wait_s: float) -> dict:
    """The server's ``/v1/models`` entry of ``reward_server.model``, waiting up to ``wait_s`` for it to answer."""
    cfg = client.cfg
    deadline = time.monotonic() + wait_s
    while True:
        try:
            models = client.once("GET", "/v1/models")
            break
        except ServerError as e:
            if e.status in (401, 403):
                raise ConfigError(
                    f"reward_server.url={cfg.url}: the server refused the token in ${cfg.api_key_env} ({e}); put the "
                    f"server's key (its VLLM_API_KEY or --api-key) there"
                ) from None
            if not e.retryable or time.monotonic() >= deadline:
                raise ConfigError(
                    f"reward_server.url={cfg.url}: the reward server does not answer ({e}); start it (vllm serve "
                    f"MODEL --runner pooling, docs/rewards.md) or fix the URL"
                ) from None
            time.sleep(2.0)
    names = [m.get("id") for m in models.get("data", [])] if isinstance(models, dict) else []
    entry = next((m for m in models.get("data", []) if m.get("id") == cfg.model), None) if names else None
    if entry is None:
        raise ConfigError(
            f"reward_server.model={cfg.model}: the server at {cfg.url} serves {', '.join(map(str, names)) or 'nothing'}; "
            "set reward_server.model to its served name (vllm serve --served-model-name)"
        )
    return entry


def _check_auth(client: Client, probe: list[int]) -> None:
    """The scoring endpoint refuses a request without the token, unless reward_server.allow_unauthenticated."""
    cfg = client.cfg
    if client.token is None:
        if not cfg.allow_unauthenticated:
            raise ConfigError(
                f"reward_server: ${cfg.api_key_env} (reward_server.api_key_env) is unset; set it to the server's "
                "key, or set reward_server.allow_unauthenticated=true for a server the network alone guards"
            )
        return
    try:
        client.once(
            "POST",
            f"/{cfg.kind}",
            {"model": cfg.model, "input": [probe], "use_activation": False},
            auth=False,
        )
    except ServerError as e:
        if e.status in (401, 403):
            return
        raise ConfigError(f"reward_server.url={cfg.url}: /{cfg.kind} fails ({e})") from None
    if not cfg.allow_unauthenticated:
        raise ConfigError(
            f"reward_server.url={cfg.url}: /{cfg.kind} scores requests without a token (vllm serve's --api-key "
            "guards only /v1 paths); start the server with --middleware trainer.rewards.reward_server.RequireToken "
            "(docs/rewards.md), or set reward_server.allow_unauthenticated=true where a NetworkPolicy admits the "
            "run's pods alone"
        )


def _check_rendering(client: Client, tokenizer: Any, probe: list[int]) -> None:
    """The server renders the probe conversation into the tokens the local tokenizer does."""
    cfg = client.cfg
    conversation = [*PROBE, {"role": "assistant", "content": "4"}]
    if getattr(tokenizer, "chat_template", None):
        body: dict[str, Any] = {"model": cfg.model, "messages": conversation, "add_generation_prompt": False}
    else:
        from trainer.rewards.reward_model import render

        body = {"model": cfg.model, "prompt": render(tokenizer, PROBE, "4")[0], "add_special_tokens": True}
    try:
        theirs = client.request("POST", "/tokenize", body).get("tokens")
    except ServerError as e:
        raise ConfigError(
            f"reward_server.url={cfg.url}: /tokenize fails ({e}); the rendering cannot be checked"
        ) from None
    if theirs != probe:
        at = next(
            (i for i, (a, b) in enumerate(zip(probe, theirs or [])) if a != b),
            min(len(probe), len(theirs or [])),
        )
        raise ConfigError(
            f"reward_server.tokenizer={cfg.tokenizer or cfg.model}: renders a probe conversation into {len(probe)} tokens "
            f"that differ from the server's {len(theirs or [])} at token {at}; point reward_server.tokenizer at the "
            "served model's own tokenizer"
        )


def _check_invariance(client: Client, tokenizer: Any, probe: list[int], limit: int) -> None:
    """The probe scores the same alone and beside longer sequences, bit for bit."""
    cfg = client.cfg
    longer = [encode(tokenizer, PROBE, "4 " + "because 2+2=4. " * k) for k in (2, 6)]
    longer = [seq for seq in longer if len(seq) <= limit]
    try:
        (alone,) = client.score([probe])
        beside = client.score([longer[0], probe, *longer[1:]] if longer else [probe, probe])[
            1 if longer else 0
        ]
    except ServerError as e:
        raise ConfigError(f"reward_server.url={cfg.url}: cannot score a probe ({e})") from None
    if alone != beside:
        raise ConfigError(
            f"reward_server.url={cfg.url}: a probe scores {alone!r} alone and {beside!r} beside longer sequences, so "
            "identical responses would get different rewards by what they are batched with; serve with "
            "--max-num-seqs 1 --no-enable-prefix-caching (one sequence a forward pass), or set "
            "reward_server.batch_invariant=false to accept it"
        )


def check(cfg: RewardServerConfig, specs: list[RewardSpec], wait_s: float | None = None) -> None:
    """A ``reward_server`` entry has a server that answers, takes the token, serves ``reward_server.model``,
    guards its scoring endpoint, renders as the local tokenizer does and scores batch-invariantly (module
    docstring); else a ConfigError naming the key. ``wait_s``: how long to wait for the server to answer
    (default: ``reward_server.start_timeout_s`` on a cluster, none locally). Nothing to check when no entry names
    it."""
    if not used(specs):
        return
    check_config(cfg, specs)
    if wait_s is None:
        wait_s = cfg.start_timeout_s if os.environ.get("RAY_ADDRESS") else 0.0
    client = Client(cfg, _token(cfg))
    if client.token is None:
        _check_auth(client, [])  # refuses a missing token before anything is asked
    entry = _served(client, wait_s)
    try:
        tokenizer = _tokenizer(cfg)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"reward_server.tokenizer={cfg.tokenizer or cfg.model}: cannot load it ({first}); set reward_server.tokenizer "
            "to the served reward model's hub id or directory"
        ) from None
    probe = encode(tokenizer, PROBE, "4")
    _check_auth(client, probe)
    _check_rendering(client, tokenizer, probe)
    if cfg.batch_invariant:
        _check_invariance(client, tokenizer, probe, int(entry.get("max_model_len") or 2**31))


# ----- scoring -------------------------------------------------------------------------------------------


class RewardServerWorker:
    """The client: the reward model's tokenizer and the server's address, scoring ``(messages, response)``
    pairs over HTTP. A Ray actor of no CPU (it waits on the network), threaded (CLIENT_CONCURRENCY batches)."""

    def __init__(self, cfg: RewardServerConfig, token: str | None):
        self.cfg = cfg
        self.client = Client(cfg, token)
        self.tokenizer = _tokenizer(cfg)
        self.max_length = 2**31
        try:  # the server's context: a longer sample is never sent
            models = self.client.request("GET", "/v1/models")
            entry: dict = next((m for m in models.get("data", []) if m.get("id") == cfg.model), {})
            self.max_length = int(entry.get("max_model_len") or self.max_length)
        except ServerError:
            pass  # checked at start; a server gone now fails its first batch, loudly

    def ready(self) -> dict:
        return {
            "max_length": self.max_length,
            "chat_template": bool(getattr(self.tokenizer, "chat_template", None)),
        }

    def score(self, items: list[tuple[list[dict], str]]):
        """Yields None once running (the time limit starts), then ``(raw scores, notes, seconds)``: a raw score per
        item, None for one not scored (its note says why: too long, or the request's failure)."""
        yield None
        start = time.monotonic()
        ids = [encode(self.tokenizer, messages, response) for messages, response in items]
        scores: list[float | None] = [None] * len(items)
        notes = [""] * len(items)
        same: dict[tuple[int, ...], list[int]] = {}  # each distinct sequence once
        for i, seq in enumerate(ids):
            if len(seq) > self.max_length:
                notes[i] = (
                    f"{OVERLONG}: {len(seq)} tokens > its max_model_len {self.max_length}; scored "
                    "reward_server.overlong_score"
                )
            else:
                same.setdefault(tuple(seq), []).append(i)
        distinct = list(same)
        size = self.cfg.batch_size
        chunks = [distinct[k : k + size] for k in range(0, len(distinct), size)]

        def send(chunk: list[tuple[int, ...]]) -> tuple[list[float] | None, str]:
            try:
                return self.client.score([list(seq) for seq in chunk]), ""
            except ServerError as e:
                return None, f"reward server raised {e}"

        with ThreadPoolExecutor(max(1, min(self.cfg.concurrency, len(chunks)))) as pool:
            for chunk, (values, why) in zip(chunks, pool.map(send, chunks)):
                for k, key in enumerate(chunk):
                    for i in same[key]:
                        if values is None:
                            notes[i] = why
                        else:
                            scores[i] = values[k]
        yield scores, notes, time.monotonic() - start


# ----- the driver's side ---------------------------------------------------------------------------------


class RewardServerPool(actors.ModelPool):
    """The client actor (:class:`RewardServerWorker`) as the reward runner's pool
    (:class:`~trainer.rewards.actors.ModelPool`); a batch is a list of ``(messages, response)``."""

    NAME, SECTION, WHAT, worker = NAME, "reward_server", "reward server", RewardServerWorker

    def __init__(self, cfg: RewardServerConfig, use_gpus: bool = False):
        import ray

        from trainer import watchdog

        self.cfg = cfg
        # The token travels as the actor's argument: the pods that run Ray workers need not hold the Secret.
        actor: Any = ray.remote(self.worker).options(
            num_cpus=0, max_restarts=0, max_concurrency=CLIENT_CONCURRENCY
        )
        self.workers = [actor.remote(cfg, _token(cfg))]
        watchdog.register(self.workers[0], "reward server client")
        self._next = itertools.count()
        self.info: list[dict] = []

    def model_name(self) -> str:
        return f"reward_server.model={self.cfg.model} at {self.cfg.url}"

    def asks(self) -> str:
        return "no CPU (an HTTP client)"

    def item(self, ground_truth: Any, response: str, messages: list[dict]) -> tuple[list[dict], str]:
        return messages, response

    def describe(self) -> str:
        info = self.info[0] if self.info else {}
        template = "its chat template" if info.get("chat_template") else "plain 'role: content' lines"
        return (
            f"reward server {self.cfg.url} ({self.cfg.model}, /{self.cfg.kind}): reads {template} as token ids, "
            f"up to {info.get('max_length', '?')} tokens"
        )

    def finish(self, raw: float | None, note: str) -> tuple[float, float | None, str]:
        """The server's raw score as the reward's: ``(score, raw, note)``; a sample never sent scores
        overlong_score, one whose request failed 0 (its note counts against env.reward_failure_budget)."""
        if raw is None:
            return (self.cfg.overlong_score if note.startswith(OVERLONG) else 0.0), None, note
        return raw, raw, note


def check_config(cfg: RewardServerConfig, specs: list[RewardSpec]) -> None:
    """What :func:`check` reads from the config alone (a URL and a model name), asking the server nothing: the
    checks before anything starts, which ``python -m trainer --cfg`` also runs."""
    if not used(specs):
        return
    actors.model_path(cfg.url, "reward_server.url", NAME, "the reward server's base URL (http://host:port)")
    actors.model_path(
        cfg.model, "reward_server.model", NAME, "the served model's name (vllm serve --served-model-name)"
    )


def component(cfg: Any) -> actors.PoolComponent | None:
    """The run's reward server as a component (:mod:`trainer.components`), when an entry of
    ``env.reward_functions`` names it: the config is checked before anything starts (:func:`check_config`); the
    server itself (:func:`check`: it answers, takes the token, renders and scores as required) when the run
    starts its parts, before the client actor starts; its scorer is that actor."""
    if not used(cfg.env.reward_functions):
        return None

    def start() -> RewardServerPool:
        check(cfg.reward_server, cfg.env.reward_functions)
        return RewardServerPool(cfg.reward_server)

    return actors.PoolComponent(
        "reward server", lambda: check_config(cfg.reward_server, cfg.env.reward_functions), start
    )


# ----- the server's side ---------------------------------------------------------------------------------


class RequireToken:
    """ASGI middleware for ``vllm serve --middleware trainer.rewards.reward_server.RequireToken``: every path but
    ``/health`` (the pod's probes) asks for ``Authorization: Bearer $VLLM_API_KEY``, where vLLM's own
    ``--api-key`` guards only ``/v1``-like paths and leaves ``/classify`` and ``/pooling`` open. Without
    VLLM_API_KEY it answers every such request 401: it fails closed."""

    OPEN = frozenset({"/health"})

    def __init__(self, app: Any) -> None:
        self.app = app
        key = os.environ.get("VLLM_API_KEY") or ""
        self.digest = hashlib.sha256(key.encode()).digest() if key else None

    def _allowed(self, scope: dict) -> bool:
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in self.OPEN or scope.get("method") == "OPTIONS":
            return True
        if self.digest is None:
            return False
        headers = dict(scope.get("headers") or [])
        scheme, _, token = headers.get(b"authorization", b"").decode(errors="replace").partition(" ")
        given = hashlib.sha256(token.encode()).digest()
        return scheme.lower() == "bearer" and secrets.compare_digest(given, self.digest)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = b'{"error":"Unauthorized"}'
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})
