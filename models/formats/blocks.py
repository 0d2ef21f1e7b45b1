"""A model's weights exactly as its GGUF file holds them (Q4_K, Q6_K, Q5_0, Q8_0 blocks), on the project's kernels.

Every decoder linear, the output layer and the input embedding in the file's own format (a lookup dequantizes only the
rows of its ids); the residual stream, norms and attention stay float32. Each linear rounds its input to int8 per
block inside the kernel (as llama.cpp's dot products do), and a row's result has the same bits whatever the number of
rows, so a verify computes what the one-token steps compute.
"""

from __future__ import annotations

import re
from itertools import accumulate
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

import kernels
from models.formats.layers import linear_weight
from models.gguf import TensorInfo, tensor_infos

MODULES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
           "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
           "ffn_down": "mlp.down_proj"}


class BlockLinear(nn.Module):
    """A linear layer holding one GGUF tensor's blocks, uint8 (out_features, bytes per row), as the kernels in use
    read them (`kernels.pack`: the same values); float32 in the kernel, the output in the input's dtype."""

    blocks: Tensor  # buffer

    def __init__(self, blocks: Tensor, block_type: str, in_features: int, bias: Tensor | None,
                 packed: int | None = None):
        """`blocks` as the file holds them, or already packed with type id `packed` (`kernels.pack`)."""
        super().__init__()
        self.block_type = block_type
        self.out_features, self.in_features = blocks.shape[0], in_features
        packed_blocks, self.type_id = _packed(blocks, block_type, in_features, packed)
        self.register_buffer("blocks", packed_blocks)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().contiguous(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features).float()
        out = torch.ops.specchat.gguf_mm(flat, self.blocks, self.type_id, self.out_features, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def dequantized(self) -> Tensor:
        """The weights the kernel multiplies by, (out, in) float32."""
        from gguf import GGMLQuantizationType, quants

        values = quants.dequantize(kernels.unpack(self.blocks, self.type_id).numpy(),
                                   GGMLQuantizationType[self.block_type])
        return torch.from_numpy(np.ascontiguousarray(values)).reshape(self.out_features, self.in_features)

    def weight_rows(self, ids: Tensor) -> Tensor:
        """Rows `ids` of the weights, (*ids.shape, in) float32, without dequantizing the others."""
        return torch.ops.specchat.gguf_rows(self.blocks, ids, self.type_id, self.in_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.block_type}, "
                f"bias={self.bias is not None}")


# Linears of a decoder layer that read the same input, in the order the layer calls them (Qwen2's and Llama's).
SIBLINGS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))


class _Siblings:
    """The blocks of linears that read the same input, one after the other in one buffer (each linear's `blocks` a
    view of its rows), and the outputs of the last call over all of them that the later ones have not taken yet."""

    def __init__(self, layers: list[BlockLinear]):
        self.blocks = torch.cat([layer.blocks for layer in layers])
        self.type_id = layers[0].type_id
        biases = [layer.bias.detach() for layer in layers if layer.bias is not None]  # all or none (`_kind`)
        self.bias = torch.cat(biases) if biases else None
        ends = list(accumulate(layer.out_features for layer in layers))
        self.bounds = list(zip([0, *ends[:-1]], ends, strict=True))  # each linear's rows
        self.input: Tensor | None = None
        self.outputs: dict[int, Tensor] = {}


class SiblingLinear(BlockLinear):
    """A `BlockLinear` whose layer calls it and its siblings on one input (attention's q, k and v; the MLP's gate and
    up). The first sibling's call computes every sibling's output in one kernel call over their joined blocks: the
    input rounded once and the threads started once, a fixed cost a small linear's weights do not cover. A later
    sibling handed that very input tensor takes its columns of the result; any other input, or a result gone (taken,
    or reset by a compiled graph's run on another thread, as the chat's background compile runs), it computes itself.
    Each output column's sums depend on its weights and the row alone, so every output has the bits of separate
    calls."""

    def __init__(self, layer: BlockLinear, group: _Siblings, index: int):
        start, end = group.bounds[index]
        super().__init__(group.blocks[start:end], layer.block_type, layer.in_features,
                         None if group.bias is None else group.bias[start:end], layer.type_id)
        self.group, self.index = group, index

    def forward(self, x: Tensor) -> Tensor:
        group = self.group
        if self.index == 0:
            out = torch.ops.specchat.gguf_mm(x.reshape(-1, self.in_features).float(), group.blocks, group.type_id,
                                             group.blocks.shape[0], group.bias)
            group.input = x
            group.outputs = {i: out[:, start:end] for i, (start, end) in enumerate(group.bounds) if i}
            mine = out[:, : self.out_features]
        elif group.input is x and (taken := group.outputs.pop(self.index, None)) is not None:
            mine = taken  # one read of the dict: a graph compiled on another thread may reset it between two
            if not group.outputs:
                group.input = None  # nothing held past the layer
        else:
            return super().forward(x)
        return mine.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def join_siblings(model: nn.Module) -> int:
    """Replace, in place, the `BlockLinear`s of each decoder layer that read the same input (`SIBLINGS`) by
    `SiblingLinear`s over one buffer of their blocks (one layer's weights copied at a time); how many groups were
    joined. Where they differ (a Q4_K_M file's Q6_K v_proj), the first's run of its own kind joins (`_kind`)."""
    joined = 0
    for name, layer in list(model.named_modules()):
        if not re.search(r"(^|\.)layers\.\d+$", name):
            continue
        for names in SIBLINGS:
            run: list[BlockLinear] = []
            for child in names:
                module = getattr(layer, child.split(".")[0], None)
                module = getattr(module, child.split(".")[1], None)
                if type(module) is not BlockLinear or (run and _kind(module) != _kind(run[0])):
                    break
                run.append(module)
            if len(run) > 1:
                group = _Siblings(run)
                for index, (member, child) in enumerate(zip(run, names[: len(run)], strict=True)):
                    _swap(layer, child, SiblingLinear(member, group, index))
                joined += 1
    return joined


def _kind(layer: BlockLinear) -> tuple[int, int, bool]:
    """What linears must share to run as one call: their blocks' type, their inputs, having a bias."""
    return layer.type_id, layer.in_features, layer.bias is not None


class BlockEmbedding(nn.Module):
    """An input embedding holding one GGUF tensor's blocks, uint8 (num_embeddings, bytes per row): a lookup
    dequantizes the rows of the ids asked to float32 (as the format defines them); no float table is held."""

    blocks: Tensor  # buffer

    def __init__(self, blocks: Tensor, block_type: str, embedding_dim: int, packed: int | None = None):
        """`blocks` as the file holds them, or already packed with type id `packed` (`kernels.pack`)."""
        super().__init__()
        self.block_type = block_type
        self.num_embeddings, self.embedding_dim = blocks.shape[0], embedding_dim
        packed_blocks, self.type_id = _packed(blocks, block_type, embedding_dim, packed)
        self.register_buffer("blocks", packed_blocks)

    def forward(self, input_ids: Tensor) -> Tensor:
        """(*ids.shape, embedding_dim) float32."""
        return torch.ops.specchat.gguf_rows(self.blocks, input_ids, self.type_id, self.embedding_dim)

    @property
    def weight(self) -> Tensor:
        """The table's shape and dtype without its values, as a meta tensor (for code that reads the width). The values
        exist only as blocks: look rows up by calling the module; reading values from this raises."""
        return torch.empty(self.num_embeddings, self.embedding_dim, device="meta")

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.block_type}"


def _packed(blocks: Tensor, block_type: str, width: int, packed: int | None) -> tuple[Tensor, int]:
    """Rows of `width` values in `block_type` as the kernels read them, and their type id; refused where the kernels
    cannot run or the bytes do not hold the rows."""
    if block_type not in kernels.BLOCKS:
        raise ValueError(f"the kernels take {', '.join(kernels.BLOCKS)} blocks, not {block_type}")
    if (reason := kernels.unavailable()) is not None:  # loads the op's library where it can
        raise RuntimeError(f"the GGUF block kernels cannot run here: {reason}")
    per_block, block_bytes = kernels.PACKED[packed] if packed in kernels.PACKED else kernels.BLOCKS[block_type][1:]
    if blocks.dim() != 2 or width % per_block or blocks.shape[1] != width // per_block * block_bytes:
        raise ValueError(f"{blocks.shape[-1]} bytes of {block_type} per row do not hold {width} weights")
    if packed is not None:
        return blocks.contiguous(), packed
    return kernels.pack(blocks.contiguous(), block_type)


def module_name(tensor_name: str, tied: bool) -> str | None:
    """The model's module a GGUF weight belongs to ("blk.3.ffn_up.weight" -> "model.layers.3.mlp.up_proj"), or None
    for a tensor that is no linear (norms, biases, the embedding unless it is the tied output layer)."""
    if tensor_name == "output.weight" or (tied and tensor_name == "token_embd.weight"):
        return "lm_head"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", tensor_name)
    if not match or match[2] not in MODULES:
        return None
    return f"model.layers.{match[1]}.{MODULES[match[2]]}"


def _tied(tensors: list[TensorInfo]) -> bool:
    """Whether the file's output layer is its embedding (no output.weight of its own)."""
    return not any(tensor.name == "output.weight" for tensor in tensors)


def block_linears(gguf_file: str | Path) -> int:
    """How many of the file's linears the kernels take (the header only: the weights are not read)."""
    tensors = tensor_infos(gguf_file)
    tied = _tied(tensors)
    return sum(module_name(t.name, tied) is not None and t.type_name in kernels.BLOCKS for t in tensors)


def apply(model: PreTrainedModel, gguf_file: str | Path) -> list[str]:
    """Replace, in place, each linear of a Qwen2/Llama-layout model that the GGUF stores in blocks the kernels take by
    a `BlockLinear` of the file's bytes, and its input embedding by a `BlockEmbedding` where the file's token_embd is
    in such blocks; the names replaced. Every shape, the first layer's weights and rows of the embedding are checked
    against the model's first (the file must be the one it was loaded from); a refused file changes nothing. Then the
    layers are read from the file and swapped one at a time: the model's other dense weights are never read."""
    tensors = tensor_infos(gguf_file)
    tied = _tied(tensors)
    embedding = model.get_input_embeddings()
    embedding_name = next(name for name, module in model.named_modules() if module is embedding)
    plan: list[tuple[str, TensorInfo]] = []  # (module name, GGUF tensor), the embedding's name for token_embd
    for tensor in tensors:
        if tensor.type_name not in kernels.BLOCKS:
            continue
        names = [module_name(tensor.name, tied), embedding_name if tensor.name == "token_embd.weight" else None]
        plan += [(name, tensor) for name in names if name is not None]
    with open(gguf_file, "rb") as file:
        read: dict[str, tuple[Tensor, int]] = {}  # the new modules' buffers: a tied token_embd is read once

        def blocks_of(tensor: TensorInfo) -> tuple[Tensor, int]:
            if tensor.name not in read:
                read[tensor.name] = kernels.pack(_read_blocks(file, tensor), tensor.type_name)
            return read[tensor.name]

        checked = {}
        for name, tensor in plan:
            layer = model.get_submodule(name)
            if not _fits(layer, tensor):
                raise ValueError(f"{tensor.name} in {gguf_file} does not hold the weights of the model's {name}")
            if name.startswith("model.layers.0.") or name == embedding_name:
                checked[name] = _block_module(layer, blocks_of(tensor), tensor)
                if not _same_values(layer, checked[name]):
                    raise ValueError(f"{tensor.name} in {gguf_file} does not hold the weights of the model's {name}")
        for name, tensor in plan:
            new = checked.get(name)
            if new is None:
                new = _block_module(model.get_submodule(name), blocks_of(tensor), tensor)
            _swap(model, name, new)
    return [name for name, _ in plan]


def quantize_dense(model: nn.Module, block_type: str = "Q8_0") -> list[str]:
    """Replace, in place, each linear whose inputs are whole blocks of 32 by a `BlockLinear` of its weights quantized
    to Q8_0 (`kernels.quantize`: as ggml's reference quantizer makes them), and the input embedding by a
    `BlockEmbedding`; a tied output layer shares the embedding's blocks. One layer at a time: the dense weights of
    each go once it is replaced. The names replaced."""
    embedding = model.get_input_embeddings() if isinstance(model, PreTrainedModel) else None
    made: dict[int, tuple[Tensor, int]] = {}  # each weight tensor's packed blocks (by data pointer): tied layers once
    replaced = []
    for name, layer in list(model.named_modules()):
        is_embedding = layer is embedding and isinstance(layer, nn.Embedding)
        if not (is_embedding or isinstance(layer, nn.Linear)):
            continue
        weight = layer.weight if is_embedding else linear_weight(layer)
        if weight.dim() != 2 or weight.shape[1] % 32:
            continue
        key = weight.data_ptr()
        if key not in made:
            made[key] = kernels.pack(kernels.quantize(weight, block_type), block_type)
        packed, type_id = made[key]
        _swap(model, name, BlockEmbedding(packed, block_type, weight.shape[1], type_id) if is_embedding else
              BlockLinear(packed, block_type, weight.shape[1], getattr(layer, "bias", None), type_id))
        replaced.append(name)
    return replaced


def requantize(model: nn.Module, block_type: str = "Q4_0", rows_at_once: int = 8192) -> list[str]:
    """Replace, in place, each `BlockLinear` in a type of more bits a weight whose inputs are whole blocks of 32 by one
    of its weights (as its blocks decode them) quantized again to `block_type`: fewer bytes a step for a model whose
    weights never change the output (a drafter). An embedding keeps its blocks (a lookup reads few rows). One layer at
    a time, `rows_at_once` rows of it in float32 at a time (an output layer's whole table would be half a gigabyte).
    The names replaced."""
    replaced = []
    for name, layer in list(model.named_modules()):
        if (not isinstance(layer, BlockLinear) or _bits(layer.block_type) <= _bits(block_type)
                or layer.in_features % 32):
            continue
        file_blocks = kernels.unpack(layer.blocks, layer.type_id)  # tiles unpacked once, not once a row
        chunks = []
        for start in range(0, layer.out_features, rows_at_once):
            rows = file_blocks[start:start + rows_at_once]
            weights = kernels.rows(rows, torch.arange(len(rows)), layer.block_type, layer.in_features)
            chunks.append(kernels.quantize(weights, block_type))
        packed, type_id = kernels.pack(torch.cat(chunks), block_type)
        _swap(model, name, BlockLinear(packed, block_type, layer.in_features, layer.bias, type_id))
        replaced.append(name)
    return replaced


def _bits(block_type: str) -> float:
    """Bits a weight of `block_type` takes."""
    _, weights, size = kernels.BLOCKS[block_type]
    return 8 * size / weights


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put `new` in place of the model's module `name`."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _read_blocks(file, tensor: TensorInfo) -> Tensor:
    """A GGUF tensor's bytes, uint8 (rows, bytes per row), read from the file (no mapping of it stays resident)."""
    rows = int(tensor.shape[-1]) if len(tensor.shape) > 1 else 1
    blocks = torch.empty(rows, tensor.n_bytes // rows, dtype=torch.uint8)
    file.seek(tensor.data_offset)
    if file.readinto(blocks.numpy()) != tensor.n_bytes:
        raise ValueError(f"{tensor.name} ends past the end of {file.name}")
    return blocks


def _fits(layer: nn.Module, tensor: TensorInfo) -> bool:
    """Whether a GGUF tensor has the shape of the model's layer (its weights are not read)."""
    cols, rows = (int(n) for n in tensor.shape) if len(tensor.shape) == 2 else (0, 0)
    if isinstance(layer, nn.Embedding):
        return (layer.num_embeddings, layer.embedding_dim) == (rows, cols)
    return (getattr(layer, "out_features", None), getattr(layer, "in_features", None)) == (rows, cols)


def _block_module(layer: nn.Module, packed: tuple[Tensor, int], tensor: TensorInfo) -> BlockLinear | BlockEmbedding:
    """The block layer of a GGUF tensor (its bytes read and packed: `packed`) in place of the model's `layer`, which
    it fits."""
    cols, kind = int(tensor.shape[0]), tensor.type_name
    blocks, type_id = packed
    if isinstance(layer, nn.Embedding):
        return BlockEmbedding(blocks, kind, cols, type_id)
    return BlockLinear(blocks, kind, cols, getattr(layer, "bias", None), type_id)


SAMPLED_ROWS = 1024  # of an embedding, compared with the model's: all of them would widen the whole table once


def _same_values(layer: nn.Module, new: BlockLinear | BlockEmbedding) -> bool:
    """Whether a block layer holds the dense layer's weights (an embedding: rows spread over the vocabulary)."""
    if isinstance(new, BlockEmbedding):
        ids = torch.linspace(0, new.num_embeddings - 1, min(SAMPLED_ROWS, new.num_embeddings)).long()
        got, expected = new(ids), layer(ids).float()
    else:
        got, expected = new.dequantized(), linear_weight(layer).float()
    return torch.allclose(got, expected, rtol=1 / 128, atol=1e-6)
