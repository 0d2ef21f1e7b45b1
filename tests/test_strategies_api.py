"""The shared strategy API: bad input gets a clear error before any work, stats are zero-safe and consistent,
every registered strategy streams rounds that add up to its result."""

import pytest

from sampling.base import DecodeConfig, Round, Stats, clip
from sampling.beam_search import BeamSearch
from sampling.drafters.base import Draft
from sampling.drafters.lookahead import LookaheadDrafter
from sampling.drafters.model import ModelDrafter
from sampling.drafters.ngram import NGramDrafter, NGramStore
from sampling.drafters.prompt_lookup import PromptLookupDrafter
from sampling.registry import build_strategy
from sampling.settings import STRATEGIES, StrategySettings
from sampling.speculative import Speculative
from tests.helpers import random_heads
from utils.checks import SettingError
from utils.logits_processor import GreedyProcessor
from utils.runner import CachedModel

PROMPT = [2, 7, 1, 8, 2, 8]


@pytest.mark.parametrize("gamma", [0, -1, 1.5])
def test_bad_gamma(target_model, gamma):
    with pytest.raises(ValueError, match="gamma"):
        Speculative(CachedModel(target_model), NGramDrafter(), gamma)


@pytest.mark.parametrize("max_new", [-1, 2.5])
def test_bad_max_new_tokens(max_new):
    with pytest.raises(ValueError, match="max_new_tokens"):
        DecodeConfig(max_new_tokens=max_new)


@pytest.mark.parametrize("name", STRATEGIES)
def test_prompt_longer_than_the_context_is_refused_up_front(target_model, small_drafter_model, name):
    target, drafter = CachedModel(target_model), CachedModel(small_drafter_model)
    strategy = build_strategy(name, target, drafter, heads=random_heads(target_model))
    too_long = [1] * target_model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"{len(too_long)} tokens"):
        next(iter(strategy.stream(too_long, DecodeConfig(max_new_tokens=4))))
    with pytest.raises(ValueError, match="empty"):
        next(iter(strategy.stream([], DecodeConfig(max_new_tokens=4))))
    assert target.cache.get_seq_length() == 0  # nothing was run


def test_unknown_strategy_and_missing_drafter(target_model):
    with pytest.raises(ValueError, match="unknown strategy"):
        build_strategy("hydra", CachedModel(target_model), None)
    with pytest.raises(ValueError, match="needs a drafter"):
        build_strategy("speculative", CachedModel(target_model), None)


@pytest.mark.parametrize("name", STRATEGIES)
def test_rounds_add_up_to_the_result(target_model, small_drafter_model, name):
    strategy = build_strategy(name, CachedModel(target_model), CachedModel(small_drafter_model),
                              StrategySettings(gamma=3), random_heads(target_model))
    config = DecodeConfig(max_new_tokens=17)
    rounds = list(strategy.stream(PROMPT, config))
    result = strategy.generate(PROMPT, config)
    assert [t for r in rounds for t in r.tokens] == result.token_ids
    assert result.stats.new_tokens == len(result.token_ids) == 17
    assert all(r.accepted <= len(r.drafted) for r in rounds)
    assert [r.elapsed for r in rounds] == sorted(r.elapsed for r in rounds)
    assert result.stats.time_to_first_token <= result.stats.total_time


def test_stats_are_zero_safe_and_count_positions():
    empty = Stats()
    assert (empty.acceptance_rate, empty.mean_tokens_per_round, empty.tokens_per_second,
            empty.decode_tokens_per_second, empty.acceptance_by_position) == (0.0, 0.0, 0.0, 0.0, [])
    stats = Stats()
    stats.add(Round([1, 2, 3], drafted=[1, 2, 9], accepted=2, elapsed=0.5))
    stats.add(Round([4], drafted=[5], accepted=0, elapsed=1.0))
    stats.add(Round([6, 7], drafted=[6], accepted=1, elapsed=2.0))
    assert stats.acceptance_rate == pytest.approx(3 / 5)
    assert stats.mean_tokens_per_round == 2.0
    assert stats.acceptance_by_position == [2 / 3, 1.0, 0.0]
    assert stats.time_to_first_token == 0.5 and stats.tokens_per_second == 3.0
    assert stats.decode_tokens_per_second == pytest.approx(5 / 1.5)
    assert set(stats.as_dict()) >= {"acceptance_rate", "tokens_per_second", "acceptance_by_position"}


def test_combined_stats_are_ratios_of_sums():
    """Stats.combine is the one formula the benchmark's summaries and the chat's session totals use: rates over all
    tokens and seconds; decode rates leave each generation's first token and its time out (an empty one adds none);
    a count one generation lacks (None, as HF's) makes the sum None; position counts and drafters' own counts add."""
    spec = Stats()
    spec.add(Round([1, 2, 3], drafted=[1, 2, 9], accepted=2, elapsed=0.5, extra={"pool_hits": 2}))
    spec.add(Round([4], drafted=[5], accepted=0, elapsed=1.0, extra={"pool_hits": 0}))
    plain = Stats()
    for i, t in enumerate((0.2, 0.4, 0.6, 1.0)):
        plain.add(Round([i], elapsed=t))
    both = Stats.combine([spec, plain, Stats()])
    assert (both.runs, both.new_tokens, both.rounds, both.total_time) == (3, 8, 6, 2.0)
    assert both.tokens_per_second == 4.0 and both.mean_tokens_per_round == pytest.approx(8 / 6)
    assert both.decode_tokens_per_second == pytest.approx((3 + 3) / (0.5 + 0.8))
    assert both.mean_time_to_first_token == pytest.approx(0.7 / 3)
    assert both.acceptance_by_position == [0.5, 1.0, 0.0] and both.tested == spec.tested == 4
    assert both.extra == {"pool_hits": 2} and both.tokens_by_round == [3, 1, 1, 1, 1, 1]
    hf = Stats.measured(5, 2, 0.1, 0.5, tokens_by_round=[1, 4])
    assert (hf.drafted, hf.acceptance_by_position, hf.decode_tokens_per_second) == (None, None, 10.0)
    mixed = Stats.combine([spec, hf])
    assert mixed.drafted is None and mixed.drafted_by_position is None and mixed.new_tokens == 9
    with pytest.raises(ValueError, match="unknown count 'pool_hits'"):
        Stats.measured(1, 1, 0.1, 0.1, pool_hits=1)


def test_rounds_and_drafts_are_built_with_keywords():
    """Only the tokens are positional: an 8-field positional Round (the loop's old one) is refused."""
    with pytest.raises(TypeError):
        Round([1, 2], [1], 1)
    with pytest.raises(TypeError):
        Draft([1, 2], None)


def test_the_loop_takes_the_drafters_counts_from_its_drafts(target_model):
    """A drafter reports its cost in the Draft it returns: the loop reads no counter off the drafter object."""

    class Costly(PromptLookupDrafter):
        def propose(self, ids, k, processor, generator):
            return Draft(super().propose(ids, k, processor, generator).tokens, forwards=3)

    result = Speculative(CachedModel(target_model), Costly(), 4).generate(PROMPT, DecodeConfig(max_new_tokens=12))
    assert result.stats.drafter_forwards == 3 * result.stats.rounds and result.stats.extra == {}


def test_clip_stops_at_the_earliest_end_and_the_budget():
    assert clip([5, 6, 7, 6], (7, 6), budget=10) == ([5, 6], True)
    assert clip([5, 6, 7], (9,), budget=2) == ([5, 6], False)
    assert clip([5, 6, 7], (7,), budget=2) == ([5, 6], False)


def test_ngram_store_backs_off_to_shorter_contexts():
    store = NGramStore(n=3, kind="basic")
    store.add([1, 2, 3, 1, 2, 4, 1, 2, 4, 9, 2, 5])
    assert store.next_token([1, 2]) == 4  # seen twice after (1, 2), once 3
    assert store.next_token([7, 9]) == 2  # (7, 9) never seen: backs off to (9,), followed by 2
    one_level = NGramStore(n=3, kind="one-level")
    one_level.add([1, 2, 3, 1, 2, 4, 1, 2, 4, 9, 2, 5])
    assert one_level.next_token([7, 9]) is None
    assert store.chain([0, 1, 2], 3) == [4, 1, 2]


def test_prompt_lookup_copies_the_latest_match():
    drafter = PromptLookupDrafter(max_ngram=2, min_ngram=1)
    drafter.start([])
    ids = [5, 6, 7, 8, 1, 5, 6, 9, 9, 5, 6]
    assert drafter.propose(ids, 3, GreedyProcessor(), None).tokens == [9, 9, 5]
    assert drafter.propose(ids + [4], 3, GreedyProcessor(), None).tokens == []


def test_prompt_lookup_fills_a_tree_with_the_other_copies():
    ids = [5, 6, 7, 8, 1, 5, 6, 9, 9, 5, 6, 2, 4, 5, 6]
    # "5 6" was followed by "7 8 1", "9 9 5" and "2 4 5"; "6" by the same: the latest copy first, then the others
    tree = PromptLookupDrafter(max_ngram=2, min_ngram=1, max_tree=9).propose(ids, 3, GreedyProcessor(), None)
    assert (tree.tokens, tree.parents) == ([2, 4, 5, 9, 9, 5, 7, 8, 1], [-1, 0, 1, -1, 3, 4, -1, 6, 7])
    small = PromptLookupDrafter(max_ngram=2, min_ngram=1, max_tree=5).propose(ids, 3, GreedyProcessor(), None)
    assert (small.tokens, small.parents) == ([2, 4, 5, 9, 9], [-1, 0, 1, -1, 3])
    chain = PromptLookupDrafter(max_ngram=2, min_ngram=1, max_tree=3).propose(ids, 3, GreedyProcessor(), None)
    assert (chain.tokens, chain.parents) == ([2, 4, 5], None)
    # copies that share a beginning share its nodes: "1 2" was followed by "3 4" and "3 5"
    shared = PromptLookupDrafter(max_ngram=2, min_ngram=2, max_tree=9).propose([1, 2, 3, 5, 1, 2, 3, 4, 1, 2], 2,
                                                                              GreedyProcessor(), None)
    assert (shared.tokens, shared.parents) == ([3, 4, 5], [-1, 0, 0])


BAD_SETTINGS = [("gamma", 0), ("gamma", 2.5), ("draft_confidence", 1.0), ("draft_adaptive", "yes"),
                ("draft_cumulative", -0.1), ("draft_cumulative", float("nan")), ("draft_alternatives", 9),
                ("verify_width", 1), ("copy_gamma", 0), ("auto_min_match", 0), ("ngram_n", 1),
                ("ngram_kind", "trie"), ("ngram_filler_top_k", -1), ("ngram_reset_each_prompt", 1),
                ("lookup_max_ngram", 0), ("lookup_min_ngram", 4), ("lookahead_window", 1), ("lookahead_ngram", 1),
                ("lookahead_candidates", -1), ("num_beams", 0), ("num_beams", 65), ("beam_top_k", 0),
                ("length_penalty", float("inf")), ("min_length", -1)]


@pytest.mark.parametrize("setting, value", BAD_SETTINGS)
def test_every_strategy_setting_is_checked_where_it_is_defined(setting, value):
    """Bug: bounds lived in infer.py, bench.py and the slash-commands and drifted (`--lookahead 1 3 1` passed the
    command line's check, then the drafter refused a window of 1 after loading). Now the dataclass refuses, with a
    one-line message that names the setting."""
    with pytest.raises(SettingError) as error:
        StrategySettings(**{setting: value})
    assert error.value.setting == setting and str(error.value).startswith(f"{setting} must be ")
    assert "\n" not in str(error.value)


CONSTRUCTOR_BOUNDS = [
    ("gamma", 0, lambda lm: Speculative(lm, NGramDrafter(), 0)),
    ("lookahead_window", 17, lambda lm: LookaheadDrafter(window=17)),
    ("lookahead_ngram", 9, lambda lm: LookaheadDrafter(ngram=9)),
    ("lookahead_candidates", 17, lambda lm: LookaheadDrafter(candidates=17)),
    ("ngram_n", 17, lambda lm: NGramDrafter(17)),
    ("ngram_kind", "fancy", lambda lm: NGramDrafter(3, "fancy")),
    ("ngram_filler_top_k", 65, lambda lm: NGramDrafter(filler_top_k=65)),
    ("draft_confidence", 1.0, lambda lm: ModelDrafter(lm, 97, confidence=1.0)),
    ("draft_cumulative", -0.1, lambda lm: ModelDrafter(lm, 97, cumulative=-0.1)),
    ("draft_alternatives", 9, lambda lm: ModelDrafter(lm, 97, alternatives=9)),
    ("num_beams", 65, lambda lm: BeamSearch(lm.model, num_beams=65)),
    ("beam_top_k", 0, lambda lm: BeamSearch(lm.model, top_k=0)),
    ("min_length", -1, lambda lm: BeamSearch(lm.model, min_length=-1)),
]


@pytest.mark.parametrize("setting, value, build", CONSTRUCTOR_BOUNDS, ids=[c[0] for c in CONSTRUCTOR_BOUNDS])
def test_a_constructor_refuses_what_the_settings_refuse_in_the_same_words(target_model, setting, value, build):
    """Bug: the drafters and strategies kept their own bounds and wording (a window of 17 passed the drafter, not
    the settings; an alternatives count had no cap)."""
    with pytest.raises(SettingError) as by_settings:
        StrategySettings(**{setting: value})
    with pytest.raises(SettingError) as by_constructor:
        build(CachedModel(target_model))
    assert str(by_constructor.value) == str(by_settings.value)


def test_every_default_setting_passes_its_own_check_unchanged():
    defaults = StrategySettings()
    for setting in StrategySettings.__dataclass_fields__:
        assert StrategySettings(**{setting: getattr(defaults, setting)}) == defaults


@pytest.mark.parametrize("seed", [-1, 2**63, 2**64, 1.5])
def test_a_seed_torch_cannot_take_is_refused_when_the_config_is_built(seed):
    """Bug: `--seed 18446744073709551616` overflowed only when the first generation made its generator."""
    with pytest.raises(SettingError, match="seed must be an integer from 0 to"):
        DecodeConfig(seed=seed)
    DecodeConfig(seed=2**63 - 1).make_generator()
