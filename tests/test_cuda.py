"""The engine on a CUDA device (skipped where there is none): caches, sampling generators and verification live
on the device, and greedy speculative output still equals greedy autoregressive output."""

import pytest
import torch

from sampling.autoregressive import Autoregressive
from sampling.base import DecodeConfig
from sampling.registry import build_strategy
from sampling.settings import STRATEGIES
from tests.helpers import random_heads, tiny_model
from utils.logits_processor import TopKNucleusProcessor
from utils.runner import CachedModel

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
PROMPT = [5, 17, 42, 8, 5, 17, 42, 9, 33, 5, 17]


@pytest.fixture(scope="module")
def models():
    return tiny_model(dtype=torch.float32).cuda(), tiny_model(seed=1, layers=1, hidden=16, dtype=torch.float32).cuda()


@pytest.mark.parametrize("name", [s for s in STRATEGIES if s not in ("beam", "drafter")])
def test_greedy_strategies_equal_autoregressive_on_cuda(models, name):
    target, drafter = models
    config = DecodeConfig(max_new_tokens=40)
    expected = Autoregressive(CachedModel(target)).generate(PROMPT, config).token_ids
    strategy = build_strategy(name, CachedModel(target), CachedModel(drafter), heads=random_heads(target))
    assert strategy.generate(PROMPT, config).token_ids == expected


def test_seeded_sampling_on_cuda_is_reproducible(models):
    target, drafter = models
    config = DecodeConfig(max_new_tokens=30, processor=TopKNucleusProcessor(0.9, 20, 0.9), seed=3)

    def run():
        strategy = build_strategy("speculative", CachedModel(target), CachedModel(drafter))
        return strategy.generate(PROMPT, config).token_ids

    assert run() == run()
