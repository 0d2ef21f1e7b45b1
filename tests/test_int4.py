"""models.formats.int4: groupwise 4-bit weights on torch's packed int4 CPU kernel."""

import pytest
import torch
from torch import nn

from models.formats.int4 import GROUP, Int4Linear, quantize, to_int4


def linear(in_features, out_features, bias=False, seed=0, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias).to(dtype)


def test_codes_scales_and_zeros_rebuild_each_weight_within_half_a_step():
    weight = linear(256, 32).weight.detach()
    codes, scale, zero = quantize(weight)
    assert codes.dtype == torch.int32 and int(codes.min()) >= 0 and int(codes.max()) <= 15
    step = scale.repeat_interleave(GROUP, dim=1)
    rebuilt = (codes - 8) * step + zero.repeat_interleave(GROUP, dim=1)
    assert ((rebuilt - weight.float()).abs() <= step / 2 + 1e-6).all()
    # each group's extremes land on codes 0 and 15
    groups = codes.reshape(32, 2, GROUP)
    assert (groups.amin(-1) == 0).all() and (groups.amax(-1) == 15).all()


def test_a_constant_group_has_no_zero_scale():
    flat = linear(128, 16)
    with torch.no_grad():
        flat.weight.fill_(0.5)
    codes, scale, zero = quantize(flat.weight.detach())
    assert (scale > 0).all()
    assert torch.equal(Int4Linear(flat).dequantized(), flat.weight.detach())


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 256), (5, 256), (2, 3, 256)])
def test_the_kernel_multiplies_by_the_quantized_weights(bias, shape):
    dense = linear(256, 48, bias=bias)
    int4 = Int4Linear(dense)
    codes, scale, zero = quantize(dense.weight.detach())
    expected_weight = ((codes - 8) * scale.repeat_interleave(GROUP, 1) + zero.repeat_interleave(GROUP, 1))
    assert torch.allclose(int4.dequantized().float(), expected_weight, atol=2e-2, rtol=1e-2)
    x = torch.randn(shape, dtype=torch.bfloat16)
    with torch.inference_mode():
        out = int4(x)
    reference = x.float() @ int4.dequantized().float().T + (dense.bias.float() if bias else 0)
    assert out.shape == (*shape[:-1], 48) and out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), reference, atol=0.05, rtol=0.02)
    error = (out.float() - (x.float() @ dense.weight.float().T + (dense.bias.float() if bias else 0))).norm()
    assert 0 < error / out.float().norm() < 0.2  # 4-bit rounding: close to the dense layer, not equal


@pytest.mark.parametrize("in_features, out_features", [(192, 32), (256, 24)])
def test_shapes_the_kernel_does_not_take_are_refused(in_features, out_features):
    with pytest.raises(ValueError, match="groups of 128 and output features by 16s"):
        Int4Linear(linear(in_features, out_features))


def test_only_bfloat16_on_the_cpu():
    with pytest.raises(ValueError, match="bfloat16"):
        Int4Linear(linear(256, 32, dtype=torch.float32))


def test_to_int4_replaces_the_layers_that_fit_and_names_the_rest():
    model = nn.Sequential(linear(256, 64), nn.ReLU(), nn.Sequential(linear(64, 32), linear(128, 24)))
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    assert to_int4(model) == ["2.0", "2.1"]
    assert [type(m).__name__ for m in (model[0], model[2][0], model[2][1])] == ["Int4Linear", "Linear", "Linear"]
    assert to_int4(model) == ["2.0", "2.1"]  # idempotent: an Int4Linear is not a Linear
    with torch.inference_mode():
        assert model[0](x).shape == (2, 64)
