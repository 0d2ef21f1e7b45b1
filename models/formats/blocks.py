"""A model's weights exactly as its GGUF file holds them (Q4_K, Q6_K, Q5_0, Q8_0 blocks), on the project's kernels.

Every decoder linear and the output layer in the file's own format; the residual stream, norms and attention stay
float32. Each layer rounds its input to int8 per block inside the kernel (as llama.cpp's dot products do), and a row's
result has the same bits whatever the number of rows, so a verify computes what the one-token steps compute.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

import kernels
from models.formats.layers import linear_weight

MODULES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
           "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
           "ffn_down": "mlp.down_proj"}


class BlockLinear(nn.Module):
    """A linear layer holding one GGUF tensor's blocks, uint8 (out_features, bytes per row); float32 in the kernel,
    the output in the input's dtype."""

    blocks: Tensor  # buffer

    def __init__(self, blocks: Tensor, block_type: str, in_features: int, bias: Tensor | None):
        super().__init__()
        if block_type not in kernels.BLOCKS:
            raise ValueError(f"the kernels take {', '.join(kernels.BLOCKS)} blocks, not {block_type}")
        if (reason := kernels.unavailable()) is not None:  # loads the op's library where it can
            raise RuntimeError(f"the GGUF block kernels cannot run here: {reason}")
        self.block_type = block_type
        self.type_id, per_block, block_bytes = kernels.BLOCKS[block_type]
        self.out_features, self.in_features = blocks.shape[0], in_features
        if in_features % per_block or blocks.shape[1] != in_features // per_block * block_bytes:
            raise ValueError(f"{blocks.shape[1]} bytes of {block_type} per row do not hold {in_features} weights")
        self.register_buffer("blocks", blocks.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().contiguous(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features).float()
        out = torch.ops.specchat.gguf_mm(flat, self.blocks, self.type_id, self.out_features, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def dequantized(self) -> Tensor:
        """The weights the kernel multiplies by, (out, in) float32."""
        from gguf import GGMLQuantizationType, quants

        values = quants.dequantize(self.blocks.numpy(), GGMLQuantizationType[self.block_type])
        return torch.from_numpy(np.ascontiguousarray(values)).reshape(self.out_features, self.in_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.block_type}, "
                f"bias={self.bias is not None}")


def module_name(tensor_name: str, tied: bool) -> str | None:
    """The model's module a GGUF weight belongs to ("blk.3.ffn_up.weight" -> "model.layers.3.mlp.up_proj"), or None
    for a tensor that is no linear (norms, biases, the embedding unless it is the tied output layer)."""
    if tensor_name == "output.weight" or (tied and tensor_name == "token_embd.weight"):
        return "lm_head"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", tensor_name)
    if not match or match[2] not in MODULES:
        return None
    return f"model.layers.{match[1]}.{MODULES[match[2]]}"


def _tied(reader) -> bool:
    """Whether the file's output layer is its embedding (no output.weight of its own)."""
    return not any(tensor.name == "output.weight" for tensor in reader.tensors)


def block_linears(gguf_file: str | Path) -> int:
    """How many of the file's linears the kernels take (the header only: the weights are not read)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_file))
    tied = _tied(reader)
    return sum(module_name(t.name, tied) is not None and t.tensor_type.name in kernels.BLOCKS for t in reader.tensors)


def apply(model: nn.Module, gguf_file: str | Path) -> list[str]:
    """Replace, in place, each linear of a Qwen2/Llama-layout model that the GGUF stores in blocks the kernels take
    by a `BlockLinear` of the file's bytes; the names replaced. The first layer's weights are checked against the
    model's (the file must be the one it was loaded from); a refused file changes nothing."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_file))
    tied = _tied(reader)
    layers = {}
    for tensor in reader.tensors:
        name = module_name(tensor.name, tied)
        if name is None or tensor.tensor_type.name not in kernels.BLOCKS:
            continue
        layer = model.get_submodule(name)
        cols, rows = (int(n) for n in tensor.shape)
        blocks = torch.from_numpy(np.array(tensor.data, dtype=np.uint8).reshape(rows, -1))
        new = BlockLinear(blocks, tensor.tensor_type.name, cols, getattr(layer, "bias", None))
        expected = linear_weight(layer).float()
        if expected.shape != (rows, cols) or (name.startswith("model.layers.0.") and not torch.allclose(
                new.dequantized(), expected, rtol=1 / 128, atol=1e-6)):
            raise ValueError(f"{tensor.name} in {gguf_file} does not hold the weights of the model's {name}")
        layers[name] = new
    for name, new in layers.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    return list(layers)
