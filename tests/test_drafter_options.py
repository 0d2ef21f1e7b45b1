"""Drafting economies (confidence stop, adaptive draft length) and the automatic combined drafter save drafter work
without changing the output."""

import pytest

from sampling.autoregressive import Autoregressive
from sampling.base import DecodeConfig
from sampling.drafters.combined import CombinedDrafter
from sampling.drafters.model import ModelDrafter
from sampling.drafters.prompt_lookup import PromptLookupDrafter
from sampling.speculative import Speculative
from utils.caching import CachedModel

PROMPT = [5, 17, 42, 8, 5, 17, 42, 9, 33, 5, 17]
CONFIG = DecodeConfig(max_new_tokens=40)


@pytest.fixture(scope="module")
def expected(target_model):
    return Autoregressive(CachedModel(target_model)).generate(PROMPT, CONFIG).token_ids


@pytest.mark.parametrize("confidence, adaptive", [(0.0, True), (0.5, False), (0.3, True)])
@pytest.mark.parametrize("drafter", ["self", "small"])
def test_economies_keep_greedy_output(target_model, small_drafter_model, expected, confidence, adaptive, drafter):
    model = target_model if drafter == "self" else small_drafter_model
    plain = Speculative(CachedModel(target_model), ModelDrafter(CachedModel(model), 97), 6).generate(PROMPT, CONFIG)
    thrifty = Speculative(CachedModel(target_model), ModelDrafter(CachedModel(model), 97, confidence, adaptive), 6)
    result = thrifty.generate(PROMPT, CONFIG)
    assert result.token_ids == plain.token_ids == expected
    if drafter == "small":  # a drafter that is always wrong: the economies cut its wasted forwards
        assert result.stats.drafter_forwards < plain.stats.drafter_forwards


def test_adaptive_length_grows_after_full_acceptance_and_shrinks_after_rejection(target_model, small_drafter_model):
    good = ModelDrafter(CachedModel(target_model), 97, adaptive=True)
    lengths = [len(r.drafted) for r in Speculative(CachedModel(target_model), good, 10).stream(PROMPT, CONFIG)]
    assert lengths[:3] == [10, 10, 10]  # capped at the loop's k
    bad = ModelDrafter(CachedModel(small_drafter_model), 97, adaptive=True)
    lengths = [len(r.drafted) for r in Speculative(CachedModel(target_model), bad, 4).stream(PROMPT, CONFIG)]
    assert lengths[:5] == [4, 3, 2, 1, 1]


def test_bad_confidence_threshold(target_model):
    with pytest.raises(ValueError, match="confidence"):
        ModelDrafter(CachedModel(target_model), 97, confidence=1.0)


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_combined_drafter_is_lossless_and_uses_both_sources(target_model, small_drafter_model, expected, gamma):
    drafter = CombinedDrafter(PromptLookupDrafter(3, 1), ModelDrafter(CachedModel(small_drafter_model), 97), 3,
                              min_copy=1)
    result = Speculative(CachedModel(target_model), drafter, gamma).generate(PROMPT, CONFIG)
    assert result.token_ids == expected
    assert 0 < drafter.copied < result.stats.rounds  # some rounds copied, others asked the model
    assert result.stats.drafter_forwards > 0
