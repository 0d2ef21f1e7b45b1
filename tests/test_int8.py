"""models.formats.int8: per-channel 8-bit weights on torch's int8 weight-only CPU kernel."""

import copy

import pytest
import torch
from torch import nn

from models.formats.int8 import Int8Linear, quantize, to_int8
from sampling.autoregressive import Autoregressive
from sampling.base import DecodeConfig
from sampling.drafters.model import ModelDrafter
from sampling.speculative import Speculative
from tests.helpers import tiny_model
from utils.runner import CachedModel


def test_codes_and_scales_rebuild_each_weight_within_half_a_step():
    torch.manual_seed(0)
    weight = torch.randn(24, 40)
    codes, scale = quantize(weight)
    assert codes.dtype == torch.int8 and int(codes.abs().max()) == 127
    assert ((codes.float() * scale[:, None] - weight).abs() <= scale[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_multiplies_by_its_dequantized_weights(dtype):
    torch.manual_seed(0)
    dense = nn.Linear(64, 48, bias=True)
    layer = Int8Linear(dense, dtype)
    x = torch.randn(2, 5, 64)
    expected = x @ layer.dequantized().T + dense.bias.detach()
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    assert torch.allclose(layer(x.to(dtype)).float(), expected, atol=tolerance)


def test_each_rows_result_is_the_same_bits_whatever_the_row_count():
    torch.manual_seed(0)
    layer = Int8Linear(nn.Linear(128, 64, bias=False), torch.bfloat16)
    x = torch.randn(14, 128, dtype=torch.bfloat16)
    full = layer(x)
    assert all(torch.equal(layer(x[:rows]), full[:rows]) for rows in (1, 2, 7, 13))


def test_greedy_speculative_equals_greedy_autoregressive_on_an_int8_target():
    target = tiny_model(seed=0, dtype=torch.float32)
    assert to_int8(target) == 2 * 7 + 1
    drafter = tiny_model(seed=1, layers=1, hidden=16, dtype=torch.float32)
    config = DecodeConfig(max_new_tokens=40)
    prompt = [5, 17, 42, 8, 5, 17, 42, 9, 33, 5, 17]
    expected = Autoregressive(CachedModel(target)).generate(prompt, config).token_ids
    drafts = ModelDrafter(CachedModel(drafter), target.config.vocab_size, alternatives=2, max_tree=9)
    assert Speculative(CachedModel(target), drafts, gamma=5).generate(prompt, config).token_ids == expected


def test_an_int8_model_stays_close_to_the_dense_one():
    dense = tiny_model(seed=0, dtype=torch.float32)
    int8 = copy.deepcopy(dense)
    to_int8(int8)
    ids = torch.tensor([[5, 17, 42, 8, 5, 17, 42, 9]])
    with torch.inference_mode():
        a, b = dense(ids).logits, int8(ids).logits
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.75
    assert not torch.equal(a, b)  # it is a different format, not a copy
