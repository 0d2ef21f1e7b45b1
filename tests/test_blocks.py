"""A model on the GGUF block kernels (models/formats/blocks.py): the file's tensors in place of the linears, and
greedy speculative output identical to autoregressive on them."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter

import kernels
from models import invariance
from models.formats import blocks
from models.formats.layers import linear_weight
from sampling.autoregressive import Autoregressive
from sampling.base import DecodeConfig
from sampling.drafters.model import ModelDrafter
from sampling.speculative import Speculative
from tests.helpers import tiny_model
from tests.test_kernels import random_blocks
from utils.caching import CachedModel

pytestmark = pytest.mark.skipif(kernels.unavailable() is not None, reason=f"kernels: {kernels.unavailable()}")
PROMPT = [5, 17, 42, 8, 5, 17, 42, 9, 33, 5, 17]
FORMATS = ("Q4_K", "Q6_K", "Q8_0", "Q5_0")


def gguf_tensors(model, seed: int = 0) -> dict[str, tuple[str, torch.Tensor]]:
    """Random blocks for every linear of a tiny Llama (its GGUF tensor names), the formats taken in turn."""
    names = {module: name for name, module in blocks.MODULES.items()}
    tensors = {}
    for index, layer in enumerate(model.model.layers):
        for position, (module, name) in enumerate(names.items()):
            linear = layer.get_submodule(module)
            kind = FORMATS[(index + position) % len(FORMATS)]
            raw = random_blocks(kind, linear.out_features, linear.in_features, seed=seed + 10 * index + position)
            tensors[f"blk.{index}.{name}.weight"] = kind, torch.from_numpy(raw)
    head = model.lm_head
    tensors["output.weight"] = "Q6_K", torch.from_numpy(random_blocks("Q6_K", head.out_features, head.in_features,
                                                                      seed=seed + 99))
    return tensors


def block_model(seed: int = 0):
    model = tiny_model(dtype=torch.float32, layers=2, hidden=256, seed=seed)
    for tensor_name, (kind, raw) in gguf_tensors(model, seed).items():
        name = blocks.module_name(tensor_name, tied=False)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, blocks.BlockLinear(raw, kind,
                model.get_submodule(name).in_features, None))
    return model


def test_a_block_linear_computes_its_dequantized_weights():
    raw = torch.from_numpy(random_blocks("Q4_K", 32, 512))
    layer = blocks.BlockLinear(raw, "Q4_K", 512, torch.randn(32))
    x = torch.randn(2, 3, 512)
    expected = torch.nn.functional.linear(x.double(), layer.dequantized().double(), layer.bias.double())
    got = layer(x)
    assert got.shape == (2, 3, 32) and got.dtype == torch.float32
    assert (got.double() - expected).abs().max() <= 3e-2 * expected.abs().max()
    with pytest.raises(ValueError, match="do not hold 256 weights"):
        blocks.BlockLinear(raw, "Q4_K", 256, None)
    with pytest.raises(ValueError, match="not Q4_1"):
        blocks.BlockLinear(raw, "Q4_1", 512, None)


def test_on_the_blocks_the_probe_finds_an_exact_path_and_speculative_output_equals_autoregressive():
    target = CachedModel(block_model())
    found = invariance.probe(target)
    assert found.exact, found.tried
    drafter = CachedModel(block_model(seed=5))  # another random model: most drafts rejected
    config = DecodeConfig(max_new_tokens=40)
    reference = Autoregressive(target).generate(PROMPT, config).token_ids
    for draft in (CachedModel(target.model), drafter):  # all accepted, mostly rejected
        result = Speculative(target, ModelDrafter(draft, target.vocab_size, alternatives=2, max_tree=6), 5).generate(
            PROMPT, config)
        assert result.token_ids == reference


def write_gguf(path, tensors) -> None:
    writer = GGUFWriter(str(path), arch="llama")
    for name, (kind, raw) in tensors.items():
        writer.add_tensor(name, raw.numpy(), raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_apply_puts_the_files_blocks_in_place_of_the_linears_and_refuses_another_models_file(tmp_path):
    model = tiny_model(dtype=torch.float32, layers=2, hidden=256)
    tensors = gguf_tensors(model)
    with torch.no_grad():  # the model holds the file's weights, as one converted from it does
        for tensor_name, (kind, raw) in tensors.items():
            layer = model.get_submodule(blocks.module_name(tensor_name, tied=False))
            layer.weight.copy_(blocks.BlockLinear(raw, kind, layer.in_features, None).dequantized())
    good, other = tmp_path / "model.gguf", tmp_path / "other.gguf"
    write_gguf(good, tensors)
    write_gguf(other, gguf_tensors(model, seed=50))
    assert blocks.block_linears(good) == len(tensors) == 2 * 7 + 1
    before = model.model.layers[0].self_attn.q_proj
    with pytest.raises(ValueError, match="does not hold the weights"):
        blocks.apply(model, other)
    assert model.model.layers[0].self_attn.q_proj is before  # refused: nothing changed
    expected = linear_weight(model.model.layers[1].mlp.down_proj)
    assert len(blocks.apply(model, good)) == len(tensors)
    down = model.model.layers[1].mlp.down_proj
    assert isinstance(down, blocks.BlockLinear) and isinstance(model.lm_head, blocks.BlockLinear)
    torch.testing.assert_close(down.dequantized(), expected, rtol=0, atol=0)


def test_gguf_names_map_to_the_models_linears():
    assert blocks.module_name("blk.3.ffn_up.weight", tied=False) == "model.layers.3.mlp.up_proj"
    assert blocks.module_name("blk.0.attn_v.weight", tied=False) == "model.layers.0.self_attn.v_proj"
    assert blocks.module_name("output.weight", tied=False) == "lm_head"
    assert blocks.module_name("token_embd.weight", tied=True) == "lm_head"
    assert blocks.module_name("token_embd.weight", tied=False) is None
    assert blocks.module_name("blk.0.attn_norm.weight", tied=False) is None
