"""models.formats.prepack: float32 linear layers with oneDNN-prepacked weights."""

import copy

import pytest
import torch
from torch import nn

from models.formats.prepack import PackedLinear, available, prepack, unpack
from sampling.autoregressive import Autoregressive
from sampling.base import DecodeConfig
from sampling.drafters.model import ModelDrafter
from sampling.speculative import Speculative
from tests.helpers import tiny_model
from utils.runner import CachedModel

pytestmark = pytest.mark.skipif(not available(), reason="this torch build has no oneDNN")


def test_packed_linear_computes_the_same_product_with_and_without_bias():
    torch.manual_seed(0)
    for bias in (False, True):
        dense = nn.Linear(48, 40, bias=bias)
        x = torch.randn(3, 5, 48)
        assert torch.allclose(PackedLinear(dense)(x), dense(x), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not available(torch.bfloat16), reason="oneDNN has no native bf16 kernels on this CPU"))])
def test_each_rows_result_is_the_same_bits_among_two_rows_or_more(dtype):
    # what lets a verify of k tokens round as k steps run as two rows do; a lone row may take another kernel path
    # (AVX-512 oneDNN does): models.invariance probes that per machine
    torch.manual_seed(0)
    dense = nn.Linear(256, 96, bias=False, dtype=dtype)
    packed = PackedLinear(dense)
    x = torch.randn(14, 256, dtype=dtype)
    full = packed(x)
    assert full.dtype == dtype
    torch.testing.assert_close(full, dense(x), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)
    for rows in (2, 5, 13):
        assert torch.equal(packed(x[:rows]), full[:rows])
    assert torch.equal(packed.unpacked().weight, dense.weight)


def test_a_packed_layer_copies_with_its_weights():
    torch.manual_seed(0)
    dense = nn.Linear(16, 8)
    packed = PackedLinear(dense)
    twin = copy.deepcopy(packed)
    assert torch.equal(twin.dense_weight(), dense.weight) and torch.equal(twin.bias, dense.bias)
    assert twin.bias is not packed.bias
    x = torch.randn(3, 16)
    assert torch.equal(twin(x), packed(x))
    model = nn.Sequential(copy.deepcopy(packed))
    assert type(unpack(model)[0]) is nn.Linear and torch.equal(model[0].weight, dense.weight)


def test_only_float32_cpu_weights_are_packed_and_bfloat16_where_onednn_has_native_bf16():
    with pytest.raises(ValueError, match="float32 on a CPU"):
        PackedLinear(nn.Linear(8, 8).to(torch.float16))
    bf16 = nn.Linear(8, 8).to(torch.bfloat16)
    if available(torch.bfloat16):
        assert torch.equal(PackedLinear(bf16).dense_weight(), bf16.weight)
    else:
        with pytest.raises(ValueError, match="float32 on a CPU"):
            PackedLinear(bf16)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(torch.float64))
    assert prepack(model) == 1
    assert type(model[0]) is PackedLinear and type(model[1]) is nn.Linear


def test_prepacked_model_gives_the_dense_logits():
    dense = tiny_model(seed=0, dtype=torch.float32)
    packed = copy.deepcopy(dense)
    assert prepack(packed) == 2 * 7 + 1  # per layer q, k, v, o, gate, up, down; and the head
    ids = torch.tensor([[5, 17, 42, 8, 5, 17, 42, 9]])
    with torch.inference_mode():
        assert torch.allclose(packed(ids).logits, dense(ids).logits, atol=1e-4)


def test_greedy_speculative_equals_greedy_autoregressive_on_a_prepacked_target():
    target = tiny_model(seed=0, dtype=torch.float32)
    prepack(target)
    drafter = tiny_model(seed=1, layers=1, hidden=16, dtype=torch.float32)
    config = DecodeConfig(max_new_tokens=40)
    prompt = [5, 17, 42, 8, 5, 17, 42, 9, 33, 5, 17]
    expected = Autoregressive(CachedModel(target)).generate(prompt, config).token_ids
    for alternatives in (0, 3):
        drafts = ModelDrafter(CachedModel(drafter), target.config.vocab_size, alternatives=alternatives,
                              max_tree=13)
        assert Speculative(CachedModel(target), drafts, gamma=6).generate(prompt, config).token_ids == expected
