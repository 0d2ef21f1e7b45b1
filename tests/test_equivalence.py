"""Greedy speculative decoding equals greedy autoregressive decoding token for token (float64, tiny models),
for every drafter, draft length and stopping rule."""

import copy

import pytest
import torch

from models.formats.quantize import quantize_weights
from sampling.autoregressive import Autoregressive
from sampling.base import DecodeConfig
from sampling.drafters.model import ModelDrafter
from sampling.drafters.ngram import NGramDrafter
from sampling.drafters.prompt_lookup import PromptLookupDrafter
from sampling.settings import StrategySettings
from sampling.speculative import Speculative
from tests.helpers import tiny_model
from utils.runner import CachedModel

PROMPT = [5, 17, 42, 8, 5, 17, 42, 9, 33, 5, 17]
MAX_NEW = 48


@pytest.fixture(scope="module")
def int4_drafter_models():
    """A bfloat16 drafter wide enough for the packed int4 kernel (inputs in groups of 128), and its dense weights."""
    dense = tiny_model(seed=2, layers=1, hidden=256, dtype=torch.bfloat16)
    int4 = copy.deepcopy(dense)
    quantize_weights(int4, "int4")
    assert type(int4.model.layers[0].self_attn.q_proj).__name__ == "Int4Linear"
    return int4, dense


@pytest.fixture(scope="module")
def reference(target_model):
    """Greedy autoregressive output, and an end token that occurs in the middle of it."""
    tokens = Autoregressive(CachedModel(target_model)).generate(PROMPT, DecodeConfig(max_new_tokens=MAX_NEW)).token_ids
    end_at = next(i for i in range(15, MAX_NEW) if tokens[i] not in tokens[:i])
    end = tokens[end_at]
    with_end = Autoregressive(CachedModel(target_model)).generate(
        PROMPT, DecodeConfig(max_new_tokens=MAX_NEW, end_ids=(end,)))
    assert with_end.finished and with_end.token_ids == tokens[: end_at + 1]
    return {"none": (tokens, ()), "end": (with_end.token_ids, (end,))}


DRAFTERS = {
    "self": lambda m: ModelDrafter(CachedModel(m["target"]), m["target"].config.vocab_size),
    "small": lambda m: ModelDrafter(CachedModel(m["small"]), m["target"].config.vocab_size),
    "noisy": lambda m: ModelDrafter(CachedModel(m["noisy"]), m["target"].config.vocab_size),
    "noisy-alternatives": lambda m: ModelDrafter(CachedModel(m["noisy"]), m["target"].config.vocab_size,
                                                 alternatives=2),
    "small-alternatives": lambda m: ModelDrafter(CachedModel(m["small"]), m["target"].config.vocab_size,
                                                 alternatives=3),
    # prompts prefilled by the target's weights, drafts decoded by the noisy copy's (an int8 drafter's dense prefill)
    "noisy-dense-prefill": lambda m: ModelDrafter(CachedModel(m["noisy"], prefill_model=m["target"], prefill_from=3),
                                                  m["target"].config.vocab_size),
    # a tree cap that drops alternatives: those kept sit at any depth
    "small-capped": lambda m: ModelDrafter(CachedModel(m["small"]), m["target"].config.vocab_size,
                                           alternatives=3, max_tree=6),
    # the shipped settings: alternatives per depth within the verify width, the cumulative stop
    "noisy-defaults": lambda m: ModelDrafter(CachedModel(m["noisy"]), m["target"].config.vocab_size,
                                             alternatives=StrategySettings.draft_alternatives,
                                             cumulative=StrategySettings.draft_cumulative,
                                             max_tree=StrategySettings.verify_width - 1),
    "self-cumulative": lambda m: ModelDrafter(CachedModel(m["target"]), m["target"].config.vocab_size,
                                              cumulative=StrategySettings.draft_cumulative),
    # the embedded preset's drafter: int4 weights decode (bfloat16 activations), dense weights prefill
    "int4-dense-prefill": lambda m: ModelDrafter(CachedModel(m["int4"], prefill_model=m["int4-dense"], prefill_from=3),
                                                 m["target"].config.vocab_size,
                                                 cumulative=StrategySettings.draft_cumulative),
    "ngram-basic": lambda m: NGramDrafter(3, "basic"),
    "ngram-one-level": lambda m: NGramDrafter(2, "one-level"),
    "ngram-filler": lambda m: NGramDrafter(4, "basic", filler_top_k=3),
    "lookup": lambda m: PromptLookupDrafter(3, 1),
    "lookup-tree": lambda m: PromptLookupDrafter(3, 1, max_tree=StrategySettings.verify_width - 1),
}


@pytest.mark.parametrize("stop", ["none", "end"])
@pytest.mark.parametrize("gamma", [1, 2, 4, 8, StrategySettings.gamma])
@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_greedy_speculative_equals_greedy_autoregressive(target_model, small_drafter_model, noisy_copy_model,
                                                         int4_drafter_models, reference, drafter, gamma, stop):
    models = {"target": target_model, "small": small_drafter_model, "noisy": noisy_copy_model,
              "int4": int4_drafter_models[0], "int4-dense": int4_drafter_models[1]}
    expected, end_ids = reference[stop]
    strategy = Speculative(CachedModel(target_model), DRAFTERS[drafter](models), gamma)
    result = strategy.generate(PROMPT, DecodeConfig(max_new_tokens=MAX_NEW, end_ids=end_ids))
    assert result.token_ids == expected
    assert result.finished == (stop == "end")
    if drafter == "self":  # the target drafting for itself: every draft is accepted
        assert result.stats.acceptance_rate == 1.0


def test_drafters_span_the_acceptance_range(target_model, small_drafter_model, noisy_copy_model):
    """The equivalence tests above cover all-accepted, mostly-rejected and mixed rounds."""
    models = {"target": target_model, "small": small_drafter_model, "noisy": noisy_copy_model}
    rates = {}
    for name in ("self", "small", "noisy"):
        strategy = Speculative(CachedModel(target_model), DRAFTERS[name](models), 4)
        rates[name] = strategy.generate(PROMPT, DecodeConfig(max_new_tokens=MAX_NEW)).stats.acceptance_rate
    assert rates["self"] == 1.0 and rates["small"] < 0.2 and 0.2 < rates["noisy"] < 0.95


def test_end_token_inside_an_accepted_block_ends_the_output_there(target_model, reference):
    """The target drafting for itself accepts whole blocks; the end token lands inside one."""
    expected, end_ids = reference["end"]
    strategy = Speculative(CachedModel(target_model),
                           ModelDrafter(CachedModel(target_model), target_model.config.vocab_size), gamma=8)
    rounds = list(strategy.stream(PROMPT, DecodeConfig(max_new_tokens=MAX_NEW, end_ids=end_ids)))
    last = rounds[-1]
    assert last.finished and last.tokens[-1] == end_ids[0]
    assert last.accepted > len(last.tokens) - 1  # drafts after the end token were accepted but not committed
    assert [t for r in rounds for t in r.tokens] == expected


@pytest.mark.parametrize("max_new", [0, 1, 2, 5, 13])
@pytest.mark.parametrize("gamma", [1, 4, 8])
def test_max_new_tokens_is_never_exceeded(target_model, reference, max_new, gamma):
    strategy = Speculative(CachedModel(target_model),
                           ModelDrafter(CachedModel(target_model), target_model.config.vocab_size), gamma)
    result = strategy.generate(PROMPT, DecodeConfig(max_new_tokens=max_new))
    assert result.token_ids == reference["none"][0][:max_new]
    assert result.stats.new_tokens == max_new and not result.finished


def test_greedy_output_does_not_depend_on_the_seed(target_model, small_drafter_model):
    outputs = set()
    for seed in (0, 1, None):
        strategy = Speculative(CachedModel(target_model),
                               ModelDrafter(CachedModel(small_drafter_model), target_model.config.vocab_size), 3)
        outputs.add(tuple(strategy.generate(PROMPT, DecodeConfig(max_new_tokens=20, seed=seed)).token_ids))
    assert len(outputs) == 1


def test_multi_turn_reuse_gives_the_same_output_as_a_fresh_cache(target_model, small_drafter_model):
    """A second prompt extending the first conversation reuses the caches and still matches a fresh run."""
    target, drafter_lm = CachedModel(target_model), CachedModel(small_drafter_model)
    strategy = Speculative(target, ModelDrafter(drafter_lm, target.vocab_size), 4)
    config = DecodeConfig(max_new_tokens=12)
    first = strategy.generate(PROMPT, config).token_ids
    second_prompt = PROMPT + first + [7, 7, 3]
    reused = strategy.generate(second_prompt, config).token_ids
    fresh = Autoregressive(CachedModel(target_model)).generate(second_prompt, config).token_ids
    assert reused == fresh
