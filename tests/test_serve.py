"""The HTTP layer (serve/) over a fake engine that implements the Engine API: validation, queueing, 503, 401,
disconnects, the response shapes. The real engine behind it: tests/test_serve_engine.py."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit

import openai
import pytest

from serve import Background, ServeConfig, create_app
from serve.server import exposure_warning

DEADLINE = 30.0  # seconds any wait in these tests may take before it fails


@dataclass
class FakeStats:
    prompt_tokens: int
    prompt_seconds: float
    new_tokens: int
    decode_seconds: float
    tokens_per_second: float
    drafted: int
    accepted: int
    rounds: int
    strategy: str


@dataclass
class FakeReply:
    text: str
    token_ids: list[int]
    stats: FakeStats
    finish_reason: str


def answer_words(prompt) -> list[str]:
    """The fake's answer: the prompt's last text's words reversed, then numbered words."""
    text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    return list(reversed(text.split())) + [f"w{i}" for i in range(100)]


class FakeStream:
    def __init__(self, engine: FakeEngine, prompt, strategy: str, settings: dict):
        self.engine, self.prompt, self.strategy, self.settings = engine, prompt, strategy, settings
        self.reply: FakeReply | None = None
        self.closed_early = False
        self._pieces = self._generate()

    def __iter__(self):
        return self

    def __next__(self) -> str:
        return next(self._pieces)

    def _generate(self):
        engine = self.engine
        with engine.lock:
            engine.active += 1
            engine.max_active = max(engine.max_active, engine.active)
        try:
            words = answer_words(self.prompt)[: self.settings.get("max_new_tokens", 8)]
            text, finish = "", "length"
            for word in words:
                engine.take_permit()
                piece = word + " "
                stop = next((s for s in self.settings.get("stop", []) if s in text + piece), None)
                if stop is not None:
                    piece = (text + piece)[: (text + piece).index(stop)][len(text):]
                    finish = "stop"
                text += piece
                engine.pieces += 1
                yield piece
                if finish == "stop":
                    break
            drafted = 3 * len(words) if self.strategy == "speculative" else 0
            self.reply = FakeReply(text, list(range(len(words))),
                                   FakeStats(len(str(self.prompt).split()), 0.01, len(words), 0.02, 100.0, drafted,
                                             drafted // 2, len(words), self.strategy), finish)
        finally:
            with engine.lock:
                engine.active -= 1

    def close(self) -> None:
        if self.reply is None:
            self.closed_early = True
        self._pieces.close()


class FakeEngine:
    """The Engine API's face, deterministic and instant: `hold()` holds every generation before its next piece until
    `release(n)` lets n pieces pass (`release()`: all); it refuses a prompt of more words than `context_length` less
    the new tokens, as the engine refuses one past the context."""

    strategies = ("speculative", "autoregressive")
    context_length = 64

    def __init__(self):
        self.lock = threading.Lock()
        self.permits = threading.Condition(self.lock)
        self.budget: int | None = None  # pieces that may pass; None: any number
        self.active = self.max_active = self.pieces = 0
        self.streams: list[FakeStream] = []
        self.fail_with: Exception | None = None

    def stream(self, prompt, strategy: str = "auto", **settings) -> FakeStream:
        if self.fail_with is not None:
            raise self.fail_with
        words = len(prompt.split()) if isinstance(prompt, str) else sum(len(m["content"].split()) for m in prompt)
        if words + settings.get("max_new_tokens", 8) > self.context_length:
            raise ValueError(f"the prompt has {words} tokens; the context allows "
                             f"{self.context_length - settings['max_new_tokens']}")
        stream = FakeStream(self, prompt, strategy, settings)
        self.streams.append(stream)
        return stream

    def hold(self) -> None:
        with self.lock:
            self.budget = 0

    def release(self, pieces: int | None = None) -> None:
        with self.lock:
            self.budget = None if pieces is None else (self.budget or 0) + pieces
            self.permits.notify_all()

    def take_permit(self) -> None:
        with self.lock:
            if not self.permits.wait_for(lambda: self.budget is None or self.budget > 0, DEADLINE):
                raise TimeoutError("the test never released the generation")
            if self.budget is not None:
                self.budget -= 1

    @property
    def prompts(self) -> list:
        return [s.prompt for s in self.streams]


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.005)


def request(url: str, method: str, path: str, body=None, headers: dict | None = None):
    """Raw HTTP: (status, headers, parsed JSON body or None)."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=DEADLINE)
    try:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        connection.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        raw = response.read()
        return response.status, dict(response.getheaders()), json.loads(raw) if raw else None
    finally:
        connection.close()


def chat_body(text: str = "hello there", **extra) -> dict:
    return {"model": "any", "messages": [{"role": "user", "content": text}], **extra}


@pytest.fixture
def engine():
    return FakeEngine()


@pytest.fixture
def served(engine):
    with Background(create_app(engine, ServeConfig(model_name="fake", queue_size=4))) as server:
        yield server
    engine.release()


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=DEADLINE)


# -- the endpoints -------------------------------------------------------------------------------------------


def test_chat_completion_answers_with_usage_timings_and_the_strategy(client):
    reply = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "one two"}],
                                           max_tokens=4)
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == "two one w0 w1 "
    assert reply.choices[0].finish_reason == "length"
    assert (reply.usage.completion_tokens, reply.usage.total_tokens) == (4, reply.usage.prompt_tokens + 4)
    timings = reply.model_extra["timings"]
    assert timings["predicted_n"] == 4 and timings["draft_n"] == 12 and timings["draft_n_accepted"] == 6
    assert timings["predicted_per_second"] == pytest.approx(4 / timings["predicted_ms"] * 1e3)
    assert reply.model_extra["specchat"]["strategy"] == "speculative"  # the server's first strategy by default


def test_chat_stream_sends_role_then_pieces_then_finish_with_timings_and_usage(client):
    chunks = list(client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "a b"}],
                                                 max_tokens=3, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "b a w0 "
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length"
    assert finish[0].model_extra["timings"]["predicted_n"] == 3
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


def test_stream_ends_with_done(served):
    parts = urlsplit(served.url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=DEADLINE)
    connection.request("POST", "/v1/chat/completions", body=json.dumps(chat_body(stream=True, max_tokens=2)),
                       headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/event-stream")
    events = [line for line in response.read().decode().split("\n\n") if line]
    connection.close()
    assert events[-1] == "data: [DONE]"
    assert all(event.startswith("data: {") for event in events[:-1])


def test_completion_is_raw_text_and_streams(client, engine):
    reply = client.completions.create(model="fake", prompt="x y", max_tokens=2)
    assert reply.object == "text_completion" and reply.choices[0].text == "y x "
    assert reply.model_extra["timings"]["predicted_n"] == 2
    assert engine.streams[-1].settings["chat"] is False
    streamed = client.completions.create(model="fake", prompt="x y", max_tokens=2, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == "y x "


def test_request_settings_and_extension_reach_the_engine(client, engine):
    client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                   temperature=0.7, top_p=0.9, seed=5, stop="w0",
                                   extra_body={"specchat": {"strategy": "autoregressive", "gamma": 3}})
    stream = engine.streams[-1]
    assert stream.strategy == "autoregressive"
    assert stream.settings == {"max_new_tokens": 2, "temperature": 0.7, "top_p": 0.9, "seed": 5, "stop": ["w0"],
                               "gamma": 3}


def test_stop_string_ends_with_finish_reason_stop(client):
    reply = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "a b"}],
                                           max_tokens=6, stop=["w1"])
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == "b a w0 "


def test_server_defaults_fill_what_a_request_leaves_out(engine):
    config = ServeConfig(strategy="autoregressive", defaults={"max_new_tokens": 3, "temperature": 0.0})
    with Background(create_app(engine, config)) as server:
        status, _, body = request(server.url, "POST", "/v1/chat/completions", chat_body())
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    assert engine.streams[-1].strategy == "autoregressive"
    assert engine.streams[-1].settings == {"max_new_tokens": 3, "temperature": 0.0}


def test_the_servers_system_prompt_leads_a_chat_that_brings_none(engine):
    with Background(create_app(engine, ServeConfig(system="Be brief."))) as server:
        request(server.url, "POST", "/v1/chat/completions", chat_body("hi", max_tokens=1))
        own = [{"role": "developer", "content": "Be long."}, {"role": "user", "content": "hi"}]
        request(server.url, "POST", "/v1/chat/completions", {"messages": own, "max_tokens": 1})
    assert engine.prompts[0] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert engine.prompts[1] == [{"role": "system", "content": "Be long."}, {"role": "user", "content": "hi"}]


def test_models_and_health(client, served):
    models = client.models.list()
    assert [m.id for m in models.data] == ["fake"]
    assert models.data[0].model_extra["specchat"]["strategies"] == ["speculative", "autoregressive"]
    status, _, body = request(served.url, "GET", "/health")
    assert status == 200 and body["status"] == "ok"


# -- refusals: an OpenAI-shaped error body, never a traceback ------------------------------------------------


def assert_error(status: int, body, expected_status: int, *words: str) -> None:
    assert status == expected_status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in body["error"]["message"]
    for word in words:
        assert word in body["error"]["message"]


@pytest.mark.parametrize("body, words", [
    (b"{not json", ("not valid JSON",)),
    (b"[1, 2]", ("JSON object",)),
    (json.dumps({"messages": []}).encode(), ("messages",)),
    (json.dumps(chat_body(temperature="hot")).encode(), ("temperature",)),
    (json.dumps(chat_body(max_tokens=0)).encode(), ("max_tokens",)),
    (json.dumps(chat_body(stream="yes")).encode(), ("stream",)),
    (json.dumps(chat_body(n=2)).encode(), ("n=1",)),
    (json.dumps(chat_body(specchat={"strategy": "telepathy"})).encode(), ("telepathy", "speculative")),
    (json.dumps(chat_body(specchat={"gamma": 0})).encode(), ("gamma", "from 1 to 64")),
    (json.dumps(chat_body(specchat={"gama": 4})).encode(), ("unknown setting 'gama'",)),
    (json.dumps(chat_body(max_tokens=64)).encode(), ("context",)),
    (json.dumps(chat_body(" ".join(["word"] * 70), max_tokens=4)).encode(), ("context",)),
    (json.dumps(chat_body(" ".join(["word"] * 70), max_tokens=4, stream=True)).encode(), ("context",)),
])
def test_bad_requests_get_a_400_with_an_openai_error_body(served, body, words):
    status, _, answer = request(served.url, "POST", "/v1/chat/completions", body)
    assert_error(status, answer, 400, *words)
    assert request(served.url, "GET", "/health")[0] == 200


def test_the_openai_client_raises_its_bad_request_error(client):
    with pytest.raises(openai.BadRequestError, match="telepathy"):
        client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"specchat": {"strategy": "telepathy"}})


def test_unknown_fields_are_ignored_known_ones_of_the_wrong_type_refused(served):
    status, _, body = request(served.url, "POST", "/v1/chat/completions", chat_body(user="me", max_tokens=1))
    assert status == 200, body
    status, _, body = request(served.url, "POST", "/v1/chat/completions", chat_body(seed=1.5))
    assert_error(status, body, 400, "seed")


def test_unknown_path_and_method_get_openai_errors(served):
    status, _, body = request(served.url, "GET", "/v1/nothing")
    assert_error(status, body, 404)
    status, _, body = request(served.url, "GET", "/v1/chat/completions")
    assert_error(status, body, 405)


def test_a_body_past_the_limit_gets_a_413(engine):
    with Background(create_app(engine, ServeConfig(max_body_bytes=1000))) as server:
        status, _, body = request(server.url, "POST", "/v1/chat/completions", chat_body("x " * 600))
        assert_error(status, body, 413, "1000 bytes")
        assert request(server.url, "POST", "/v1/chat/completions", chat_body(max_tokens=1))[0] == 200


def test_a_body_past_the_limit_without_a_length_gets_a_413(engine):
    """A chunked upload has no Content-Length: its chunks are counted as they come."""
    with Background(create_app(engine, ServeConfig(max_body_bytes=1000))) as server:
        parts = urlsplit(server.url)
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=DEADLINE)
        chunks = iter([json.dumps(chat_body("x " * 600)).encode()])
        connection.request("POST", "/v1/chat/completions", body=chunks, encode_chunked=True,
                           headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
        response = connection.getresponse()
        body = json.loads(response.read())
        connection.close()
        assert_error(response.status, body, 413)


def test_an_engine_failure_is_a_500_without_a_traceback(served, engine):
    engine.fail_with = RuntimeError("the kernel fell over\nTraceback (most recent call last): ...")
    status, _, body = request(served.url, "POST", "/v1/chat/completions", chat_body())
    assert_error(status, body, 500, "RuntimeError", "the kernel fell over")
    engine.fail_with = None
    assert request(served.url, "POST", "/v1/chat/completions", chat_body(max_tokens=1))[0] == 200


# -- the API key -------------------------------------------------------------------------------------------


def test_api_key_refuses_every_request_without_it_but_health(engine):
    with Background(create_app(engine, ServeConfig(api_key="sesame"))) as server:
        for method, path, body in (("POST", "/v1/chat/completions", chat_body()), ("GET", "/v1/models", None),
                                   ("POST", "/v1/completions", {"prompt": "x"}), ("GET", "/v1/nothing", None)):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
                status, answer_headers, answer = request(server.url, method, path, body, headers)
                assert_error(status, answer, 401, "API key")
                assert answer_headers["www-authenticate"] == "Bearer"
        assert not engine.streams  # nothing was generated for a refused request
        assert request(server.url, "GET", "/health")[0] == 200
        good = openai.OpenAI(base_url=server.url + "/v1", api_key="sesame", max_retries=0, timeout=DEADLINE)
        assert good.chat.completions.create(model="x", messages=[{"role": "user", "content": "a"}],
                                            max_tokens=1).choices[0].message.content == "a "
        bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0, timeout=DEADLINE)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


# -- under load ----------------------------------------------------------------------------------------------


def test_requests_run_one_at_a_time_in_the_order_they_came(served, engine):
    engine.hold()
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(request, served.url, "POST", "/v1/chat/completions", chat_body("first", max_tokens=2))
        wait_until(lambda: engine.active == 1, "the first request generates")
        second = pool.submit(request, served.url, "POST", "/v1/chat/completions", chat_body("second", max_tokens=2))
        wait_until(lambda: request(served.url, "GET", "/health")[2]["waiting"] == 1, "the second one waits")
        third = pool.submit(request, served.url, "POST", "/v1/chat/completions", chat_body("third", max_tokens=2))
        wait_until(lambda: request(served.url, "GET", "/health")[2]["waiting"] == 2, "the third one waits")
        engine.release()
        answers = [f.result(DEADLINE)[2]["choices"][0]["message"]["content"] for f in (first, second, third)]
    assert answers == ["first w0 ", "second w0 ", "third w0 "]
    assert [p[-1]["content"] for p in engine.prompts] == ["first", "second", "third"]
    assert engine.max_active == 1


def test_sixteen_concurrent_requests_are_answered_or_refused_with_503(served, engine):
    engine.hold()  # held: one generates (or not yet), four wait, the rest find the queue full
    prompts = [f"prompt number {i}" for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(request, served.url, "POST", "/v1/chat/completions", chat_body(p, max_tokens=5))
                   for p in prompts]
        wait_until(lambda: sum(f.done() for f in futures) >= 11, "the overflow is refused")
        engine.release()
        results = [f.result(DEADLINE) for f in futures]
    answered = refused = 0
    for prompt, (status, headers, body) in zip(prompts, results, strict=True):
        if status == 503:
            assert_error(status, body, 503, "busy")
            assert int(headers["retry-after"]) >= 1
            refused += 1
        else:
            assert status == 200, body
            assert body["choices"][0]["message"]["content"] == " ".join(answer_words(prompt)[:5]) + " "
            answered += 1
    assert answered in (4, 5) and answered + refused == 16  # a queue of four, and one generating if it started
    assert len(engine.streams) == answered and engine.max_active == 1
    wait_until(lambda: request(served.url, "GET", "/health")[2] == {"status": "ok", "generating": False,
                                                                     "waiting": 0}, "the server is idle")
    assert request(served.url, "POST", "/v1/chat/completions", chat_body(max_tokens=1))[0] == 200


def test_the_openai_client_sees_503_as_its_overload_error(served, engine):
    engine.hold()
    with ThreadPoolExecutor(5) as pool:
        held = [pool.submit(request, served.url, "POST", "/v1/chat/completions", chat_body(max_tokens=1))]
        wait_until(lambda: engine.active == 1, "the first request generates")
        held += [pool.submit(request, served.url, "POST", "/v1/chat/completions", chat_body(max_tokens=1))
                 for _ in range(4)]
        wait_until(lambda: request(served.url, "GET", "/health")[2]["waiting"] == 4, "the queue is full")
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0, timeout=DEADLINE)
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(model="x", messages=[{"role": "user", "content": "a"}])
        assert refused.value.status_code == 503
        engine.release()
        assert all(f.result(DEADLINE)[0] == 200 for f in held)


def open_stream(url: str, body: dict) -> tuple[socket.socket, bytes]:
    """A streamed request on a bare socket, read until its first content piece."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=DEADLINE)
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    seen = b""
    while b'"content":"' not in seen.split(b'"role":"assistant"', 1)[-1]:
        chunk = sock.recv(4096)
        assert chunk, "the server closed the stream"
        seen += chunk
    return sock, seen


def test_a_client_gone_mid_stream_stops_its_generation(served, engine):
    engine.hold()
    engine.release(1)  # the first piece passes, the next one waits
    sock, _ = open_stream(served.url, chat_body("a b c", max_tokens=50, stream=True))
    sock.close()
    for _ in range(50):  # one piece at a time, until the server has seen the client go
        engine.release(1)
        wait_until(lambda: engine.budget == 0 or engine.active == 0, "the piece is taken")
        if engine.active == 0:
            break
    engine.release()
    assert engine.streams[-1].closed_early and engine.pieces < 50
    status, _, body = request(served.url, "POST", "/v1/chat/completions", chat_body("d e", max_tokens=3))
    assert status == 200 and body["choices"][0]["message"]["content"] == "e d w0 "


def test_a_client_gone_while_waiting_or_generating_without_stream_is_dropped(served, engine):
    engine.hold()
    running = socket.create_connection(urlsplit(served.url)[1].split(":"), timeout=DEADLINE)
    waiting = socket.create_connection(urlsplit(served.url)[1].split(":"), timeout=DEADLINE)
    for sock, text in ((running, "running"), (waiting, "waiting")):
        data = json.dumps(chat_body(text, max_tokens=50)).encode()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
        if text == "running":
            wait_until(lambda: engine.active == 1, "the first request generates")
    wait_until(lambda: request(served.url, "GET", "/health")[2]["waiting"] == 1, "the second one waits")
    running.close()
    waiting.close()
    wait_until(lambda: request(served.url, "GET", "/health")[2]["waiting"] == 0, "the waiting one is dropped")
    engine.release()
    wait_until(lambda: request(served.url, "GET", "/health")[2] == {"status": "ok", "generating": False,
                                                                     "waiting": 0}, "the server is idle")
    assert [p[-1]["content"] for p in engine.prompts] == ["running"]  # the waiting one never started
    assert engine.streams[0].closed_early
    status, _, body = request(served.url, "POST", "/v1/chat/completions", chat_body("after", max_tokens=2))
    assert status == 200 and body["choices"][0]["message"]["content"] == "after w0 "


# -- where it listens --------------------------------------------------------------------------------------


def test_listening_beyond_loopback_is_warned_about():
    assert exposure_warning("127.0.0.1", False) is None
    assert exposure_warning("::1", False) is None
    assert exposure_warning("localhost", False) is None
    assert "--api-key" in exposure_warning("0.0.0.0", False)
    assert "API key" in exposure_warning("0.0.0.0", True)


def test_config_refuses_an_empty_queue_or_key():
    with pytest.raises(ValueError, match="queue"):
        ServeConfig(queue_size=0)
    with pytest.raises(ValueError, match="empty"):
        ServeConfig(api_key="")


def test_the_benchmark_reads_the_same_text_and_count_from_both_kinds_of_answer(served):
    from benchmarks.serve import summary, through_api

    settings = {"max_new_tokens": 3, "ignore_eos": True, "temperature": 0.0}
    whole = through_api(served.url, [{"role": "user", "content": "a b"}], "speculative", settings, stream=False)
    streamed = through_api(served.url, [{"role": "user", "content": "a b"}], "speculative", settings, stream=True)
    assert whole[:2] == streamed[:2] == ("b a w0 ", 3)
    lines = summary({"engine": [1.0, 1.0], "api": [1.5, 1.0], "api-stream": [1.0, 3.0]},
                    {"engine": 10, "api": 10, "api-stream": 10}, 0)
    assert lines[1].split()[:3] == ["api", "4.00", "tok/s"] and "0.800x" in lines[1] and "+250.0 ms" in lines[1]
