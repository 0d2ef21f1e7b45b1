"""Swapping a model's layers in place: how every weight format (int4, int8, prepacked float32) is applied."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from torch import Tensor, nn

Layer = TypeVar("Layer", bound=nn.Module)


def replace_layers(model: nn.Module, kind: type[Layer],
                   make: Callable[[Layer], nn.Module | None]) -> tuple[int, list[str]]:
    """Replace, in place, every submodule of exactly type `kind` by `make(layer)`, or keep it where `make` returns
    None; how many were replaced, and the names of those kept."""
    replaced, kept = 0, []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not kind or not isinstance(child, kind):  # exactly `kind` (isinstance: for the checker)
                continue
            new = make(child)
            if new is None:
                kept.append(f"{parent_name}.{name}".lstrip("."))
            else:
                setattr(parent, name, new)
                replaced += 1
    return replaced, kept


def linear_weight(layer: nn.Module):
    """The (out, in) weight a linear layer multiplies by, in any of the project's formats, as a plain tensor."""
    if isinstance(layer, nn.Linear):
        return layer.weight.detach()
    for read in ("dense_weight", "dequantized"):  # prepacked float32; int4 and int8
        if hasattr(layer, read):
            return getattr(layer, read)()
    raise TypeError(f"no weight can be read from a {type(layer).__name__}")


def linear_rows(layer: nn.Module, ids: Tensor) -> Tensor:
    """Rows `ids` of the (out, in) weight a linear layer multiplies by, as a plain tensor; a format that can read rows
    alone (GGUF blocks) dequantizes only those."""
    read = getattr(layer, "weight_rows", None)
    return linear_weight(layer)[ids] if read is None else read(ids)
