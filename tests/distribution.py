"""Goodness-of-fit helpers for the losslessness tests (no scipy needed)."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from statistics import NormalDist

import torch

FALSE_ALARM = 1e-4  # probability that a correct sampler fails one chi-square test


def chi_square_critical(df: int, alpha: float = FALSE_ALARM) -> float:
    """Upper alpha quantile of chi-square(df), Wilson-Hilferty approximation (accurate to ~1% for df >= 3)."""
    z = NormalDist().inv_cdf(1 - alpha)
    c = 2 / (9 * df)
    return df * (1 - c + z * math.sqrt(c)) ** 3


def chi_square_test(samples: list[tuple], expected: dict[tuple, float],
                    min_expected: float = 5.0) -> tuple[float, float]:
    """(statistic, critical value) for samples against exact probabilities; bins expected below `min_expected`
    are pooled into one. The sampler is consistent with `expected` when statistic <= critical."""
    n = len(samples)
    observed = Counter(samples)
    assert set(observed) <= {k for k, p in expected.items() if p > 0}, "sampled an outcome of probability 0"
    stat, pooled_obs, pooled_exp, bins = 0.0, 0, 0.0, 0
    for outcome, p in expected.items():
        if n * p >= min_expected:
            stat += (observed[outcome] - n * p) ** 2 / (n * p)
            bins += 1
        else:
            pooled_obs += observed[outcome]
            pooled_exp += n * p
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        bins += 1
    return stat, chi_square_critical(max(bins - 1, 1))


@torch.inference_mode()
def exact_sequence_distribution(model, prompt: list[int], length: int, processor) -> dict[tuple, float]:
    """P(first `length` new tokens) under `processor`, by enumerating every sequence (tiny vocabularies only)."""
    vocab = model.config.vocab_size
    sequences = list(itertools.product(range(vocab), repeat=length))
    ids = torch.tensor([prompt + list(s) for s in sequences])
    logits = model(input_ids=ids).logits[:, len(prompt) - 1: len(prompt) - 1 + length]  # (S, length, V)
    probs = processor.probs(logits.double())
    chosen = probs.gather(-1, ids[:, len(prompt):, None]).squeeze(-1).prod(-1)
    return {s: float(p) for s, p in zip(sequences, chosen, strict=True)}
