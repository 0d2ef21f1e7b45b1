"""The GGUF's own Q4_K weights on torch's int4 kernel (models/formats/q4k.py): read exactly, applied to the right
layers."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from models.formats import q4k
from tests.helpers import q4k_weight, random_q4k, tiny_model, write_q4k_gguf


def test_groups_read_the_weights_gguf_dequantizes():
    raw = random_q4k(16, 512, seed=0)
    expected = dequantize(raw, GGMLQuantizationType.Q4_K).reshape(16, 512)
    np.testing.assert_allclose(q4k_weight(raw, 16, 512).numpy(), expected, rtol=1e-6, atol=1e-9)


def test_a_q4k_layer_multiplies_by_those_weights_and_each_row_alone_gives_the_same_bits():
    rows, cols = 64, 512
    raw = random_q4k(rows, cols, seed=1)
    layer = q4k.Q4KLinear(*q4k.groups(raw, rows, cols), bias=torch.randn(rows))
    x = torch.randn(6, cols)
    out = layer(x)
    assert out.dtype == torch.float32
    exact = x.to(torch.bfloat16).float() @ q4k_weight(raw, rows, cols).T + layer.bias
    assert (out - exact).abs().max() <= 1e-2 * exact.abs().max()
    assert all(torch.equal(layer(x[i:i + 1]), out[i:i + 1]) for i in range(len(x)))  # a verify rounds as a step


def test_apply_puts_the_files_weights_in_every_decoder_linear(tmp_path):
    model = tiny_model(hidden=256, intermediate=512, dtype=torch.float32)
    write_q4k_gguf(tmp_path / "m.gguf", model)
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.inference_mode():
        dense = model(ids).logits
        replaced = q4k.apply(model, tmp_path / "m.gguf")
        quantized = model(ids).logits
    assert len(replaced) == 2 * 7 and all(isinstance(model.get_submodule(n), q4k.Q4KLinear) for n in replaced)
    assert not isinstance(model.lm_head, q4k.Q4KLinear)  # only what the file holds in Q4_K
    assert (quantized - dense).abs().max() <= 2e-2 * dense.abs().max()
    assert torch.equal(quantized.argmax(-1), dense.argmax(-1))


def test_a_file_that_is_not_the_models_is_refused_by_name(tmp_path):
    model = tiny_model(hidden=256, intermediate=512, dtype=torch.float32)
    write_q4k_gguf(tmp_path / "m.gguf", model, corrupt="blk.1.ffn_up.weight")
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight .* model\.layers\.1\.mlp\.up_proj"):
        q4k.apply(model, tmp_path / "m.gguf")
    assert not any(isinstance(m, q4k.Q4KLinear) for m in model.modules())  # nothing half-replaced
