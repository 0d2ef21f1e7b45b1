"""8-bit weights on torch's int8 weight-only CPU kernel, one small module per linear layer.

Per output channel symmetric: each row of the weight shares one scale, its largest magnitude over 127. The kernel
reads a quarter of float32's bytes per weight and, fed bfloat16 activations, multiplies 1-14 rows for little more than
one on a CPU (docs/formats.md); each row's result is the same bits whatever the number of rows.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from models.formats.layers import replace_layers


class Int8Linear(nn.Module):
    """`linear` with int8 weights and a scale per output feature; activations and output keep their dtype."""

    codes: Tensor  # buffers (register_buffer)
    scale: Tensor

    def __init__(self, linear: nn.Linear, dtype: torch.dtype | None = None):
        super().__init__()
        weight = linear.weight.detach()
        if weight.device.type != "cpu":
            raise ValueError(f"int8 weights run on torch's CPU kernel, not on {weight.device.type}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = dtype or weight.dtype
        codes, scale = quantize(weight)
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale.to(self.dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(self.dtype),
                                                                  requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        out = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features), self.codes, self.scale)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def dequantized(self) -> Tensor:
        """The weights the kernel multiplies by, (out, in), float32."""
        return self.codes.float() * self.scale.float()[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Codes in -127..127 (int8, (out, in)) and a float32 scale per row, weight ~ code * scale."""
    scale = (weight.float().abs().amax(1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    codes = (weight.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return codes, scale


def to_int8(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Replace, in place, every linear layer by an `Int8Linear` (activations in `dtype`, default the layer's);
    how many were replaced."""
    return replace_layers(model, nn.Linear, lambda linear: Int8Linear(linear, dtype))[0]
