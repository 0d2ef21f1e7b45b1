"""benchmarks.accuracy: teacher-forced top-1 agreement and perplexity against a reference model."""

import copy
import math

import pytest
import torch

from benchmarks.accuracy import Agreement, compare, next_token_logits, perplexity
from tests.helpers import tiny_model

TEXT = [(i * 31 + 7) % 97 for i in range(300)]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0, dtype=torch.float32)


def test_chunked_logits_equal_one_whole_forward(model):
    whole = model(torch.tensor([TEXT[:-1]])).logits[0]
    assert torch.allclose(next_token_logits(model, TEXT, chunk=64), whole, atol=1e-4)


def test_perplexity_is_the_exponentiated_mean_negative_log_likelihood():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1]]))
    assert perplexity(logits, [0, 1, 1]) == pytest.approx(math.exp(-(math.log(0.25) + math.log(0.8)) / 2))


def test_a_model_agrees_with_itself_and_a_perturbed_copy_is_caught(model):
    same = compare(model, model, TEXT)
    assert same.tokens == len(TEXT) - 1 and same.top1 == 1.0 and same.passes
    noisy = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * p.std() * 0.5)
    worse = compare(noisy, model, TEXT)
    assert worse.top1 < 0.99 and not worse.passes
    assert "fails the gate" in worse.line()


def test_the_gate_wants_both_agreement_and_perplexity():
    assert Agreement(1000, 0.995, 10.05, 10.0).passes
    assert not Agreement(1000, 0.985, 10.0, 10.0).passes  # agreement below 99%
    assert not Agreement(1000, 0.999, 10.2, 10.0).passes  # perplexity 2% worse
