"""Drafting economies (confidence stop, cumulative-confidence stop, adaptive draft length) and the automatic combined
drafter save drafter work without changing the output."""

import copy

import pytest
import torch

from sampling.autoregressive import Autoregressive
from sampling.base import DecodeConfig
from sampling.drafters.combined import CombinedDrafter
from sampling.drafters.model import ModelDrafter
from sampling.drafters.prompt_lookup import PromptLookupDrafter
from sampling.speculative import Speculative
from utils.logits_processor import GreedyProcessor, make_processor
from utils.runner import CachedModel

PROMPT = [5, 17, 42, 8, 5, 17, 42, 9, 33, 5, 17]
CONFIG = DecodeConfig(max_new_tokens=40)


@pytest.fixture(scope="module")
def expected(target_model):
    return Autoregressive(CachedModel(target_model)).generate(PROMPT, CONFIG).token_ids


@pytest.mark.parametrize("confidence, adaptive, cumulative", [(0.0, True, 0.0), (0.5, False, 0.0), (0.3, True, 0.0),
                                                               (0.0, False, 0.5), (0.2, False, 0.3)])
@pytest.mark.parametrize("drafter", ["self", "small"])
def test_economies_keep_greedy_output(target_model, small_drafter_model, expected, confidence, adaptive, cumulative,
                                      drafter):
    model = target_model if drafter == "self" else small_drafter_model
    plain = Speculative(CachedModel(target_model), ModelDrafter(CachedModel(model), 97), 6).generate(PROMPT, CONFIG)
    thrifty = Speculative(CachedModel(target_model),
                          ModelDrafter(CachedModel(model), 97, confidence, adaptive, cumulative=cumulative), 6)
    result = thrifty.generate(PROMPT, CONFIG)
    assert result.token_ids == plain.token_ids == expected
    if drafter == "small":  # a drafter that is always wrong: the economies cut its wasted forwards
        assert result.stats.drafter_forwards < plain.stats.drafter_forwards


def test_a_model_drafts_cost_is_in_its_draft(target_model, small_drafter_model):
    """Each Draft carries the drafter forwards spent on it; the rounds' counts are theirs, and add up to the cache's."""
    lm = CachedModel(small_drafter_model)
    drafter = ModelDrafter(lm, 97, cumulative=0.3)
    drafter.start(PROMPT)
    draft = drafter.propose(PROMPT, 5, GreedyProcessor(), None)
    assert 1 <= draft.forwards == lm.forwards <= 5  # a prefill, then one forward per token after the first
    rounds = list(Speculative(CachedModel(target_model), drafter, 5).stream(PROMPT, CONFIG))
    assert sum(r.drafter_forwards for r in rounds) == lm.forwards - draft.forwards


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
    with pytest.raises(ValueError, match="cumulative"):
        ModelDrafter(CachedModel(target_model), 97, cumulative=-0.1)


@pytest.fixture(scope="module")
def confident_model(noisy_copy_model):
    """A drafter sure of itself (sharpened output layer): its drafts run several tokens before the product of its
    probabilities falls below a threshold."""
    model = copy.deepcopy(noisy_copy_model)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    return model


@pytest.mark.parametrize("processor", [GreedyProcessor(), make_processor(temperature=1.0)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("cumulative, length", [(0.9, 1), (0.5, 2), (0.1, 5)])
def test_cumulative_stop_ends_the_draft_where_the_product_of_drafter_probabilities_falls_below_it(
        confident_model, processor, cumulative, length):
    drafter = ModelDrafter(CachedModel(confident_model), 97, cumulative=cumulative)
    draft = drafter.propose(PROMPT, 12, processor, torch.Generator().manual_seed(3))
    with torch.inference_mode():
        logits = confident_model(torch.tensor([PROMPT + draft.tokens])).logits[0, len(PROMPT) - 1:-1]
    probs = logits.softmax(-1)[torch.arange(len(draft)), draft.tokens]  # the drafter's probability of each draft
    products = probs.cumprod(0)
    if processor.is_greedy:  # sampled drafts are other tokens, whose products fall elsewhere
        assert len(draft) == length
    assert (products[:-1] >= cumulative).all()  # stopped at the first one below, or at the 12 asked for
    assert products[-1] < cumulative or len(draft) == 12


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_combined_drafter_is_lossless_and_uses_both_sources(target_model, small_drafter_model, expected, gamma):
    drafter = CombinedDrafter(PromptLookupDrafter(3, 1), ModelDrafter(CachedModel(small_drafter_model), 97), 3,
                              min_copy=1)
    result = Speculative(CachedModel(target_model), drafter, gamma).generate(PROMPT, CONFIG)
    assert result.token_ids == expected
    assert 0 < drafter.copied < result.stats.rounds  # some rounds copied, others asked the model
    assert result.stats.drafter_forwards > 0


def test_alternatives_are_the_drafters_next_best_tokens_beside_its_chain(noisy_copy_model):
    draft = ModelDrafter(CachedModel(noisy_copy_model), 97, alternatives=2).propose(PROMPT, 3, GreedyProcessor(), None)
    chain = ModelDrafter(CachedModel(noisy_copy_model), 97).propose(PROMPT, 3, GreedyProcessor(), None).tokens
    assert draft.tokens[:3] == chain and draft.q is None
    assert draft.parents == [-1, 0, 1, -1, -1, 0, 0, 1, 1]  # the chain, then two leaves per depth beside it
    with torch.inference_mode():
        for depth in range(3):
            logits = noisy_copy_model(torch.tensor([PROMPT + chain[:depth]])).logits[0, -1]
            assert draft.tokens[3 + 2 * depth: 5 + 2 * depth] == logits.topk(3).indices[1:].tolist()


def test_a_capped_tree_keeps_the_chain_and_the_alternatives_likeliest_to_commit(noisy_copy_model):
    full = ModelDrafter(CachedModel(noisy_copy_model), 97, alternatives=2).propose(PROMPT, 3, GreedyProcessor(), None)
    chain = full.tokens[:3]
    # Each alternative's chance as the drafter rates it: its chain's tokens before it, then it.
    with torch.inference_mode():
        probs = noisy_copy_model(torch.tensor([PROMPT + chain])).logits[0, len(PROMPT) - 1:].float().softmax(-1)
    reach = [1.0, float(probs[0, chain[0]]), float(probs[0, chain[0]] * probs[1, chain[1]])]
    rated = sorted(((reach[full.parents[i] + 1] * float(probs[full.parents[i] + 1, full.tokens[i]]), i)
                    for i in range(3, 9)), reverse=True)
    for cap in (3, 4, 6, 9, 20):
        draft = ModelDrafter(CachedModel(noisy_copy_model), 97, alternatives=2, max_tree=cap).propose(
            PROMPT, 3, GreedyProcessor(), None)
        kept = sorted(i for _, i in rated[: max(cap - 3, 0)])  # in depth order, as the uncapped tree lists them
        assert draft.tokens == chain + [full.tokens[i] for i in kept]
        assert draft.parents == ([-1, 0, 1] + [full.parents[i] for i in kept] if kept else None)  # None: a chain
    assert len({value for value, _ in rated}) == 6  # distinct ratings: the order checked above is not a tie's


def test_the_tree_cap_is_checked(target_model):
    for bad in (0, 2.5):
        with pytest.raises(ValueError, match="max_tree must be an integer >= 1"):
            ModelDrafter(CachedModel(target_model), 97, alternatives=1, max_tree=bad)


def test_alternatives_are_for_greedy_only(noisy_copy_model):
    drafter = ModelDrafter(CachedModel(noisy_copy_model), 97, alternatives=2)
    draft = drafter.propose(PROMPT, 3, make_processor(temperature=1.0), torch.Generator().manual_seed(0))
    assert draft.parents is None and len(draft) == 3 and draft.q.shape == (3, 97)


@pytest.mark.parametrize("alternatives", [0, 1, 3])
def test_an_alternative_the_target_picks_commits_one_more_token(target_model, noisy_copy_model, expected, alternatives):
    drafter = ModelDrafter(CachedModel(noisy_copy_model), 97, alternatives=alternatives)
    rounds = list(Speculative(CachedModel(target_model), drafter, 4).stream(PROMPT, CONFIG))
    assert [t for r in rounds for t in r.tokens] == expected
    # A round that ended on a leaf: its accepted path (the candidate it belongs to) is shorter than the chain and
    # wholly accepted. A chain can only end like that when the budget cut the draft.
    on_leaf = [r for r in rounds if r.accepted == len(r.drafted) < 4 and r is not rounds[-1]]
    assert (len(on_leaf) > 0) == (alternatives > 0)
    assert all(len(r.tokens) == r.accepted + 1 for r in on_leaf)


def test_bad_alternatives(target_model):
    for bad in (-1, 1.5):
        with pytest.raises(ValueError, match="alternatives"):
            ModelDrafter(CachedModel(target_model), 97, alternatives=bad)
