"""Drafts from the session's earlier text (sampling/drafters/session.py): the index, auto's rule, greedy identity and
the target's distribution, and who adds what when (the engine, the chat's turns and /reset, the benchmark)."""

import pytest

from app.settings import BY_NAME
from benchmarks.contestants import OurStrategy
from benchmarks.runner import Encoder, RunSettings, run_benchmark
from chat.session import ChatSession, ChatSettings
from chat.turn import View, run_turn
from sampling.autoregressive import Autoregressive
from sampling.base import DecodeConfig
from sampling.drafters.combined import CombinedDrafter
from sampling.drafters.model import ModelDrafter
from sampling.drafters.prompt_lookup import PromptLookupDrafter
from sampling.drafters.session import KEY, LONGEST, SessionText
from sampling.settings import StrategySettings
from sampling.speculative import Speculative
from tests.distribution import FALSE_ALARM, chi_square_test, exact_sequence_distribution
from tests.helpers import tiny_engine, tiny_model
from utils.checks import SettingError
from utils.logits_processor import MultinomialProcessor
from utils.prompts import Prompt
from utils.runner import CachedModel


def test_the_longest_match_drafts_its_continuations_most_frequent_first():
    text = SessionText()
    text.add([1, 2, 3, 4, 5, 6, 7])
    text.add([9, 3, 4, 5, 6, 8, 9])
    text.add([3, 4, 5, 6, 8, 10])
    found = text.draft([0, 3, 4, 5, 6], depth=3, nodes=8)
    assert found is not None and found.matched == KEY
    # after [3, 4, 5, 6]: 7 once (then its document ends), 8 twice (then 10 once, 9 once; the most recent first)
    assert found.tokens == [8, 7, 10, 9]
    assert found.parents == [-1, -1, 0, 0]
    assert found.weights == pytest.approx([2 / 3, 1 / 3, 1 / 3, 1 / 3])
    assert found.expected == pytest.approx(5 / 3)
    # a longer match wins over more occurrences of a shorter one
    longer = text.draft([2, 3, 4, 5, 6], depth=2, nodes=8)
    assert longer is not None and longer.matched == 5 and longer.tokens == [7]


def test_a_draft_keeps_to_its_bounds_and_never_runs_across_documents():
    text = SessionText()
    text.add([1, 2, 3, 4, 5])
    text.add([6, 7, 8, 9, 10, 11, 12, 13])
    assert text.draft([0, 1, 2, 3, 4], depth=4, nodes=8).tokens == [5]  # then its document ends: not 6
    assert text.draft([1, 2, 3, 4, 5], depth=4, nodes=8) is None  # its document's last token: nothing followed
    found = text.draft([6, 7, 8, 9], depth=2, nodes=8)
    assert found.tokens == [10, 11] and found.parents == [-1, 0]
    assert text.draft([6, 7, 8, 9], depth=4, nodes=3).tokens == [10, 11, 12]
    assert text.draft([0, 6, 7, 8, 9], depth=4, nodes=8, at_least=5) is None  # the match is 4 tokens long
    assert text.draft([5, 6, 7, 8, 9], depth=4, nodes=8, at_least=5) is None  # 5 ends one document, 6 starts another
    assert text.draft([7, 8, 9], depth=4, nodes=8) is None  # shorter than KEY
    assert len(text) == 13 and text.documents == 2
    text.clear()
    assert len(text) == 0 and text.draft([6, 7, 8, 9], depth=2, nodes=8) is None


def test_a_match_is_measured_back_to_its_longest():
    text = SessionText()
    long = list(range(100, 130))
    text.add(long)
    found = text.draft([0] + long[:20], depth=2, nodes=4)
    assert found.matched == LONGEST and found.tokens == [120, 121]


def test_a_draft_weighs_only_the_most_recent_occurrences():
    text = SessionText(occurrences=2)
    for follower in (7, 7, 7, 8, 9):
        text.add([1, 2, 3, 4, follower])
    assert sorted(text.draft([1, 2, 3, 4], depth=1, nodes=4).tokens) == [8, 9]


def test_the_oldest_documents_leave_once_the_text_is_full():
    text = SessionText(max_tokens=16)
    for first in (1, 11, 21):
        text.add(list(range(first, first + 6)))
    # 18 tokens would not fit: the oldest went, down to 3/4 of the room with the new one
    assert text.documents == 2 and len(text) == 12
    assert text.draft([1, 2, 3, 4], depth=2, nodes=4) is None
    assert text.draft([11, 12, 13, 14], depth=2, nodes=4).tokens == [15, 16]
    assert text.draft([21, 22, 23, 24], depth=2, nodes=4).tokens == [25, 26]
    text.add(list(range(40)))  # longer than the whole room: its last 16 tokens
    assert text.documents == 1 and len(text) == 16 and text.draft([24, 25, 26, 27], 1, 1).tokens == [28]


def auto(target, drafter, session, match, min_copy=2):
    lookup = PromptLookupDrafter(3, 2, max_tree=6)
    return Speculative(CachedModel(target), CombinedDrafter(lookup, ModelDrafter(CachedModel(drafter),
                                                                                 target.config.vocab_size),
                                                            4, min_copy, session=session, session_match=match),
                       gamma=8, name="auto")


def test_greedy_auto_from_the_session_equals_autoregressive_and_counts_its_rounds(target_model, small_drafter_model):
    prompt, config = [5, 17, 3, 42, 8, 11], DecodeConfig(max_new_tokens=40)
    reference = Autoregressive(CachedModel(target_model)).generate(prompt, config)
    session = SessionText()
    session.add([60, 61] + prompt + reference.token_ids)  # an earlier request that was answered so
    wrong = [(t + 1) % 97 for t in reference.token_ids]
    session.add([70] + prompt + wrong[:10])  # and one with another answer
    for match in (4, 8):
        result = auto(target_model, small_drafter_model, session, match, min_copy=16).generate(prompt, config)
        assert result.token_ids == reference.token_ids
        assert result.stats.extra["session_rounds"] >= 1
        assert result.stats.extra["session_accepted"] >= 20
        assert result.stats.target_forwards < len(reference.token_ids) / 2
    off = auto(target_model, small_drafter_model, session, 0, min_copy=16).generate(prompt, config)
    assert off.token_ids == reference.token_ids and "session_rounds" not in off.stats.extra


def test_a_wrong_session_text_costs_rounds_not_tokens(target_model, small_drafter_model):
    prompt, config = [9, 9, 1, 2, 3], DecodeConfig(max_new_tokens=24)
    reference = Autoregressive(CachedModel(target_model)).generate(prompt, config)
    session = SessionText()
    for shift in (1, 2, 3):
        session.add(prompt + [(t + shift) % 97 for t in reference.token_ids])
    result = auto(target_model, small_drafter_model, session, 4, min_copy=16).generate(prompt, config)
    assert result.token_ids == reference.token_ids
    assert result.stats.extra["session_rounds"] >= 1


@pytest.mark.slow
def test_sampled_auto_from_the_session_follows_the_target_distribution():
    vocab, prompt, length = 6, [1, 4, 2, 5, 3], 3
    target, drafter = tiny_model(vocab_size=vocab, seed=11, layers=1, hidden=16), \
        tiny_model(vocab_size=vocab, seed=12, layers=1, hidden=16)
    session = SessionText()
    for tail in ([3, 0, 5], [3, 1], [5, 5, 2], [0, 4, 2, 3]):
        session.add(prompt + tail)
    strategy = auto(target, drafter, session, 4, min_copy=8)
    processor = MultinomialProcessor(temperature=1.3)
    samples = []
    for seed in range(1500):
        result = strategy.generate(prompt, DecodeConfig(max_new_tokens=length, processor=processor, seed=seed))
        samples.append(tuple(result.token_ids))
    assert result.stats.extra.get("session_rounds", 0) >= 1
    stat, critical = chi_square_test(samples, exact_sequence_distribution(target, prompt, length, processor))
    assert stat <= critical, f"chi-square {stat:.1f} > {critical:.1f} (false alarm {FALSE_ALARM})"


def test_the_engine_remembers_each_reply_unless_told_not_to():
    engine = tiny_engine()
    first = engine.generate("alpha beta", max_new_tokens=6, remember=False)
    assert len(engine.session) == 0
    second = engine.generate("alpha beta", max_new_tokens=6)
    assert first.token_ids == second.token_ids
    assert engine.session.tokens[:-1] == engine.encode("alpha beta") + second.token_ids
    assert engine.build("auto").drafter.session is engine.session


def test_a_chat_turn_adds_its_text_once_all_its_runs_are_over_and_reset_forgets_it():
    engine = tiny_engine()
    session = ChatSession(engine, ChatSettings(strategies=("autoregressive", "auto"), max_new_tokens=8))
    seen = []
    original = engine.session.draft

    def spy(context, *args, **kwargs):
        seen.append(len(engine.session))
        return original(context, *args, **kwargs)

    engine.session.draft = spy
    turn = run_turn(session, "alpha beta", View())
    assert turn.runs[1].token_ids == turn.runs[0].token_ids
    assert seen and set(seen) == {0}  # auto ran with nothing in the session's text: not autoregressive's answer
    assert engine.session.tokens[:-1] == turn.plan.ids + session.answer_ids(turn.runs[0])
    run_turn(session, "gamma", View())
    assert engine.session.documents == 2
    session.reset()
    assert len(engine.session) == 0 and engine.session.documents == 0


def test_the_benchmark_hands_each_turn_to_the_session_once_every_contestant_ran_it(target_model):
    remembered = []
    strategy = Autoregressive(CachedModel(target_model))
    contestants = [OurStrategy(strategy, strategy.models, {}, False)]
    encoder = Encoder(encode=lambda messages: [3 + len(m["content"]) for m in messages], decode=lambda ids: "x" * 2)
    prompts = [Prompt("a", "chat", ("one", "three")), Prompt("b", "code", ("seven",))]
    measurements, _ = run_benchmark(prompts, contestants, encoder, RunSettings(
        DecodeConfig(max_new_tokens=3), warmup_tokens=0, progress=False, remember=remembered.append))
    assert len(remembered) == 3
    assert [r[: -3] for r in remembered] == [[6], [6, 5, 8], [8]]
    assert [r[-3:] for r in remembered] == [m["token_ids"] for m in measurements]


def test_the_setting_is_a_flag_and_a_command_within_its_bounds():
    assert StrategySettings().session_min_match == 8
    assert BY_NAME["session_min_match"].flags == ("--session-match",)
    assert BY_NAME["session_min_match"].command == "session-match"
    assert StrategySettings(session_min_match=0).session_min_match == 0
    for wrong in (-1, 1, 3, 17):
        with pytest.raises(SettingError):
            StrategySettings(session_min_match=wrong)


def test_the_replay_counts_what_the_session_would_have_drafted():
    from benchmarks.session_replay import replay

    answer = list(range(10, 22))
    table = replay([([1, 2] + answer, 2), ([3, 4] + answer, 2)])
    # the first answer: nothing in the session yet, 12 rounds without a match; the second: 4 rounds before its last
    # 4 tokens are [10, 11, 12, 13], which the first answer holds: its next 8 tokens, the rest, are drafted and accepted
    assert table == {0: {"rounds": 16, "first": 0, "accepted": 0}, 4: {"rounds": 1, "first": 1, "accepted": 8}}
