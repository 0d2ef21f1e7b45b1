"""The GGUF's own Q4_K weights on torch's int4 kernel (utils/q4k.py): read exactly, applied to the right layers."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize

from tests.helpers import tiny_model
from utils import q4k


def random_q4k(rows: int, cols: int, seed: int) -> np.ndarray:
    """Q4_K bytes, (rows, cols / 256 * 144): random codes, 6-bit scales and mins, small fp16 block scales."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // q4k.BLOCK, q4k.BLOCK_BYTES), dtype=np.uint8)
    blocks[:, 0:2] = rng.uniform(1e-4, 1e-3, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    blocks[:, 2:4] = rng.uniform(1e-4, 1e-3, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def weight_of(raw: np.ndarray, rows: int, cols: int) -> torch.Tensor:
    codes, scale, low = q4k.groups(raw, rows, cols)
    return (codes.view(rows, -1, q4k.GROUP) * scale[..., None] - low[..., None]).view(rows, cols)


def test_groups_read_the_weights_gguf_dequantizes():
    raw = random_q4k(16, 512, seed=0)
    expected = dequantize(raw, GGMLQuantizationType.Q4_K).reshape(16, 512)
    np.testing.assert_allclose(weight_of(raw, 16, 512).numpy(), expected, rtol=1e-6, atol=1e-9)


def test_a_q4k_layer_multiplies_by_those_weights_and_each_row_alone_gives_the_same_bits():
    rows, cols = 64, 512
    raw = random_q4k(rows, cols, seed=1)
    layer = q4k.Q4KLinear(*q4k.groups(raw, rows, cols), bias=torch.randn(rows))
    x = torch.randn(6, cols)
    out = layer(x)
    assert out.dtype == torch.float32
    exact = x.to(torch.bfloat16).float() @ weight_of(raw, rows, cols).T + layer.bias
    assert (out - exact).abs().max() <= 1e-2 * exact.abs().max()
    assert all(torch.equal(layer(x[i:i + 1]), out[i:i + 1]) for i in range(len(x)))  # a verify rounds as a step


def write_gguf(path, model, corrupt: str | None = None) -> None:
    """Every decoder linear of `model` as random Q4_K in a GGUF file, the model's weights set to them; the tensor
    named `corrupt` gets other weights than the model's."""
    writer = GGUFWriter(str(path), arch="llama")
    names = {v: k for k, v in q4k._MODULES.items()}
    for index, layer in enumerate(model.model.layers):
        for position, (module_name, gguf_name) in enumerate(names.items()):
            linear = layer.get_submodule(module_name)
            rows, cols = linear.weight.shape
            raw = random_q4k(rows, cols, seed=10 * index + position)
            with torch.no_grad():
                linear.weight.copy_(weight_of(raw, rows, cols))
            name = f"blk.{index}.{gguf_name}.weight"
            writer.add_tensor(name, random_q4k(rows, cols, seed=99) if name == corrupt else raw,
                              raw_dtype=GGMLQuantizationType.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_apply_puts_the_files_weights_in_every_decoder_linear(tmp_path):
    model = tiny_model(hidden=256, intermediate=512, dtype=torch.float32)
    write_gguf(tmp_path / "m.gguf", model)
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
    write_gguf(tmp_path / "m.gguf", model, corrupt="blk.1.ffn_up.weight")
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight .* model\.layers\.1\.mlp\.up_proj"):
        q4k.apply(model, tmp_path / "m.gguf")
    assert not any(isinstance(m, q4k.Q4KLinear) for m in model.modules())  # nothing half-replaced
