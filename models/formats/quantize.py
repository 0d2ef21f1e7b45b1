"""Weight quantization: which low-bit weights to use ("auto" included) and applying them to a loaded model."""

from __future__ import annotations

import copy

import torch
from transformers import PreTrainedModel

from models.formats.base import Loaded, LoadJob, WeightFormat
from models.formats.int4 import to_int4
from models.formats.int8 import to_int8
from models.presets import QUANTIZE_CHOICES
from utils.errors import ModelLoadError

LOW_BIT_CPU = ("int4", "int8")  # torch's packed CPU kernels, which take bfloat16 activations
# formats with float32 around their layers, CPU only: (the kernel they run on, what their layers are)
FILE_FORMATS = {"gguf": ("the project's CPU kernels", "block"), "q4k": ("torch's packed int4 CPU kernel", "Q4_K"),
                "q8_0": ("the project's CPU kernels", "Q8_0")}


def resolve_quantize(quantize: str, dtype: torch.dtype, device: torch.device, dtype_given: bool = True) -> str:
    """ "none", "int8" or "int4". On a CPU both run on torch's packed kernels with bfloat16 activations, whatever the
    CPU (low-bit weights cut the bytes a decode step reads); on CUDA int8 is optimum-quanto's. "auto": int4 on a CPU
    (none where another dtype than bfloat16 was asked for by name: float32 for exact comparisons), int8 with 16-bit
    activations on CUDA.
    `dtype_given`: False when `dtype` is the machine's default rather than the user's choice; low-bit CPU weights then
    bring their own bfloat16 activations (`activation_dtype`)."""
    if quantize not in QUANTIZE_CHOICES:
        raise ModelLoadError(f"Unknown quantize {quantize!r}; use one of: {', '.join(QUANTIZE_CHOICES)}.")
    if quantize in FILE_FORMATS:  # a GGUF file's own weights: CPU only, float32 around them
        kernel, layers = FILE_FORMATS[quantize]
        if device.type != "cpu":
            raise ModelLoadError(f"{quantize} weights run on {kernel}, not on {device.type}. Fix: add --device cpu.")
        if dtype_given and dtype != torch.float32:
            raise ModelLoadError(f"{quantize} keeps everything but its {layers} layers in float32, not "
                                 f"{str(dtype).removeprefix('torch.')}. Fix: add --dtype float32 (or auto).")
        return quantize
    if quantize == "int4" and device.type != "cpu":
        raise ModelLoadError(f"int4 weights run on torch's packed int4 CPU kernel, not on {device.type}. "
                             f"Fix: use int8, or add --device cpu.")
    if quantize == "auto":
        if device.type == "cpu":
            quantize = "int4" if not dtype_given or dtype == torch.bfloat16 else "none"
        else:
            return "int8" if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) else "none"
    if quantize in LOW_BIT_CPU and device.type == "cpu" and dtype_given and dtype != torch.bfloat16:
        raise ModelLoadError(f"{quantize} weights need bfloat16 activations (torch's packed {quantize} CPU kernel), "
                             f"not {str(dtype).removeprefix('torch.')}. Fix: add --dtype bfloat16 (or auto), or use "
                             "none.")
    return quantize


def activation_dtype(quantize: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a model with these weights computes in: bfloat16 for low-bit CPU weights, float32 for q4k (bfloat16
    only inside its Q4_K layers) and gguf (int8 activations inside its block layers), else `dtype`."""
    if quantize in FILE_FORMATS:
        return torch.float32
    return torch.bfloat16 if quantize in LOW_BIT_CPU and device.type == "cpu" else dtype


def quantize_weights(model: PreTrainedModel, quantize: str) -> None:
    """Give `model` int8 weights (`models.formats.int8` on a CPU, optimum-quanto elsewhere) or int4 ones
    (`models.formats.int4`) in place; activations keep its dtype.

    int4 covers the linear layers of the packed kernel's shapes (`models.formats.int4.fits`); the others stay dense."""
    if quantize == "int8" and next(model.parameters()).device.type == "cpu":
        to_int8(model)
    elif quantize == "int8":
        from optimum.quanto import freeze, qint8  # why: slow import
        from optimum.quanto import quantize as quanto_quantize

        quanto_quantize(model, weights=qint8)
        freeze(model)
    elif quantize == "int4":
        to_int4(model)
    else:
        raise ValueError(f"cannot quantize weights to {quantize!r}; use int8 or int4")


class LowBit(WeightFormat):
    """int8 or int4 weights (`quantize_weights`); a drafter keeps a dense copy to prefill with."""

    packs_model = False  # packed low-bit layers: only the dense copy goes to oneDNN's layout

    def __init__(self, name: str):
        self.name = name

    def load(self, model: PreTrainedModel, job: LoadJob) -> Loaded:
        # the dense copy prefills in the machine's dtype: without native bf16, a bf16 prefill is several times slower
        dense = copy.deepcopy(model).to(job.compute_dtype) if job.keep_dense else None  # type: ignore[arg-type]
        quantize_weights(model, self.name)
        return Loaded(dense)

    def describe(self, model: PreTrainedModel, loaded: Loaded) -> str:
        return f"{self.name} weights, {str(next(model.parameters()).dtype).removeprefix('torch.')} activations"
