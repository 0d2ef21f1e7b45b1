"""The KV-cache invariant: a CachedModel's cache holds exactly its `tokens`; rollback equals a fresh forward."""

import contextlib
import copy

import pytest
import torch

from sampling.base import DecodeConfig
from sampling.drafters.model import ModelDrafter
from sampling.speculative import Speculative
from utils.caching import CachedTokens, common_prefix_length, crop
from utils.runner import CachedModel

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
    lm.forward = lambda ids, logits_rows=1, **kw: (fed.append(list(ids)), original(ids, logits_rows, **kw))[1]
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
        logits = lm.extend(PROMPT, logits_rows=3)
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


@pytest.fixture(scope="module")
def compiled_drafter():
    """A float32 tiny drafter whose short forwards are compiled (tens of seconds on two cores: built once)."""
    from tests.helpers import tiny_model

    model = tiny_model(seed=1, layers=1, hidden=16, dtype=torch.float32)
    lm = CachedModel(model)
    lm.compile_step()
    return lm


@contextlib.contextmanager
def counting_steps(lm: CachedModel):
    """Record the tokens fed to each call of `lm`'s compiled step."""
    compiled, fed = lm.step_model, []

    def counting(**kwargs):
        fed.append(kwargs["input_ids"].shape[1])
        return compiled(**kwargs)

    lm.step_model = counting
    try:
        yield fed
    finally:
        lm.step_model = compiled


@pytest.mark.slow
def test_compiled_step_takes_short_forwards_once_the_cache_holds_two(compiled_drafter):
    lm, eager = compiled_drafter, CachedModel(compiled_drafter.model)
    long = list(range(3, 3 + lm.prefill_from))
    with counting_steps(lm) as fed:
        lm.reset()
        with torch.inference_mode():
            # a cache of 0 and 1 tokens: eager; then one and two tokens compiled, prefill_from tokens eager
            for ids in ([3], [17], [5], [6, 7], long, [8]):
                assert torch.allclose(lm.forward(ids), eager.forward(ids), atol=1e-5)
            lm.crop(4)
            eager.crop(4)
            for ids in ([9], [10, 11]):  # a cropped cache: compiled too
                assert torch.allclose(lm.forward(ids, len(ids)), eager.forward(ids, len(ids)), atol=1e-5)
    assert fed == [1, 2, 1, 1, 2]
    assert lm.tokens == eager.tokens == [3, 17, 5, 6, 9, 10, 11] and lm.cache.get_seq_length() == 7


@pytest.mark.slow
def test_speculative_with_a_compiled_drafter_equals_autoregressive(target_model, compiled_drafter):
    from sampling.autoregressive import Autoregressive

    config = DecodeConfig(max_new_tokens=24)
    compiled_drafter.reset()
    expected = [t for r in Autoregressive(CachedModel(target_model)).stream(PROMPT, config) for t in r.tokens]
    strategy = Speculative(CachedModel(target_model), ModelDrafter(compiled_drafter, target_model.config.vocab_size),
                           gamma=4)
    with counting_steps(compiled_drafter) as fed:
        rounds = list(strategy.stream(PROMPT, config))
    assert [t for r in rounds for t in r.tokens] == expected
    assert len(fed) >= len(rounds)  # the drafter's short forwards ran compiled


@pytest.mark.slow
def test_compiled_steps_write_the_cache_in_place_through_crops_and_growth_without_a_new_graph(compiled_drafter):
    lm, eager = compiled_drafter, CachedModel(compiled_drafter.model)
    lm.reset()
    buffers = set()
    with torch.inference_mode(), torch._dynamo.config.patch(error_on_recompile=True), counting_steps(lm) as fed:
        for ids in ([3, 4, 5], *([t % 90 + 1] if t % 5 else [t % 90 + 1, 7] for t in range(260))):
            if len(lm.tokens) % 50 == 3:  # a rejected draft: the next step overwrites its rows
                lm.crop(len(lm.tokens) - 1)
                eager.crop(len(eager.tokens) - 1)
            assert torch.allclose(lm.forward(ids), eager.forward(ids), atol=1e-5)
            buffers.add(lm.cache.layers[0].keys.data_ptr())
    assert len(fed) == 260 and len(lm.tokens) > 259  # every step compiled, the first buffer's room (259 rows) outgrown
    assert len(buffers) == 2  # written in place, moved once when it grew


def test_a_failed_compile_leaves_the_model_eager(target_model, monkeypatch):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch, "compile", no_compiler)
    lm = CachedModel(target_model)
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        lm.compile_step()
    assert lm.step_model is None and lm.tokens == []


def test_a_prefill_model_of_another_dtype_shares_the_cache_cast_to_each_models_dtype(target_model):
    """A CPU without native bf16: int4 steps compute in bfloat16, prompts prefill faster in float32."""
    decode = copy.deepcopy(target_model).to(torch.bfloat16)
    prefill = copy.deepcopy(target_model).to(torch.float32)
    lm = CachedModel(decode, prefill_model=prefill, prefill_from=4)
    reference = CachedModel(copy.deepcopy(target_model).to(torch.float32))
    ids = [5, 17, 42, 8, 5, 17, 42, 9]
    lm.forward(ids)
    assert {layer.keys.dtype for layer in lm.cache.layers} == {torch.float32}
    step = lm.forward([33])  # a bfloat16 step on the float32 prefill's cache
    assert {layer.keys.dtype for layer in lm.cache.layers} == {torch.bfloat16}
    lm.forward([5, 17, 42, 8])  # and a prefill again after bfloat16 steps
    assert {layer.keys.dtype for layer in lm.cache.layers} == {torch.float32}
    expected = reference.forward(ids + [33])
    assert step.argmax(-1) == expected.argmax(-1) and torch.allclose(step, expected, atol=0.5)


def test_a_growing_layer_writes_each_forward_in_place_and_holds_what_concatenation_holds():
    from transformers.cache_utils import DynamicLayer

    from utils.caching import GrowingLayer

    generator = torch.Generator().manual_seed(3)
    growing, plain = GrowingLayer(), DynamicLayer()
    buffers = []
    for rows in (5, 1, 1, 3, 300, 1):  # the fifth outgrows the first buffer
        k, v = (torch.randn(1, 2, rows, 8, generator=generator) for _ in range(2))
        got, want = growing.update(k, v), plain.update(k, v)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        buffers.append(growing.keys.data_ptr())
    assert len(set(buffers[:4])) == 1 and buffers[4] == buffers[5] != buffers[0]
    growing.crop(-4)
    plain.crop(-4)
    k, v = (torch.randn(1, 2, 2, 8, generator=generator) for _ in range(2))
    got, want = growing.update(k, v), plain.update(k, v)  # overwrites the cropped rows
    assert growing.keys.data_ptr() == buffers[-1] and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    growing.keys, growing.values = growing.keys.double(), growing.values.double()  # set from outside: copied over
    plain.keys, plain.values = plain.keys.double(), plain.values.double()
    k, v = (torch.randn(1, 2, 1, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    got, want = growing.update(k, v), plain.update(k, v)
    assert got[0].dtype == torch.float64 and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_room_made_for_a_compiled_forward_is_never_exactly_full():
    """A compiled step is traced with rows to spare in its buffers and guards on that: one filling them exactly would
    be compiled again, in the middle of a turn."""
    from utils.caching import GrowingLayer

    layer = GrowingLayer()
    k = torch.randn(1, 2, 5, 8)
    layer.update(k, k)
    capacity = layer._buffers[0].shape[-2]
    layer.reserve(capacity - 1, k)
    assert layer._buffers[0].shape[-2] == capacity  # room to spare: kept
    layer.reserve(capacity, k)
    assert layer._buffers[0].shape[-2] > capacity and torch.equal(layer.keys, k)


def test_a_cached_model_grows_its_cache_in_place_until_it_takes_compiled_steps(target_model):
    from utils.caching import GrowingLayer

    lm = CachedModel(target_model)
    with torch.inference_mode():
        lm.forward(PROMPT)
        at = lm.cache.layers[0].keys.data_ptr()
        lm.forward([5])
    assert isinstance(lm.cache.layers[0], GrowingLayer) and lm.cache.layers[0].keys.data_ptr() == at
    assert torch.allclose(lm.forward([7])[0], fresh_last_logits(target_model, PROMPT + [5, 7]), atol=1e-10)


def test_grouped_attention_shares_the_key_heads_under_a_mask_and_computes_what_sdpa_does(monkeypatch):
    from models import grouped_attention
    from tests.helpers import tiny_model

    sdpa = tiny_model(seed=2, dtype=torch.float32)
    grouped = copy.deepcopy(sdpa)
    assert sdpa.config._attn_implementation == "sdpa" and grouped_attention.use(grouped)
    calls = []
    attention = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, **kwargs):
        calls.append((key.shape[1], kwargs.get("attn_mask") is not None, kwargs.get("enable_gqa", False)))
        return attention(query, key, value, **kwargs)

    a, b = CachedModel(sdpa), CachedModel(grouped)
    with torch.inference_mode():
        for ids in (PROMPT, [5, 6, 7], [8], [9, 10]):  # rows after a cache come with a mask
            expected = a.forward(ids, logits_rows=len(ids))
            monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
            got = b.forward(ids, logits_rows=len(ids))
            monkeypatch.undo()
            assert torch.allclose(got, expected, atol=1e-5)
    assert (2, True, True) in calls  # two key heads for four query heads, masked: not repeated
    assert all(heads == 2 for heads, _, _ in calls)


def test_cached_tokens_keep_the_invariant_by_themselves_through_appends_crops_and_moved_rows(target_model):
    """The cache and its tokens (`utils.caching.CachedTokens`) without a model runner: rows written straight in."""
    config = copy.deepcopy(target_model.config)
    config.num_hidden_layers = 1  # one layer, written below
    held = CachedTokens(config, with_hidden=True)
    layer = held.cache.layers[0]
    keys = torch.arange(8, dtype=torch.float64).view(1, 1, 8, 1).expand(1, 2, 8, 4).contiguous()  # row i holds i
    layer.update(keys, keys.clone())
    held.append([10, 11, 12, 13, 14, 15, 16, 17], torch.arange(8, dtype=torch.float64)[:, None].expand(8, 3))
    held.crop_to_path(3, [5, 7])  # rows 5 and 7 move up behind the first 3
    assert held.tokens == [10, 11, 12, 15, 17] and layer.keys.shape[-2] == 5
    assert layer.keys[0, 0, :, 0].tolist() == [0, 1, 2, 5, 7] and held.hidden()[:, 0].tolist() == [0, 1, 2, 5, 7]
    held.crop(2)
    assert held.tokens == [10, 11] and layer.keys.shape[-2] == 2 and len(held.hidden()) == 2
