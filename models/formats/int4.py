"""4-bit weights on torch's packed int4 CPU kernel, one small module per linear layer.

Groupwise asymmetric: each row's weights in groups of `GROUP` input features share a scale and a zero, found from the
group's min and max (optimum-quanto's int4 recipe, so drafts are accepted as often). The module calls the kernel
directly, without the autograd function and dispatch of quanto's int4 tensor subclass (docs/formats.md).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from models.formats.layers import replace_layers

GROUP = 128  # input features per scale/zero pair
OUT_MULTIPLE = 16  # the packed layout takes output features by 16s
INNER_K_TILES = 2


def fits(linear: nn.Linear) -> bool:
    """Whether the kernel takes this layer's shape."""
    return linear.in_features % GROUP == 0 and linear.out_features % OUT_MULTIPLE == 0


class PackedInt4(nn.Module):
    """A linear layer on the kernel: codes in 0..15 with a scale and a zero per `group` input features (the weight is
    (code - 8) * scale + zero); the input is rounded to bfloat16 for the kernel, the output comes back in its dtype."""

    packed: Tensor  # buffers (register_buffer)
    scale_zero: Tensor

    def __init__(self, codes: Tensor, scale: Tensor, zero: Tensor, bias: Tensor | None, group: int):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.group = group
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(codes, INNER_K_TILES))
        # (groups, out, 2): the kernel's layout
        self.register_buffer("scale_zero", torch.stack([scale, zero], -1).transpose(0, 1).contiguous()
                             .to(torch.bfloat16))
        self.bias = bias

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch._weight_int4pack_mm_for_cpu(flat, self.packed, self.group, self.scale_zero).to(x.dtype)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def dequantized(self) -> Tensor:
        """The weights the kernel multiplies by, (out, in)."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        return torch._weight_int4pack_mm_for_cpu(eye, self.packed, self.group, self.scale_zero).T

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int4Linear(PackedInt4):
    """`linear` with 4-bit weights; activations and output keep its dtype (bfloat16: the kernel's only one)."""

    def __init__(self, linear: nn.Linear):
        if not fits(linear):
            raise ValueError(f"int4 needs input features in groups of {GROUP} and output features by "
                             f"{OUT_MULTIPLE}s, not {linear.in_features} -> {linear.out_features}")
        if linear.weight.device.type != "cpu" or linear.weight.dtype != torch.bfloat16:
            raise ValueError("int4 weights run on torch's CPU kernel with bfloat16 activations")
        super().__init__(*quantize(linear.weight.detach()), linear.bias, GROUP)


def quantize(weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Codes in 0..15 (int32, (out, in)) and per-group scale and zero ((out, groups), float32) with
    weight ~ (code - 8) * scale + zero."""
    out_features, in_features = weight.shape
    groups = weight.float().reshape(out_features, in_features // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp(min=torch.finfo(torch.bfloat16).tiny)
    codes = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32)
    return codes.reshape(out_features, in_features), scale, low + 8 * scale


def to_int4(model: nn.Module) -> list[str]:
    """Replace, in place, every linear layer the kernel takes by an `Int4Linear`; the names of those left dense."""
    return replace_layers(model, nn.Linear, lambda linear: Int4Linear(linear) if fits(linear) else None)[1]
