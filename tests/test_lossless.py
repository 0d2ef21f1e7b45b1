"""Speculative sampling keeps the target's distribution exactly, with draft probabilities and with deterministic
drafts, under temperature, top-k and top-p.

Each test compares the empirical distribution of the first three new tokens (thousands of seeded runs on a toy
vocabulary) with the exact distribution computed by enumeration. A correct sampler fails one chi-square test with
probability FALSE_ALARM = 1e-4.
"""

import pytest
import torch

from sampling.autoregressive import Autoregressive
from sampling.base import DecodeConfig
from sampling.drafters.base import Draft, Drafter
from sampling.drafters.combined import CombinedDrafter
from sampling.drafters.model import ModelDrafter
from sampling.drafters.ngram import NGramDrafter
from sampling.drafters.prompt_lookup import PromptLookupDrafter
from sampling.speculative import Speculative
from sampling.verify import accept_stochastic
from tests.distribution import FALSE_ALARM, chi_square_test, exact_sequence_distribution
from tests.helpers import tiny_model
from utils.logits_processor import MultinomialProcessor, NucleusProcessor, TopKNucleusProcessor, TopKProcessor
from utils.runner import CachedModel

VOCAB, LENGTH, RUNS = 6, 3, 1500
PROMPT = [1, 4, 2]


@pytest.fixture(scope="module")
def toy_target():
    return tiny_model(vocab_size=VOCAB, seed=11, layers=1, hidden=16)


@pytest.fixture(scope="module")
def toy_drafter():
    return tiny_model(vocab_size=VOCAB, seed=12, layers=1, hidden=16)


class CyclicDrafter(Drafter):
    """Deterministic drafts (no q): each token is the previous one plus one, modulo the vocabulary."""

    name = "cyclic"

    def propose(self, ids, k, processor, generator):
        return Draft([(ids[-1] + 1 + i) % VOCAB for i in range(k)])


def sample_many(strategy, processor) -> list[tuple]:
    return [tuple(strategy.generate(PROMPT, DecodeConfig(max_new_tokens=LENGTH, processor=processor, seed=i)).token_ids)
            for i in range(RUNS)]


PROCESSORS = {
    "temperature": MultinomialProcessor(temperature=1.3),
    "top-k": TopKProcessor(temperature=0.9, top_k=3),
    "top-p": NucleusProcessor(temperature=1.0, top_p=0.8),
    "top-k+top-p": TopKNucleusProcessor(temperature=1.2, top_k=4, top_p=0.9),
}


@pytest.mark.slow
@pytest.mark.parametrize("processor_name, drafter_name", [
    ("temperature", "model"), ("top-k+top-p", "model"), ("top-p", "cyclic"), ("top-k", "ngram"),
    ("temperature", "auto"), ("temperature", "lookup-tree"),
])
def test_speculative_sampling_follows_the_target_distribution(toy_target, toy_drafter, processor_name, drafter_name):
    processor = PROCESSORS[processor_name]
    drafter = {"model": lambda: ModelDrafter(CachedModel(toy_drafter), VOCAB), "cyclic": CyclicDrafter,
               "ngram": lambda: NGramDrafter(2),
               "lookup-tree": lambda: PromptLookupDrafter(2, 1, max_tree=4),
               "auto": lambda: CombinedDrafter(PromptLookupDrafter(2, 1),
                                               ModelDrafter(CachedModel(toy_drafter), VOCAB, 0.3, True), 2, 1),
               }[drafter_name]()
    strategy = Speculative(CachedModel(toy_target), drafter, gamma=2)
    expected = exact_sequence_distribution(toy_target, PROMPT, LENGTH, processor)
    stat, critical = chi_square_test(sample_many(strategy, processor), expected)
    assert stat <= critical, f"chi-square {stat:.1f} > {critical:.1f} (false alarm {FALSE_ALARM})"


@pytest.mark.slow
def test_autoregressive_sampling_follows_the_target_distribution(toy_target):
    """The baseline itself, so that a shared bug cannot hide in both."""
    processor = PROCESSORS["top-k+top-p"]
    expected = exact_sequence_distribution(toy_target, PROMPT, LENGTH, processor)
    stat, critical = chi_square_test(sample_many(Autoregressive(CachedModel(toy_target)), processor), expected)
    assert stat <= critical


@pytest.mark.slow
def test_chi_square_test_rejects_a_biased_sampler(toy_target):
    """The test has power: sampling at temperature 1.6 is told apart from the exact temperature-1.0 distribution (at
    1.3 these runs tell it apart about one time in three)."""
    expected = exact_sequence_distribution(toy_target, PROMPT, LENGTH, MultinomialProcessor(1.0))
    samples = sample_many(Autoregressive(CachedModel(toy_target)), MultinomialProcessor(1.6))
    stat, critical = chi_square_test(samples, expected)
    assert stat > critical


@pytest.mark.slow
@pytest.mark.parametrize("with_q", [True, False])
def test_verification_rule_alone_is_exact(with_q):
    """accept_stochastic on fixed p and q rows: the first committed token follows p[0] whatever q is."""
    generator = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(3, VOCAB, generator=generator, dtype=torch.float64) * 2, -1)
    q = torch.softmax(torch.randn(2, VOCAB, generator=generator, dtype=torch.float64) * 2, -1)
    firsts = []
    for _ in range(20000):
        x = torch.multinomial(q, 1, generator=generator).squeeze(-1) if with_q else torch.tensor([2, 3])
        n, token = accept_stochastic(x, p, q if with_q else None, generator)
        firsts.append((int(x[0]),) if n >= 1 else (token,))
    stat, critical = chi_square_test(firsts, {(v,): float(p[0, v]) for v in range(VOCAB)})
    assert stat <= critical


def test_residual_zero_mass_falls_back_to_p():
    """p == q: every draft is accepted; the 0/0 residual never produces NaN."""
    p = torch.full((3, 4), 0.25, dtype=torch.float64)
    for seed in range(50):
        n, token = accept_stochastic(torch.tensor([0, 1]), p, p[:2], torch.Generator().manual_seed(seed))
        assert n == 2 and 0 <= token < 4


def test_rejected_deterministic_draft_is_never_resampled():
    """A one-hot draft x rejected: the correction comes from p with x removed."""
    p = torch.tensor([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]], dtype=torch.float64)
    for seed in range(200):
        n, token = accept_stochastic(torch.tensor([0]), p, None, torch.Generator().manual_seed(seed))
        assert (n, token) in {(1, 0), (1, 1), (1, 2), (0, 1)}


def test_seeded_sampling_is_reproducible(toy_target, toy_drafter):
    def run(seed):
        strategy = Speculative(CachedModel(toy_target), ModelDrafter(CachedModel(toy_drafter), VOCAB), gamma=3)
        return strategy.generate(PROMPT, DecodeConfig(max_new_tokens=30, processor=PROCESSORS["temperature"],
                                                      seed=seed)).token_ids
    assert run(5) == run(5)
    assert len({tuple(run(s)) for s in range(6)}) > 1
