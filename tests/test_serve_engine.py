"""The server on the real engine (tiny float64 models, greedy: outputs compare exactly), and `infer.py --serve` as a
user starts it: its answers are the engine's and `infer.py --json`'s, its timings add up, and neither load, a
client that goes away nor a long prompt leaves it wrong or down."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from app.engine import Engine
from serve import Background, ServeConfig, create_app
from tests.helpers import REPO, build_tokenizer, save_tiny_pair, tiny_model
from tests.test_serve import DEADLINE, assert_error, open_stream, request, wait_until
from utils.caching import common_prefix_length

QUESTION = "The quick brown fox"
START_SECONDS = 600  # infer.py's start: imports, load, the identity probe (minutes on a loaded 2-core machine)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def models(tokenizer):
    return tiny_model(len(tokenizer), seed=0), tiny_model(len(tokenizer), seed=1, layers=1, hidden=16)


@pytest.fixture
def engine(models, tokenizer):
    return Engine(models[0], tokenizer, models[1])


@pytest.fixture
def served(engine):
    with Background(create_app(engine, ServeConfig(model_name="tiny", queue_size=4,
                                                   defaults={"max_new_tokens": 12, "ignore_eos": True}))) as server:
        yield server


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=DEADLINE)


def ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def fresh_reply(models, tokenizer, prompt, strategy: str, **settings):
    """What an engine that served nothing before answers: the reference for a served answer."""
    return Engine(models[0], tokenizer, models[1]).generate(prompt, strategy, **settings)


@pytest.mark.parametrize("strategy", ["speculative", "autoregressive", "lookup"])
def test_greedy_answers_are_the_engines_streamed_or_not(client, models, tokenizer, strategy):
    expected = fresh_reply(models, tokenizer, ask(QUESTION), strategy, max_new_tokens=12, ignore_eos=True)
    whole = client.chat.completions.create(model="tiny", messages=ask(QUESTION),
                                           extra_body={"specchat": {"strategy": strategy}})
    assert whole.choices[0].message.content == expected.text and whole.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model="tiny", messages=ask(QUESTION), stream=True,
                                                 extra_body={"specchat": {"strategy": strategy}}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    timings = whole.model_extra["timings"]
    assert timings["predicted_n"] == whole.usage.completion_tokens == 12
    assert timings["prompt_n"] == whole.usage.prompt_tokens == len(Engine(*models[:1], tokenizer).encode(QUESTION))
    assert 0 <= timings["draft_n_accepted"] <= timings["draft_n"]
    assert (timings["draft_n"] > 0) == (strategy != "autoregressive")
    assert timings["prompt_ms"] > 0 and timings["predicted_ms"] > 0
    assert timings["predicted_per_second"] == pytest.approx(12 / timings["predicted_ms"] * 1e3)
    assert whole.model_extra["specchat"]["strategy"] == strategy
    assert chunks[-1].model_extra["timings"]["predicted_n"] == 12


def test_a_raw_completion_is_the_engines_without_template(client, models, tokenizer):
    expected = fresh_reply(models, tokenizer, QUESTION, "speculative", chat=False, max_new_tokens=8, ignore_eos=True)
    reply = client.completions.create(model="tiny", prompt=QUESTION, max_tokens=8)
    assert reply.choices[0].text == expected.text


def test_a_follow_up_reuses_the_conversations_cache(client, engine):
    first = client.chat.completions.create(model="tiny", messages=ask(QUESTION)).choices[0].message.content
    follow_up = ask(QUESTION) + [{"role": "assistant", "content": first}, {"role": "user", "content": "And then?"}]
    ids = engine.encode(follow_up)
    shared = common_prefix_length(engine.target.tokens, ids)
    assert shared >= len(engine.encode(ask(QUESTION)))
    fed: list[int] = []
    forward = engine.target.forward
    engine.target.forward = lambda new, *args, **kwargs: fed.append(len(new)) or forward(new, *args, **kwargs)
    client.chat.completions.create(model="tiny", messages=follow_up, max_tokens=1)
    assert fed[0] == len(ids) - shared  # the prefill: only what the cache did not hold


def test_a_prompt_past_the_context_or_too_many_tokens_is_a_400(served, engine):
    assert engine.context_length == 512
    status, _, body = request(served.url, "POST", "/v1/chat/completions",
                              {"messages": ask("fox " * 600), "max_tokens": 4})
    assert_error(status, body, 400, "context")
    status, _, body = request(served.url, "POST", "/v1/chat/completions", {"messages": ask("hi"), "max_tokens": 512})
    assert_error(status, body, 400, "max_tokens", "512")
    status, _, body = request(served.url, "POST", "/v1/chat/completions",
                              {"messages": ask("hi"), "specchat": {"strategy": "eagle"}})
    assert_error(status, body, 400, "eagle", "speculative")
    assert request(served.url, "POST", "/v1/chat/completions", {"messages": ask("hi")})[0] == 200


def test_sixteen_concurrent_requests_get_their_own_answers_or_a_503(served, models, tokenizer):
    prompts = [f"{QUESTION} number {i}" for i in range(16)]
    reference = Engine(models[0], tokenizer, models[1])
    expected = [reference.generate(ask(p), "speculative", max_new_tokens=12, ignore_eos=True).text for p in prompts]
    body = {"specchat": {"strategy": "speculative"}}
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda p: request(served.url, "POST", "/v1/chat/completions",
                                                  {"messages": ask(p), **body}), prompts))
    answered = 0
    for want, (status, _, answer) in zip(expected, results, strict=True):
        assert status in (200, 503), answer
        if status == 200:
            assert answer["choices"][0]["message"]["content"] == want
            answered += 1
    assert answered >= 4  # a queue of four at least (and one generating, once the worker took it): more where some
    # finished meanwhile
    wait_until(lambda: request(served.url, "GET", "/health")[2] == {"status": "ok", "generating": False,
                                                                     "waiting": 0}, "the server is idle")


class Throttle:
    """The target's forwards held until released one by one: a generation the test can stop in the middle."""

    def __init__(self, engine: Engine):
        self.permits = threading.Semaphore(0)
        forward = engine.target.forward

        def held(*args, **kwargs):
            if not self.permits.acquire(timeout=DEADLINE):
                raise TimeoutError("the test never released the forward")
            return forward(*args, **kwargs)

        engine.target.forward = held


def test_a_client_gone_mid_stream_leaves_the_cache_right_for_the_next(served, engine, models, tokenizer):
    throttle = Throttle(engine)
    for _ in range(3):  # the prefill and two rounds: the first pieces
        throttle.permits.release()
    sock, _ = open_stream(served.url, {"messages": ask(QUESTION), "max_tokens": 200, "stream": True,
                                       "specchat": {"strategy": "speculative"}})
    sock.close()
    for _ in range(200):  # one forward at a time, until the server has seen the client go
        if request(served.url, "GET", "/health")[2]["generating"] is False:
            break
        throttle.permits.release()
        wait_until(lambda: throttle.permits._value == 0 or not request(served.url, "GET", "/health")[2]["generating"],
                   "the forward is taken")
    assert len(engine.target.tokens) < len(engine.encode(ask(QUESTION))) + 199  # it was cut short
    for _ in range(100):
        throttle.permits.release()
    follow = ask("Hello! How are you today?")
    status, _, body = request(served.url, "POST", "/v1/chat/completions",
                              {"messages": follow, "specchat": {"strategy": "speculative"}})
    assert status == 200
    expected = fresh_reply(models, tokenizer, follow, "speculative", max_new_tokens=12, ignore_eos=True)
    assert body["choices"][0]["message"]["content"] == expected.text


# -- infer.py --serve --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("serve-models"))


def infer_argv(checkpoints, *extra: str) -> list[str]:
    target, drafter = checkpoints
    return [sys.executable, "infer.py", "--target", str(target), "--drafter", str(drafter), "--dtype", "float32",
            "--device", "cpu", "--no-calibrate", "--no-compile", *extra]


class ServerProcess:
    """`infer.py --serve --port 0`: started, its address read from the line it prints, stopped with Ctrl-C."""

    def __init__(self, argv: list[str]):
        self.process = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.url = self._address()

    def _read(self) -> None:
        for line in self.process.stderr:
            self.lines.put(line)

    def _address(self) -> str:
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            self.seen.append(line)
            if line.startswith("serving "):
                return line.split(" on ", 1)[1].split("/v1", 1)[0]
        self.process.kill()
        raise AssertionError(f"infer.py --serve never said where it listens: {''.join(self.seen)}")

    def stop(self) -> int:
        os.killpg(self.process.pid, signal.SIGINT)
        try:
            return self.process.wait(DEADLINE)
        finally:
            if self.process.poll() is None:
                self.process.kill()


@pytest.mark.slow
def test_infer_serve_answers_as_infer_json_does(checkpoints):
    prompt = "Hello! How are you today?"
    done = subprocess.run(infer_argv(checkpoints, "--prompt", prompt, "--json", "-n", "10", "--strategy",
                                     "speculative"), cwd=REPO, capture_output=True, text=True, timeout=START_SECONDS)
    assert done.returncode == 0, done.stderr
    expected = json.loads(done.stdout)["results"][0]
    server = ServerProcess(infer_argv(checkpoints, "--serve", "--port", "0", "--api-key", "sesame", "-n", "10",
                                      "--strategy", "speculative,autoregressive"))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="sesame", max_retries=0, timeout=DEADLINE)
        wait_until(lambda: request(server.url, "GET", "/health")[0] == 200, "the server answers")
        reply = client.chat.completions.create(model="whatever", messages=ask(prompt))
        assert reply.choices[0].message.content == expected["text"]
        assert reply.model_extra["specchat"]["strategy"] == "speculative"  # the first --strategy
        assert reply.usage.completion_tokens == expected["new_tokens"]
        streamed = client.chat.completions.create(model="whatever", messages=ask(prompt), stream=True,
                                                  extra_body={"specchat": {"strategy": "autoregressive"}})
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected["text"]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert [m.id for m in client.models.list().data] == [str(checkpoints[0])]
    finally:
        code = server.stop()
    assert code in (0, 130)
    assert "Traceback" not in "".join(server.seen) + "".join(server.lines.queue)


@pytest.mark.parametrize("argv, message", [
    (["--serve", "--prompt", "hi"], "--serve answers requests, not --prompt"),
    (["--serve", "--export", "vllm"], "--serve answers requests, not --export"),
    (["--port", "9000"], "--port needs --serve"),
    (["--api-key", "k"], "--api-key needs --serve"),
    (["--serve", "--port", "70000"], "--port must be from 0 to 65535"),
    (["--serve", "--queue-size", "0"], "--queue-size must be at least 1"),
    (["--serve", "--api-key", " "], "--api-key is empty"),
])
def test_bad_server_flags_exit_2_before_loading(capsys, argv, message):
    import infer

    assert infer.main(argv) == infer.USAGE_EXIT
    assert message in capsys.readouterr().err


def test_help_names_the_server_flags_and_checking_them_imports_no_torch(capsys):
    import infer
    from tests.helpers import heavy_modules_imported

    with pytest.raises(SystemExit):
        infer.main(["--help"])
    text = capsys.readouterr().out
    for flag in ("--serve", "--host", "--port", "--api-key", "--queue-size"):
        assert f"{flag} " in text, flag
    assert heavy_modules_imported("infer", ["--serve", "--port", "70000"]) == []


def test_a_taken_port_is_one_line_and_exit_2(capsys, engine):
    import argparse

    from serve.cli import serve_engine
    from serve.server import bind

    taken = bind("127.0.0.1", 0)
    try:
        args = argparse.Namespace(api_key=None, max_new_tokens=8, temperature=0.0, top_k=None, top_p=None,
                                  min_p=None, seed=None, ignore_eos=False, system=None, queue_size=4,
                                  host="127.0.0.1", port=taken.getsockname()[1])
        from rich.console import Console

        assert serve_engine(engine, args, "speculative", Console(stderr=True)) == 2
    finally:
        taken.close()
    err = capsys.readouterr().err
    assert "cannot listen on 127.0.0.1 port" in err and "--port" in err and "Traceback" not in err
