"""The Engine (app/engine.py): one object loads, probes, calibrates and compiles, then generates or streams text;
its strategies' greedy output is autoregressive's, a stream closed early leaves the caches right for the next call."""

from __future__ import annotations

import pytest

from app.engine import Engine
from app.startup import records_for
from tests.helpers import load_tiny_pair, tiny_engine
from utils.caching import common_prefix_length

PROMPT = "The quick brown fox"


@pytest.fixture
def engine():
    return tiny_engine()


@pytest.fixture
def tokenizer(engine):
    return engine.tokenizer


@pytest.fixture
def models(engine):
    return engine.target.model, engine.drafter.model


@pytest.mark.parametrize("name", ["speculative", "auto", "ngram", "lookup", "lookahead"])
def test_every_strategys_greedy_reply_is_autoregressives(engine, name):
    expected = engine.generate(PROMPT, "autoregressive", max_new_tokens=24, ignore_eos=True)
    reply = engine.generate(PROMPT, name, max_new_tokens=24, ignore_eos=True, gamma=3)
    assert reply.token_ids == expected.token_ids and len(reply.token_ids) == 24
    assert reply.text == expected.text == engine.decode(reply.token_ids)
    assert reply.finish_reason == "length" and reply.stats.strategy == name and reply.stats.new_tokens == 24


def test_a_stream_yields_the_reply_text_and_its_stats_when_exhausted(engine):
    stream = engine.stream([{"role": "user", "content": PROMPT}], "speculative", max_new_tokens=16, ignore_eos=True)
    assert stream.reply is None
    pieces = list(stream)
    assert "".join(pieces) == stream.reply.text and len(pieces) > 1
    stats = stream.stats
    assert stats.prompt_tokens == len(stream.prompt_ids) == len(engine.encode(PROMPT))
    assert stats.new_tokens == 16 and stats.rounds >= 1 and stats.drafted is not None
    assert 0 <= stats.acceptance <= 1 and stats.tokens_per_round == 16 / stats.rounds
    assert str(stats).startswith("speculative: 16 tokens, ")


def test_a_stream_closed_early_leaves_the_caches_right_for_the_next_call(engine, models, tokenizer):
    with engine.stream(PROMPT, "speculative", max_new_tokens=40, ignore_eos=True) as stream:
        next(stream)
    assert stream.reply is not None and stream.reply.finish_reason == "stop"
    assert len(stream.reply.token_ids) < 40
    again = engine.generate(PROMPT + " jumps", "speculative", max_new_tokens=12, ignore_eos=True)
    fresh = Engine(models[0], tokenizer, models[1]).generate(PROMPT + " jumps", "speculative", max_new_tokens=12,
                                                           ignore_eos=True)
    assert again.token_ids == fresh.token_ids


def test_a_prompt_that_extends_the_last_prefills_only_its_new_tokens(engine):
    asked = [{"role": "user", "content": PROMPT}]
    first = engine.generate(asked, "autoregressive", max_new_tokens=4, ignore_eos=True)
    held = list(engine.target.tokens)
    follow_up = asked + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And then?"}]
    ids = engine.encode(follow_up)
    shared = common_prefix_length(held, ids)
    assert shared >= len(engine.encode(asked))
    fed: list[int] = []
    forward = engine.target.forward
    engine.target.forward = lambda new, *args, **kwargs: fed.append(len(new)) or forward(new, *args, **kwargs)
    engine.generate(follow_up, "autoregressive", max_new_tokens=1)
    assert fed == [len(ids) - shared]


def test_a_stop_string_ends_the_reply_before_it(engine):
    whole = engine.generate(PROMPT, "autoregressive", max_new_tokens=30, ignore_eos=True).text
    stop = whole[10:13]
    reply = engine.generate(PROMPT, "speculative", max_new_tokens=30, ignore_eos=True, stop=[stop])
    assert reply.text == whole[: whole.find(stop)] and reply.finish_reason == "stop"
    streamed = "".join(engine.stream(PROMPT, "lookup", max_new_tokens=30, ignore_eos=True, stop=stop))
    assert streamed == reply.text


def test_an_end_token_stops_the_reply_and_is_left_out(models, tokenizer):
    engine = Engine(models[0], tokenizer, models[1])
    free = engine.generate(PROMPT, "autoregressive", max_new_tokens=20, ignore_eos=True)
    ending = Engine(models[0], tokenizer, models[1], end_ids=(free.token_ids[5],))
    reply = ending.generate(PROMPT, "speculative", max_new_tokens=20)
    assert reply.token_ids == free.token_ids[:5] and reply.finish_reason == "stop"


def test_bad_requests_are_refused_in_one_line_before_any_work(engine, models, tokenizer):
    with pytest.raises(ValueError, match="unknown setting 'gama'"):
        engine.generate(PROMPT, gama=3)
    with pytest.raises(ValueError, match="strategy 'eagle' does not run on this engine; choose from "):
        engine.generate(PROMPT, "eagle")
    with pytest.raises(ValueError, match="gamma must be"):
        engine.generate(PROMPT, gamma=0)
    plain = Engine(models[0], tokenizer)
    assert "speculative" not in plain.strategies and "lookup" in plain.strategies
    assert plain.generate(PROMPT, max_new_tokens=3).stats.strategy == "autoregressive"  # auto, without a drafter


def test_a_plain_prompt_skips_the_template_when_asked(engine, tokenizer):
    assert engine.encode(PROMPT, chat=False) == tokenizer(PROMPT)["input_ids"]
    assert engine.encode(PROMPT) == engine.encode([{"role": "user", "content": PROMPT}])
    assert engine.encode(PROMPT)[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_load_probes_calibrates_and_keeps_the_users_settings(tmp_path, monkeypatch):
    from sampling.settings import StrategySettings

    pair = load_tiny_pair(tmp_path / "models")
    monkeypatch.setattr("models.loading.load_pair", lambda *args, **kwargs: pair)
    engine = Engine.load(target="tiny", drafter="tiny-drafter", heads=["none"], cache_dir=tmp_path, compile=False,
                         settings=StrategySettings(gamma=3), keep=frozenset({"gamma"}))
    assert engine.identity is not None and engine.tuning is not None and engine.settings == engine.tuning.settings
    assert engine.settings.gamma == 3 and engine.records == records_for(pair, tmp_path)
    assert engine.info.target_spec == "tiny" and engine.compiles.drafter is None
    assert engine.generate("Hello!", max_new_tokens=4).stats.new_tokens <= 4
    uncalibrated = Engine.load(target="tiny", drafter="tiny-drafter", heads=["none"], cache_dir=tmp_path,
                               compile=False, calibrate=False)  # the probe is read back: the same pair and machine
    assert uncalibrated.tuning is None and uncalibrated.settings == StrategySettings()
    assert uncalibrated.identity == engine.identity
