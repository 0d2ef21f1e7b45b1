"""Linear layers with their weights prepacked by oneDNN, one small module per layer: float32 on any CPU, bfloat16
where oneDNN has native bf16 kernels (AVX512-BF16, AMX, AVX-NE-CONVERT).

Through `F.linear` (plain layout), a float32 matmul of a few rows costs about as many one-row matmuls on a CPU
without native bf16, so a verify of 8 tokens costs several decode steps. Reordered once into oneDNN's blocked layout
(what inductor's freezing emits for CPU linears), the same weights serve 1-14 rows for little more than one, and a
row's result is the same bits among 2..14 rows (where a lone row is computed otherwise, `models.invariance` has the
steps run as two rows). torch's mkldnn ops are called directly: no maintained library packs weights for CPU GEMMs.
Measured costs: docs/formats.md.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from models.formats.layers import replace_layers

PACK_ROWS = 14  # the row count oneDNN tunes the packed layout for: a verify's size


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether weights of `dtype` can be prepacked here."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """`linear` with its float32 or bfloat16 weight in oneDNN's blocked layout; inputs and output keep that dtype."""

    packed: Tensor  # a buffer (register_buffer)
    compile_blocker = "its weights are oneDNN-prepacked, which torch.compile cannot lower"  # CachedModel.compile_step

    def __init__(self, linear: nn.Linear, rows: int = PACK_ROWS):
        super().__init__()
        weight = linear.weight.detach()
        if weight.device.type != "cpu" or not available(weight.dtype):
            raise ValueError(f"weights of {weight.dtype} on {weight.device} cannot be prepacked here (float32 on a "
                             "CPU; bfloat16 where oneDNN has native bf16 kernels)")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, rows))
        self.bias = linear.bias

    @torch.no_grad()  # inference only: with autograd recording, oneDNN took a slow path (a prefill 3x as long)
    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def dense_weight(self) -> Tensor:
        """The weight in its plain (out, in) layout."""
        return self.packed.to_dense()

    def unpacked(self) -> nn.Linear:
        """A plain `nn.Linear` with the same weights."""
        weight = self.dense_weight()
        plain = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, dtype=weight.dtype)
        with torch.no_grad():
            plain.weight.copy_(weight)
            if self.bias is not None:
                plain.bias.copy_(self.bias)
        return plain

    def __deepcopy__(self, memo: dict) -> PackedLinear:
        return PackedLinear(self.unpacked())  # a packed tensor has no storage to copy: repack a plain copy

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def is_prepacked(model: nn.Module) -> bool:
    return any(isinstance(module, PackedLinear) for module in model.modules())


def prepack(model: nn.Module) -> int:
    """Replace, in place, every CPU linear layer whose weights can be prepacked here (`available`) by a
    `PackedLinear`; how many were replaced."""
    if not available():
        raise ValueError("this torch build has no oneDNN (mkldnn): weights cannot be prepacked")

    def packed(linear: nn.Linear) -> PackedLinear | None:
        weight = linear.weight
        return PackedLinear(linear) if weight.device.type == "cpu" and available(weight.dtype) else None

    return replace_layers(model, nn.Linear, packed)[0]


def unpack(model: nn.Module) -> nn.Module:
    """Replace, in place, every `PackedLinear` by a plain `nn.Linear` (to convert or quantize the weights); `model`."""
    replace_layers(model, PackedLinear, lambda layer: layer.unpacked())
    return model
