"""A model's Q4_K weights exactly as its GGUF file holds them, on torch's packed int4 CPU kernel.

Q4_K stores each row in 32-weight groups, each weight `scale * q - min` with a 4-bit q: the kernel's own groupwise
form (`(q - 8) * scale + zero`), so the GGUF's weights go in unchanged but for the scales' bfloat16 rounding. The
layer's input is rounded to bfloat16 (the kernel's activations) and its output comes back in the model's dtype, so
the rest of a float32 model (residual stream, norms, attention) stays float32.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from models.formats.base import Loaded, LoadJob, WeightFormat, apply_file_weights
from models.formats.int4 import PackedInt4
from models.formats.layers import linear_weight
from models.formats.prepack import is_prepacked
from models.gguf import tensor_bytes, tensor_infos
from utils.errors import ModelLoadError

GROUP = 32  # Q4_K's sub-block: the weights that share a scale and a min
BLOCK = 256  # weights per Q4_K block: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of codes
BLOCK_BYTES = 144
MODULES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}


def groups(raw: np.ndarray, rows: int, cols: int) -> tuple[Tensor, Tensor, Tensor]:
    """Codes (rows, cols) int32 in 0..15, scale and min (rows, cols / 32) float32 of a Q4_K tensor's bytes, so that
    weight = scale * code - min, group by group."""
    from gguf.quants import Q4_K

    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, BLOCK_BYTES)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = (qs & 0x0F).reshape(rows, cols).astype(np.int32)  # sub-blocks in order: each 32 bytes' low, then high
    scale = (d * sc.astype(np.float32)).reshape(rows, cols // GROUP)
    low = (dmin * m.astype(np.float32)).reshape(rows, cols // GROUP)
    return torch.from_numpy(codes), torch.from_numpy(scale), torch.from_numpy(low)


class Q4KLinear(PackedInt4):
    """A linear layer with a GGUF tensor's Q4_K weights; float32 (or any dtype) in and out, bfloat16 in the kernel."""

    def __init__(self, codes: Tensor, scale: Tensor, low: Tensor, bias: Tensor | None):
        super().__init__(codes, scale, 8 * scale - low, bias, GROUP)  # (code - 8) * scale + zero == scale * code - low


def apply(model: nn.Module, gguf_file: str | Path) -> list[str]:
    """Replace, in place, each of a Qwen2/Llama-layout model's decoder linears that the GGUF stores in Q4_K by a
    `Q4KLinear` of the file's own weights (checked against the model's: the file must be the one it was loaded
    from); the names replaced."""
    layers = {}
    for tensor in tensor_infos(gguf_file):
        match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", tensor.name)
        if tensor.type_name != "Q4_K" or not match or match[2] not in MODULES:
            continue
        name = f"model.layers.{match[1]}.{MODULES[match[2]]}"
        layer = model.get_submodule(name)
        cols, rows = (int(n) for n in tensor.shape)
        codes, scale, low = groups(tensor_bytes(gguf_file, tensor), rows, cols)
        weight = (codes.view(rows, -1, GROUP) * scale[..., None] - low[..., None]).view(rows, cols)
        expected = linear_weight(layer).float()
        if expected.shape != (rows, cols) or not torch.allclose(weight, expected, rtol=1 / 128, atol=1e-6):
            raise ValueError(f"{tensor.name} in {gguf_file} does not hold the weights of the model's {name}")
        layers[name] = Q4KLinear(codes, scale, low, getattr(layer, "bias", None))
    for name, new in layers.items():  # only once every layer matched: a refused file changes nothing
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
    return list(layers)


class Q4K(WeightFormat):
    """The GGUF's own Q4_K tensors in the decoder linears; its other layers (Q6_K) dense, prepacked."""

    name = "q4k"

    def load(self, model: PreTrainedModel, job: LoadJob) -> Loaded:
        dense = copy.deepcopy(model) if job.keep_dense else None
        gguf = job.gguf_file()
        if gguf is None:
            raise ModelLoadError(f"q4k reads the Q4_K tensors of the model's GGUF file, and {job.spec!r} is a "
                                 f"{job.kind} model. Fix: load its .gguf file or an embedded model, or use int4.")
        apply_file_weights(model, apply, str(gguf), "Q4_K decoder weights. Fix: use int4 for other GGUF types.")
        return Loaded(dense)

    def describe(self, model: PreTrainedModel, loaded: Loaded) -> str:
        return ("the GGUF's Q4_K weights (int4 kernel, bfloat16 inside), the rest float32"
                + (", oneDNN-prepacked" if is_prepacked(model) else ""))
