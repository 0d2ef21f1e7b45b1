"""Processors against hand-computed values; they never mutate their input and reject bad parameters."""

import math

import pytest
import torch

from utils.checks import SettingError
from utils.logits_processor import (
    MIN_TEMPERATURE,
    GreedyProcessor,
    MinPProcessor,
    MultinomialProcessor,
    NucleusProcessor,
    TopKNucleusProcessor,
    TopKProcessor,
    make_processor,
)

LOGITS = torch.tensor([2.0, 1.0, 0.0, -1.0])  # softmax: 0.6439, 0.2369, 0.0871, 0.0321


def softmax_of(values):
    e = [math.exp(v) for v in values]
    return [x / sum(e) for x in e]


def test_greedy_is_exact_argmax_one_hot():
    probs = GreedyProcessor().probs(torch.tensor([[0.1, 3.0, 2.9], [5.0, -1.0, 4.99]]))
    assert probs.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    assert GreedyProcessor().sample(probs).tolist() == [1, 0]


def test_multinomial_temperature_scales_logits():
    probs = MultinomialProcessor(temperature=2.0).probs(LOGITS)
    assert probs.tolist() == pytest.approx(softmax_of([1.0, 0.5, 0.0, -0.5]), abs=1e-6)


def test_top_k_keeps_k_most_likely_after_temperature():
    probs = TopKProcessor(temperature=0.5, top_k=2).probs(LOGITS)
    expected = softmax_of([4.0, 2.0]) + [0.0, 0.0]
    assert probs.tolist() == pytest.approx(expected, abs=1e-6)


def test_nucleus_keeps_smallest_set_reaching_top_p():
    # 0.6439 < 0.8 so the second token is needed; 0.6439 + 0.2369 = 0.8808 >= 0.8, so the third is dropped.
    probs = NucleusProcessor(top_p=0.8).probs(LOGITS)
    assert probs.tolist() == pytest.approx(softmax_of([2.0, 1.0]) + [0.0, 0.0], abs=1e-6)
    # A top_p below the first token's probability keeps that token alone.
    assert NucleusProcessor(top_p=0.1).probs(LOGITS).tolist() == pytest.approx([1.0, 0, 0, 0])
    assert NucleusProcessor(top_p=1.0).probs(LOGITS).tolist() == pytest.approx(softmax_of(LOGITS.tolist()), abs=1e-6)


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_nucleus_over_a_large_vocabulary_keeps_what_a_whole_sort_keeps(top_p):
    """The nucleus is ranked over the likeliest tokens first (more while a row's nucleus reaches past them): the
    same tokens as ranking the whole vocabulary, from rows whose nucleus is one token to rows of thousands."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5000, generator=generator, dtype=torch.float64) * torch.tensor([[12.0], [6], [3], [1],
                                                                                          [0.3], [0.05]])
    ordered, order = logits.sort(dim=-1, descending=True)
    ranked = ordered.softmax(-1)
    drop = ((ranked.cumsum(-1) - ranked) >= top_p).scatter(-1, order, (ranked.cumsum(-1) - ranked) >= top_p)
    kept = NucleusProcessor(top_p=top_p)(logits) > float("-inf")
    assert torch.equal(kept, ~drop)
    assert kept.sum(-1)[0] < 64 < kept.sum(-1)[-1]  # some rows within the first ranked tokens, some far past them


def test_top_k_then_top_p():
    probs = TopKNucleusProcessor(temperature=1.0, top_k=3, top_p=0.95).probs(LOGITS)
    # After top-3 renormalisation: 0.6652, 0.2447, 0.0900; the first two reach 0.9099 < 0.95, so all three stay.
    assert probs.tolist() == pytest.approx(softmax_of([2.0, 1.0, 0.0]) + [0.0], abs=1e-6)


def test_min_p_drops_tokens_below_fraction_of_best():
    probs = MinPProcessor(min_p=0.3).probs(LOGITS)  # threshold 0.3 * 0.6439 = 0.193: keeps the first two
    assert probs.tolist() == pytest.approx(softmax_of([2.0, 1.0]) + [0.0, 0.0], abs=1e-6)


@pytest.mark.parametrize("processor", [GreedyProcessor(), MultinomialProcessor(0.7), TopKProcessor(0.7, 2),
                                       NucleusProcessor(0.7, 0.5), TopKNucleusProcessor(0.7, 3, 0.5),
                                       MinPProcessor(0.7, 0.2)])
def test_processors_never_mutate_and_work_on_any_leading_shape(processor):
    logits = torch.randn(2, 3, 11)
    before = logits.clone()
    probs = processor.probs(logits)
    assert torch.equal(logits, before)
    assert probs.shape == (2, 3, 11)
    assert torch.allclose(probs.sum(-1), torch.ones(2, 3))
    assert processor.sample(probs, torch.Generator().manual_seed(0)).shape == (2, 3)


def test_bf16_logits_are_processed_in_float32():
    assert MultinomialProcessor().probs(LOGITS.bfloat16()).dtype == torch.float32


@pytest.mark.parametrize("make", [lambda: MultinomialProcessor(0), lambda: MultinomialProcessor(-1),
                                  lambda: TopKProcessor(1.0, 0), lambda: TopKProcessor(1.0, 2.5),
                                  lambda: NucleusProcessor(1.0, 0.0), lambda: NucleusProcessor(1.0, 1.5),
                                  lambda: TopKNucleusProcessor(1.0, 0, 0.5), lambda: MinPProcessor(1.0, 0)])
def test_bad_parameters_raise_value_error(make):
    with pytest.raises(ValueError):
        make()


def test_sampling_follows_probabilities_with_explicit_generator():
    processor = MultinomialProcessor()
    probs = processor.probs(LOGITS)
    draws = processor.sample(probs.expand(20000, -1), torch.Generator().manual_seed(1))
    freq = torch.bincount(draws, minlength=4).double() / 20000
    assert torch.allclose(freq, probs.double(), atol=0.015)
    again = processor.sample(probs.expand(20000, -1), torch.Generator().manual_seed(1))
    assert torch.equal(draws, again)


def test_sample_follows_unnormalized_weights_and_never_draws_a_weight_of_zero():
    from tests.distribution import chi_square_test
    from utils.logits_processor import sample

    weights = torch.zeros(2, 1000, dtype=torch.float32)  # zeros first, between and last
    weights[:, [3, 10, 11, 500, 998]] = torch.tensor([4.0, 1.0, 0.5, 2.0, 2.5])
    draws = sample(weights.repeat(10000, 1).reshape(-1, 2, 1000), torch.Generator().manual_seed(5))
    assert draws.shape == (10000, 2)
    expected = {(int(i),): float(w) / 10.0 for i, w in enumerate(weights[0]) if w > 0}
    stat, critical = chi_square_test([(int(t),) for t in draws.flatten()], expected)
    assert stat <= critical
    one_hot = torch.zeros(1000)
    one_hot[0] = 1.0  # the first token alone: a draw of u = 0 takes it, as every other draw
    assert set(sample(one_hot.expand(500, -1), torch.Generator().manual_seed(6)).tolist()) == {0}


def test_make_processor_maps_hf_flags():
    assert isinstance(make_processor(0.0), GreedyProcessor)
    assert isinstance(make_processor(0.8), MultinomialProcessor)
    assert isinstance(make_processor(0.8, top_k=5), TopKProcessor)
    assert isinstance(make_processor(0.8, top_p=0.9), NucleusProcessor)
    assert isinstance(make_processor(0.8, top_k=5, top_p=0.9), TopKNucleusProcessor)


SAMPLERS = [MultinomialProcessor, TopKProcessor, NucleusProcessor, TopKNucleusProcessor, MinPProcessor]


@pytest.mark.parametrize("cls", SAMPLERS)
@pytest.mark.parametrize("temperature", [1e-45, 1e-300, MIN_TEMPERATURE / 2])
def test_a_temperature_below_the_floor_is_refused_and_points_to_greedy(cls, temperature):
    """Bug: `/processor multinomial 1e-45` (or `minp 1e-300 1`) was accepted, and the next prompt failed with
    "probability tensor contains inf/nan": logits / T overflowed."""
    with pytest.raises(ValueError, match=r"temperature .*use 0 for greedy"):
        cls(temperature)


@pytest.mark.parametrize("temperature", [float("inf"), float("nan"), -0.5])
def test_temperature_must_be_a_finite_positive_number(temperature):
    with pytest.raises(ValueError, match="temperature"):
        make_processor(temperature)


@pytest.mark.parametrize("cls", SAMPLERS)
def test_sampling_at_the_floor_gives_finite_probabilities(cls):
    """The floor is safe: large bf16 logits at the lowest temperature allowed still give a distribution."""
    logits = (torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 300).bfloat16()
    processor = cls(MIN_TEMPERATURE)
    probs = processor.probs(logits)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(3))
    assert processor.sample(probs, torch.Generator().manual_seed(0)).tolist() == logits.float().argmax(-1).tolist()


@pytest.mark.parametrize("kwargs, setting", [(dict(top_k=-1), "top_k"), (dict(top_p=2.0), "top_p"),
                                             (dict(min_p=0.0), "min_p"), (dict(top_k=2.5), "top_k")])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_make_processor_checks_every_value_even_those_greedy_ignores(kwargs, setting, temperature):
    """Bug: `--top-k -1` or `--top-p 2` with temperature 0 were accepted silently (greedy ignores them)."""
    with pytest.raises(SettingError) as error:
        make_processor(temperature, **kwargs)
    assert error.value.setting == setting
