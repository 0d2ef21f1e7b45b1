"""The KV-cache invariant: a CachedModel's cache holds exactly its `tokens`; rollback equals a fresh forward."""

import copy

import pytest
import torch

from sampling.base import DecodeConfig
from sampling.drafters.model import ModelDrafter
from sampling.speculative import Speculative
from utils.caching import CachedModel, common_prefix_length, crop

PROMPT = [3, 17, 42, 8, 8, 61]


def fresh_last_logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0, -1]


def test_crop_to_current_length_is_a_no_op(target_model):
    lm = CachedModel(target_model)
    with torch.inference_mode():
        lm.forward(PROMPT)
    keys_before = lm.cache.layers[0].keys.clone()
    crop(lm.cache, len(PROMPT))
    assert lm.cache.get_seq_length() == len(PROMPT)
    assert torch.equal(lm.cache.layers[0].keys, keys_before)
    with pytest.raises(ValueError):
        crop(lm.cache, len(PROMPT) + 1)


def test_after_crop_next_logits_equal_a_fresh_forward(target_model):
    lm = CachedModel(target_model)
    with torch.inference_mode():
        lm.forward(PROMPT + [5, 6, 7, 9])
        lm.crop(len(PROMPT))
        assert lm.cache.get_seq_length() == len(PROMPT) and lm.tokens == PROMPT
        rolled_back = lm.forward([11])[0]
    assert torch.allclose(rolled_back, fresh_last_logits(target_model, PROMPT + [11]), atol=1e-10)


def test_extend_feeds_only_unseen_tokens_and_reuses_the_common_prefix(target_model):
    lm = CachedModel(target_model)
    fed = []
    original = lm.forward
    lm.forward = lambda ids, keep=1, **kw: (fed.append(list(ids)), original(ids, keep, **kw))[1]
    with torch.inference_mode():
        lm.extend(PROMPT)
        logits = lm.extend(PROMPT + [1, 2])  # a new turn: only the two new tokens are fed
        assert fed == [PROMPT, [1, 2]]
        assert torch.allclose(logits[0], fresh_last_logits(target_model, PROMPT + [1, 2]), atol=1e-10)
        diverged = lm.extend(PROMPT[:3] + [9, 9])  # a different continuation: crop to the shared 3 tokens
        assert fed[-1] == [9, 9] and lm.tokens == PROMPT[:3] + [9, 9]
        assert torch.allclose(diverged[0], fresh_last_logits(target_model, PROMPT[:3] + [9, 9]), atol=1e-10)
        lm.extend(PROMPT[:3] + [9, 9])  # the same sequence again: its last token is re-fed for its logits
        assert fed[-1] == [9] and lm.cache.get_seq_length() == 5


def test_long_feeds_go_to_the_prefill_model_short_ones_to_the_model(target_model):
    prefill = copy.deepcopy(target_model)  # same architecture (one cache serves both), other weights
    with torch.no_grad():
        for weight in prefill.parameters():
            weight.mul_(1.1)
    calls = []
    for name, model in (("decode", target_model), ("prefill", prefill)):
        model.register_forward_hook(lambda module, args, kwargs, out, name=name: calls.append(
            (name, kwargs["input_ids"].shape[1])), with_kwargs=True)
    lm = CachedModel(target_model, prefill_model=prefill, prefill_from=4)
    try:
        with torch.inference_mode():
            first = lm.extend(PROMPT)  # 6 tokens: prefill
            lm.forward([1, 2, 3])  # 3: decode
            lm.forward([5, 6, 7, 9])  # 4: prefill again
        assert calls == [("prefill", 6), ("decode", 3), ("prefill", 4)]
        assert lm.tokens == PROMPT + [1, 2, 3, 5, 6, 7, 9] and lm.cache.get_seq_length() == 13
        assert torch.allclose(first[0], fresh_last_logits(prefill, PROMPT), atol=1e-10)
        assert not torch.allclose(first[0], fresh_last_logits(target_model, PROMPT), atol=1e-3)
    finally:
        target_model._forward_hooks.clear()


def test_extend_keep_returns_logits_for_the_last_positions(target_model):
    lm = CachedModel(target_model)
    with torch.inference_mode():
        logits = lm.extend(PROMPT, keep=3)
    assert logits.shape == (3, target_model.config.vocab_size)
    assert torch.allclose(logits[-1], fresh_last_logits(target_model, PROMPT), atol=1e-10)
    assert torch.allclose(logits[0], fresh_last_logits(target_model, PROMPT[:-2]), atol=1e-10)


def test_forward_interrupted_between_layers_resets_the_cache(target_model):
    """Ctrl-C after layer 0 stored the new keys but before layer 1 did must not leave a ragged cache."""
    lm = CachedModel(target_model)
    with torch.inference_mode():
        lm.forward(PROMPT)

    def interrupt(*_):
        raise KeyboardInterrupt

    hook = target_model.model.layers[1].register_forward_hook(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt), torch.inference_mode():
            lm.forward([10, 11])
    finally:
        hook.remove()
    assert lm.tokens == [] and lm.cache.get_seq_length() == 0
    with torch.inference_mode():
        assert torch.allclose(lm.extend(PROMPT)[0], fresh_last_logits(target_model, PROMPT), atol=1e-10)


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix_length([1, 2, 3], [1, 5, 3]) == 1
    assert common_prefix_length([], [1]) == 0


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_invariant_holds_after_every_round(target_model, small_drafter_model, gamma):
    """After each round the target cache holds every committed token but the last."""
    target = CachedModel(target_model)
    drafter = ModelDrafter(CachedModel(small_drafter_model), target.vocab_size)
    ids = list(PROMPT)
    for r in Speculative(target, drafter, gamma).stream(PROMPT, DecodeConfig(max_new_tokens=30)):
        ids += r.tokens
        assert target.tokens == ids[:-1]
        assert target.cache.get_seq_length() == len(ids) - 1
        assert drafter.lm.cache.get_seq_length() == len(drafter.lm.tokens)
