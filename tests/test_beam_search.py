"""Beam search: one beam is greedy; enough beams find the best-scoring sequence found by enumeration."""

import itertools

import pytest
import torch

from sampling.autoregressive import Autoregressive
from sampling.base import DecodeConfig
from sampling.beam_search import BeamSearch, length_penalty
from tests.helpers import tiny_model
from utils.runner import CachedModel

PROMPT = [3, 1, 4, 1, 5]


def test_one_beam_equals_greedy(target_model):
    config = DecodeConfig(max_new_tokens=25)
    greedy = Autoregressive(CachedModel(target_model)).generate(PROMPT, config).token_ids
    assert BeamSearch(target_model, num_beams=1, top_k=1).generate(PROMPT, config).token_ids == greedy


def test_length_penalty_is_gnmt():
    assert length_penalty(1, 0.0) == 1.0
    assert length_penalty(7, 1.0) == pytest.approx(2.0)
    assert length_penalty(3, 0.5) == pytest.approx((8 / 6) ** 0.5)


@torch.inference_mode()
def enumerate_best(model, prompt, vocab, max_new, end, alpha, min_length):
    """Every sequence that ends on `end` (not before min_length) or reaches max_new, scored like beam search."""
    best = None
    for length in range(1, max_new + 1):
        for seq in itertools.product(range(vocab), repeat=length):
            ended = seq[-1] == end
            if end in seq[:-1] or (length < max_new and not ended) or (ended and length <= min_length):
                continue
            logits = model(input_ids=torch.tensor([prompt + list(seq)])).logits[0, len(prompt) - 1:-1]
            log_prob = torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq)[:, None]).sum().item()
            score = log_prob / length_penalty(length, alpha)
            if best is None or score > best[0]:
                best = (score, list(seq))
    return best


@pytest.mark.parametrize("alpha, min_length", [(0.0, 0), (1.0, 0), (2.0, 2)])
def test_exhaustive_beams_find_the_best_sequence(alpha, min_length):
    vocab, max_new, end = 4, 3, 0
    model = tiny_model(vocab_size=vocab, seed=5, layers=1, hidden=16)
    prompt = [3, 1]
    score, expected = enumerate_best(model, prompt, vocab, max_new, end, alpha, min_length)
    beam = BeamSearch(model, num_beams=vocab ** max_new, top_k=vocab, alpha=alpha, min_length=min_length)
    result = beam.generate(prompt, DecodeConfig(max_new_tokens=max_new, end_ids=(end,)))
    assert result.token_ids == expected
    assert result.finished == (expected[-1] == end)


def test_min_length_delays_the_end_token(target_model):
    greedy = Autoregressive(CachedModel(target_model)).generate(PROMPT, DecodeConfig(max_new_tokens=10)).token_ids
    end = greedy[0]  # the most likely first token becomes an end token
    short = BeamSearch(target_model, num_beams=2).generate(PROMPT, DecodeConfig(max_new_tokens=10, end_ids=(end,)))
    delayed = BeamSearch(target_model, num_beams=2, min_length=4).generate(
        PROMPT, DecodeConfig(max_new_tokens=10, end_ids=(end,)))
    assert end not in delayed.token_ids[:4]
    assert len(delayed.token_ids) >= 5 or not delayed.finished
    assert short.token_ids != delayed.token_ids


def test_beam_output_respects_max_new_tokens(target_model):
    for max_new in (0, 1, 7):
        result = BeamSearch(target_model, num_beams=3).generate(PROMPT, DecodeConfig(max_new_tokens=max_new))
        assert len(result.token_ids) == max_new


@pytest.mark.parametrize("kwargs", [{"num_beams": 0}, {"num_beams": 2, "top_k": 0}, {"min_length": -1}])
def test_bad_beam_parameters(target_model, kwargs):
    with pytest.raises(ValueError):
        BeamSearch(target_model, **kwargs)
