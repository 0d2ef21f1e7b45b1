"""Weight quantization: which low-bit weights to use ("auto" included) and applying them to a loaded model."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from utils.int4 import to_int4
from utils.presets import QUANTIZE_CHOICES, ModelLoadError


def resolve_quantize(quantize: str, dtype: torch.dtype, device: torch.device) -> str:
    """ "none", "int8" or "int4". "auto": int4 on a bfloat16 CPU, int8 with 16-bit activations on CUDA (low-bit
    weights cut the bytes a one-token forward reads), none otherwise (float32 activations make quanto's low-bit
    paths far slower). int4 runs on torch's packed int4 CPU kernel, which takes bfloat16 activations only."""
    if quantize not in QUANTIZE_CHOICES:
        raise ModelLoadError(f"Unknown quantize {quantize!r}; use one of: {', '.join(QUANTIZE_CHOICES)}.")
    if quantize == "int4" and device.type != "cpu":
        raise ModelLoadError(f"int4 weights run on torch's packed int4 CPU kernel, not on {device.type}. "
                             f"Fix: use int8, or add --device cpu.")
    if quantize == "int4" and dtype != torch.bfloat16:
        raise ModelLoadError(f"int4 weights need bfloat16 activations (torch's packed int4 CPU kernel), not "
                             f"{str(dtype).removeprefix('torch.')}. Fix: add --dtype bfloat16, or use int8.")
    if quantize != "auto":
        return quantize
    if device.type == "cpu":
        return "int4" if dtype == torch.bfloat16 else "none"
    return "int8" if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) else "none"


def quantize_weights(model: PreTrainedModel, quantize: str) -> None:
    """Give `model` int8 weights (optimum-quanto) or int4 ones (`utils.int4`) in place; activations keep its dtype.

    int4 covers the linear layers of the packed kernel's shapes (`utils.int4.fits`); the others stay dense."""
    if quantize == "int8":
        from optimum.quanto import freeze, qint8, quantize as quanto_quantize  # why: slow import

        quanto_quantize(model, weights=qint8)
        freeze(model)
    elif quantize == "int4":
        to_int4(model)
    else:
        raise ValueError(f"cannot quantize weights to {quantize!r}; use int8 or int4")
