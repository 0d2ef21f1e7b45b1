"""The chat session in-process: multi-turn KV reuse, fair comparisons, context overflow, Ctrl-C consistency."""

from __future__ import annotations

import copy
import io
import itertools
import json
import os
import signal
import threading

import pytest
import torch
from rich.console import Console
from transformers import AutoModelForCausalLM

from app.engine import Engine
from chat.oneshot import FAILED_EXIT, run_oneshot
from chat.session import ChatSession, ChatSettings, Message, ModelInfo
from chat.turn import View, run_turn
from models.loading import load_pair
from sampling.settings import StrategySettings
from tests.helpers import load_tiny_pair, save_tiny_checkpoint
from utils.caching import common_prefix_length


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return load_tiny_pair(tmp_path_factory.mktemp("chat_session"))


@pytest.fixture(scope="module")
def short_pair(tmp_path_factory):
    """A target with a 96-position context, for overflow."""
    target = save_tiny_checkpoint(tmp_path_factory.mktemp("chat_short") / "target", seed=0, max_positions=96)
    return load_pair(str(target), None, device="cpu", dtype="float32", progress=False)


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    """A target with a 256-position context: room for a few turns, so a long chat outgrows it."""
    target = save_tiny_checkpoint(tmp_path_factory.mktemp("chat_small") / "target", seed=0, max_positions=256)
    return load_pair(str(target), None, device="cpu", dtype="float32", progress=False)


def make_session(pair, **settings) -> ChatSession:
    drafter = pair.drafter.model if pair.drafter else None
    return ChatSession(Engine(pair.target.model, pair.target.tokenizer, drafter, end_ids=pair.end_ids),
                       ChatSettings(**settings))


def count_fed_tokens(lm, cached: list[int] | None = None) -> list[int]:
    """Record how many tokens each forward of a CachedModel is fed (and, in `cached`, how many its cache held)."""
    fed, forward = [], lm.forward

    def counting(ids, *args, **kwargs):
        fed.append(len(ids))
        if cached is not None:
            cached.append(len(lm.tokens))
        return forward(ids, *args, **kwargs)

    lm.forward = counting
    return fed


class InterruptAt(View):
    """Raises KeyboardInterrupt (as Ctrl-C would) after `rounds` rounds of `strategy`, or at its start if 0."""

    def __init__(self, strategy: str, rounds: int):
        self.strategy, self.rounds, self.seen, self.current = strategy, rounds, 0, None

    def start(self, name, plan):
        self.current = name
        if name == self.strategy and self.rounds == 0:
            raise KeyboardInterrupt

    def round(self, r):
        if self.current == self.strategy:
            self.seen += 1
            if self.seen == self.rounds:
                raise KeyboardInterrupt


def test_second_turn_prefills_only_the_new_tokens(pair):
    session = make_session(pair, strategies=("autoregressive",), max_new_tokens=6, system="Be brief.")
    first = run_turn(session, "Hello! How are you today?", View())
    cached = list(session.target.tokens)
    fed = count_fed_tokens(session.target)
    second = run_turn(session, "What is two plus two?", View())
    prompt = second.plan.ids
    reusable = common_prefix_length(cached, prompt)
    assert reusable >= len(first.plan.ids)  # the whole first prompt (system included) stays in the cache
    assert second.plan.reused == reusable
    assert fed[0] == len(prompt) - reusable  # the prefill feeds exactly the tokens the cache lacks
    assert fed[1:] == [1] * (len(fed) - 1)
    assert session.history[0] == Message("user", "Hello! How are you today?")
    assert session.history[1] == Message("assistant", first.answer)
    assert len(session.history) == 4


def test_every_strategy_in_a_comparison_prefills_the_same_tokens(pair):
    session = make_session(pair, strategies=("speculative", "autoregressive", "ngram"), max_new_tokens=5)
    run_turn(session, "Hello!", View())
    first_feeds = []

    class FirstFeed(View):
        def start(self, name, plan):
            first_feeds.append(len(fed))

    cached = []
    fed = count_fed_tokens(session.target, cached)
    turn = run_turn(session, "What is two plus two?", FirstFeed())
    # Each strategy's first forward starts from the cache as it was when the turn began (speculative ones feed
    # their first drafts along with the new prompt tokens).
    assert [cached[i] for i in first_feeds] == [turn.plan.reused] * 3
    assert turn.plan.reused > 0
    assert fed[first_feeds[1]] == len(turn.plan.ids) - turn.plan.reused  # autoregressive: the new tokens only
    # Greedy strategies are lossless: the same answer from each.
    assert turn.runs[0].token_ids == turn.runs[1].token_ids == turn.runs[2].token_ids


def test_a_cache_is_cropped_only_before_strategies_that_feed_it(pair):
    """Regression: cropping every cache before every strategy emptied the drafter's whenever autoregressive ran after
    speculative, so the drafter re-prefilled the whole conversation each turn."""
    session = make_session(pair, strategies=("speculative", "autoregressive"), max_new_tokens=5)
    first = run_turn(session, "Hello!", View())
    assert len(session.drafter.tokens) >= len(first.plan.ids)
    cached = []
    fed = count_fed_tokens(session.drafter, cached)
    second = run_turn(session, "What is two plus two?", View())
    assert cached[0] >= len(first.plan.ids)  # the drafter kept the first turn
    assert fed[0] == len(second.plan.ids) - cached[0]


def test_each_strategy_names_the_caches_it_feeds(pair):
    session = make_session(pair, strategies=("speculative", "autoregressive", "drafter", "ngram", "beam", "auto",
                                             "lookahead"))
    target, drafter = session.target, session.drafter
    fed = {name: session._strategies[name].models for name in session.settings.strategies}
    assert fed == {"speculative": [target, drafter], "autoregressive": [target], "drafter": [drafter],
                   "ngram": [target], "beam": [], "auto": [target, drafter], "lookahead": [target]}


def test_the_first_enabled_strategy_answers_into_the_history(pair):
    session = make_session(pair, strategies=("drafter", "autoregressive"), max_new_tokens=6)
    turn = run_turn(session, "Hello!", View())
    assert turn.runs[0].token_ids != turn.runs[1].token_ids  # the drafter is a different model
    assert session.history[1].content == session.decode(session.answer_ids(turn.runs[0]))


def test_oldest_turns_are_dropped_when_the_context_overflows(short_pair):
    session = make_session(short_pair, strategies=("autoregressive",), max_new_tokens=8)
    notices = []

    class Notices(View):
        def notice(self, text):
            notices.append(text)

    dropped = 0
    for i in range(6):
        turn = run_turn(session, f"Hello! How are you today? {i}", Notices())
        dropped += turn.plan.dropped_turns
        assert len(turn.plan.ids) <= 96 - 8
    assert dropped > 0 and len(notices) > 0 and "dropped" in notices[0]
    assert len(session.history) == 2 * (6 - dropped)
    assert session.history[-2] == Message("user", "Hello! How are you today? 5")


def test_a_long_chat_drops_old_turns_in_chunks_and_keeps_the_rest_cached(small_pair):
    """Regression: once the chat outgrew the context, the oldest turn was dropped one at a time, every turn, so the
    prompt's start changed each turn and the cache kept only the system prompt: every turn re-prefilled it all."""
    session = make_session(small_pair, strategies=("autoregressive",), max_new_tokens=8, ignore_eos=True,
                           system="Be brief.")
    notices = []

    class Notices(View):
        def notice(self, text):
            notices.append(text)

    turns = []
    for i in range(24):
        turn = run_turn(session, f"Hello! How are you today? Question {i}.", Notices())
        assert len(turn.plan.ids) <= session.context_limit
        assert session.decode(turn.plan.ids).startswith("<|im_start|>system\nBe brief.")  # the system prompt stays
        turns.append(turn)
    drops = [i for i, turn in enumerate(turns) if turn.plan.dropped_turns]
    assert len(drops) >= 2 and len(notices) == len(drops)  # one notice per drop
    assert all(turns[i].plan.dropped_turns >= 3 for i in drops)  # in chunks, not one turn at a time
    assert all(b - a >= 3 for a, b in itertools.pairwise(drops))  # and not every turn
    assert all(len(turns[i].plan.ids) <= session.context_limit // 2 for i in drops)  # down to about half
    for i in range(drops[0] + 1, len(turns)):
        if i not in drops:  # between drops the whole previous prompt stays cached
            assert turns[i].plan.reused >= len(turns[i - 1].plan.ids)
    assert f"dropped the {turns[drops[0]].plan.dropped_turns} oldest turns" in notices[0]


def test_every_strategy_starts_from_the_same_cache_across_drops(small_pair):
    session = make_session(small_pair, strategies=("autoregressive", "lookup"), max_new_tokens=8, ignore_eos=True)
    first_feeds, dropped = [], 0

    class FirstFeed(View):
        def start(self, name, plan):
            first_feeds.append(len(cached))

    cached = []
    count_fed_tokens(session.target, cached)
    for i in range(16):
        first_feeds.clear()
        turn = run_turn(session, f"Hello! How are you today? Question {i}.", FirstFeed())
        assert [cached[n] for n in first_feeds] == [turn.plan.reused] * 2  # the cache as the turn began, for each
        assert turn.runs[0].token_ids == turn.runs[1].token_ids
        dropped += turn.plan.dropped_turns
    assert dropped > 0


def test_a_message_longer_than_the_context_is_refused_and_changes_nothing(short_pair):
    session = make_session(short_pair, strategies=("autoregressive",), max_new_tokens=8)
    run_turn(session, "Hello!", View())
    history = list(session.history)
    with pytest.raises(ValueError, match="context allows"):
        run_turn(session, "two plus two " * 60, View())
    assert session.history == history


def test_ctrl_c_keeps_the_partial_answer_and_the_caches_stay_usable(pair):
    settings = dict(strategies=("speculative", "autoregressive"), max_new_tokens=12, ignore_eos=True)
    session = make_session(pair, **settings)
    turn = run_turn(session, "Hello!", InterruptAt("speculative", 3))
    assert turn.interrupted and turn.runs[0].interrupted and len(turn.runs) == 1
    kept = turn.runs[0].token_ids
    assert 3 <= len(kept) < 12
    assert session.history == [Message("user", "Hello!"), Message("assistant", session.decode(kept))]
    # The next turn answers as a fresh session with the same history does: nothing stale in the caches.
    after = run_turn(session, "What is two plus two?", View())
    fresh = make_session(pair, **settings)
    fresh.history = list(session.history[:2])
    expected = run_turn(fresh, "What is two plus two?", View())
    assert after.runs[0].token_ids == expected.runs[0].token_ids


def test_ctrl_c_in_a_later_strategy_keeps_the_first_strategys_whole_answer(pair):
    session = make_session(pair, strategies=("autoregressive", "speculative"), max_new_tokens=6, ignore_eos=True)
    turn = run_turn(session, "Hello!", InterruptAt("speculative", 1))
    assert not turn.runs[0].interrupted and turn.runs[1].interrupted
    assert len(turn.runs[0].token_ids) == 6
    assert session.history[1].content == session.decode(turn.runs[0].token_ids)


def test_ctrl_c_before_the_first_token_drops_the_turn(pair):
    session = make_session(pair, strategies=("autoregressive",), max_new_tokens=6)
    turn = run_turn(session, "Hello!", InterruptAt("autoregressive", 0))
    assert turn.interrupted and turn.answer is None and session.history == []


def test_ctrl_c_inside_a_forward_leaves_consistent_caches(pair):
    """Ctrl-C between two layers: one layer's cache holds the new tokens, the next does not."""
    settings = dict(strategies=("speculative",), max_new_tokens=8, ignore_eos=True)
    session = make_session(pair, **settings)
    run_turn(session, "Hello!", View())
    calls = []

    def interrupt_on_third_call(module, args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt

    hook = pair.target.model.model.layers[1].register_forward_pre_hook(interrupt_on_third_call)
    try:
        turn = run_turn(session, "What is two plus two?", View())
    finally:
        hook.remove()
    assert turn.interrupted
    after = run_turn(session, "Thank you.", View())
    fresh = make_session(pair, **settings)
    fresh.history = list(session.history[:-2])
    assert after.runs[0].token_ids == run_turn(fresh, "Thank you.", View()).runs[0].token_ids


def test_ctrl_c_that_code_inside_a_forward_swallows_still_stops_the_turn(pair):
    """Code that catches every exception (as in a compiled model's call path) gets the KeyboardInterrupt: the turn
    stops anyway, at the end of that round, and keeps what was committed."""
    session = make_session(pair, strategies=("speculative",), max_new_tokens=40, ignore_eos=True)
    calls = []

    def swallow_ctrl_c(module, args):
        calls.append(1)
        if len(calls) == 3:
            try:
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(1000):  # the handler runs here, between two bytecodes
                    pass
            except KeyboardInterrupt:
                calls.append("swallowed")

    hook = pair.target.model.model.layers[1].register_forward_pre_hook(swallow_ctrl_c)
    try:
        turn = run_turn(session, "Hello!", View())
    finally:
        hook.remove()
    assert "swallowed" in calls and turn.interrupted
    assert 1 <= len(turn.runs[0].token_ids) < 40
    assert session.history[1].content == session.decode(turn.runs[0].token_ids)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the turn's own handler is gone


def test_a_template_that_rejects_the_conversation_is_one_clear_error(pair):
    tokenizer = copy.deepcopy(pair.target.tokenizer)
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                               "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}"
                               "{% endfor %}")
    session = ChatSession(Engine(pair.target.model, tokenizer, end_ids=pair.end_ids),
                          ChatSettings(strategies=("autoregressive",), system="Be brief."))
    with pytest.raises(ValueError, match="the chat template rejected the conversation: System role not supported"):
        run_turn(session, "Hello!", View())
    assert session.history == []


def test_raw_completion_has_no_template_and_no_history(pair):
    session = make_session(pair, strategies=("autoregressive",), max_new_tokens=4, chat_template=False)
    turn = run_turn(session, "The quick brown fox", View())
    assert turn.plan.ids == pair.target.tokenizer("The quick brown fox")["input_ids"]
    assert session.history == []


def test_settings_changes_rebuild_strategies_and_keep_a_persistent_ngram_store(pair):
    session = make_session(pair, strategies=("ngram",), max_new_tokens=4,
                           strategy=StrategySettings(ngram_reset_each_prompt=False))
    store = session._strategies["ngram"].drafter.store
    session.update(strategies=("ngram", "autoregressive"))
    assert session._strategies["ngram"].drafter.store is store  # same settings: the store survives
    session.update_strategy(gamma=2)
    assert session._strategies["ngram"].gamma == 2
    with pytest.raises(ValueError):
        session.update(strategies=())
    assert session.settings.strategies == ("ngram", "autoregressive")


def test_drafter_strategies_need_a_drafter(short_pair):
    with pytest.raises(ValueError, match="needs a drafter"):
        make_session(short_pair, strategies=("speculative",))


@pytest.mark.slow
def test_the_drafter_compiles_in_the_background_and_says_how_it_went(pair, monkeypatch):
    class Notices(View):
        def __init__(self):
            self.seen = []

        def notice(self, text):
            self.seen.append(text)

    plain = AutoModelForCausalLM.from_pretrained(pair.drafter.source, dtype=torch.float32).eval()  # not prepacked
    session = ChatSession(Engine(pair.target.model, pair.target.tokenizer, plain, end_ids=pair.end_ids),
                          ChatSettings(strategies=("speculative", "autoregressive"), max_new_tokens=12))
    turn_done, compile_step = threading.Event(), session.drafter.compile_step
    session.drafter.compile_step = lambda **kw: turn_done.wait(60) and compile_step(**kw)  # the turn runs first
    thread = session.engine.compile(drafter=True, target=False, background=True)
    assert session.compile_status == "compiling (background)" and session.compiling
    view = Notices()
    turn = run_turn(session, "Hello!", view)  # a prompt meanwhile runs at once, the compile held while it decodes
    turn_done.set()
    thread.join()
    assert view.seen == []
    assert not session.compiling
    assert session.compile_status.startswith("compiled (ready after ") and session.drafter.step_model is not None
    assert turn.runs[0].token_ids == turn.runs[1].token_ids
    view = Notices()
    again = run_turn(session, "And again?", view)  # now with the compiled step
    assert again.runs[0].token_ids == again.runs[1].token_ids and view.seen == []

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler\nmore detail")

    monkeypatch.setattr("torch.compile", no_compiler)
    failed = ChatSession(Engine(pair.target.model, pair.target.tokenizer, plain, end_ids=pair.end_ids),
                         ChatSettings(strategies=("speculative",)))
    failed.engine.compile(drafter=True, target=False, background=True).join()
    assert failed.compile_status == "not compiled (RuntimeError: no C++ compiler)"
    assert failed.drafter.step_model is None
    packed = make_session(pair, strategies=("speculative",))  # the loader prepacked its float32 drafter
    packed.engine.compile(drafter=True, target=False, background=True).join()
    assert packed.compile_status == ("not compiled (ValueError: its weights are oneDNN-prepacked, which "
                                     "torch.compile cannot lower)")


def test_no_drafter_nothing_to_compile(short_pair):
    session = make_session(short_pair, strategies=("autoregressive",))
    assert session.engine.compile(drafter=True, target=False, background=True) is None
    assert session.compile_status is None


INFO = ModelInfo("target", "drafter", "float32", "cpu")


def fail_lookup(session, monkeypatch):
    def out_of_memory(prompt_ids, config):
        raise RuntimeError("out of memory\nwhile allocating")
        yield

    monkeypatch.setattr(session._strategies["lookup"], "stream", out_of_memory)


def test_one_shot_json_comes_with_a_failed_strategys_error_and_the_others_results(pair, monkeypatch):
    """Regression: one failing strategy ended the one-shot run with a traceback and no JSON at all."""
    session = make_session(pair, strategies=("autoregressive", "lookup", "speculative"), max_new_tokens=5)
    fail_lookup(session, monkeypatch)
    out = io.StringIO()
    assert run_oneshot(session, INFO, "Hello!", Console(file=io.StringIO()), out) == FAILED_EXIT
    assert out.getvalue().count("\n") == 1
    results = {r["strategy"]: r for r in json.loads(out.getvalue())["results"]}
    assert list(results) == ["autoregressive", "lookup", "speculative"]
    assert results["lookup"]["error"] == "RuntimeError: out of memory"
    assert results["autoregressive"]["error"] is None and results["speculative"]["error"] is None
    assert results["speculative"]["token_ids"] == results["autoregressive"]["token_ids"]
    assert len(results["autoregressive"]["token_ids"]) == 5


def test_one_shot_on_the_console_names_the_failed_strategy(pair, monkeypatch):
    session = make_session(pair, strategies=("autoregressive", "lookup"), max_new_tokens=5)
    fail_lookup(session, monkeypatch)
    console = Console(file=io.StringIO(), width=200, color_system=None)
    assert run_oneshot(session, INFO, "Hello!", console, None) == FAILED_EXIT
    shown = console.file.getvalue()
    assert "lookup failed: RuntimeError: out of memory" in shown and "lookup (failed)" in shown


def test_a_prompt_that_does_not_fit_is_advised_in_the_callers_words(short_pair):
    """Regression: the one-shot mode (infer.py -p) was told to "lower /length", a REPL command."""
    session = make_session(short_pair, strategies=("autoregressive",), max_new_tokens=8)
    out = io.StringIO()
    with pytest.raises(ValueError, match=r"context allows 88 .*: shorten it or lower --max-new-tokens$"):
        run_oneshot(session, INFO, "two plus two " * 60, Console(file=io.StringIO()), out)
    failed = json.loads(out.getvalue())  # the JSON object comes all the same
    assert failed["prompt_tokens"] is None and "/length" not in out.getvalue()
    assert [r["strategy"] for r in failed["results"]] == ["autoregressive"]
    assert failed["results"][0]["error"].endswith("shorten it or lower --max-new-tokens")
    session.update(max_new_tokens=200)
    with pytest.raises(ValueError, match=r"leaves no room for a prompt in the model's context \(96\): lower "
                                         r"--max-new-tokens$"):
        run_oneshot(session, INFO, "Hello!", Console(file=io.StringIO()), None)


@pytest.mark.slow
def test_the_target_compile_thread_never_installs_the_hidden_state_hooks(pair, monkeypatch):
    """transformers installs them under a lock at the first forward asking for hidden states: a compile held at a
    pause inside it would stall a draft head's forward in the turn. They are installed before the thread starts."""
    from transformers.utils import output_capturing

    plain = AutoModelForCausalLM.from_pretrained(pair.target.source, dtype=torch.float32).eval()  # no hooks yet
    installed_on, install = [], output_capturing.install_all_output_capturing_hooks

    def recorded(model, *args, **kwargs):
        installed_on.append(threading.current_thread().name)
        return install(model, *args, **kwargs)

    monkeypatch.setattr(output_capturing, "install_all_output_capturing_hooks", recorded)
    settings = ChatSettings(strategies=("autoregressive",))
    session = ChatSession(Engine(plain, pair.target.tokenizer, end_ids=pair.end_ids), settings)
    session.engine.compile(drafter=False, target=True, background=True).join()
    assert session.target_compile_status != "compiling (background)"  # it traced (this graph is then refused)
    assert installed_on == [threading.current_thread().name]
