"""The project's CPU kernels: matmuls over a GGUF tensor's own blocks (Q4_K, Q6_K, Q4_0, Q5_0, Q8_0) for 1..16 rows and
tiled for prefill, activations rounded to int8 per block; each row's result has the same bits whatever the number of
rows. A torch op (`torch.ops.specchat.gguf_mm`), built from csrc/ by `kernels.build`.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch
from torch import Tensor

from kernels.build import BuildError, build

# GGML type id -> (weights, bytes) per block, as csrc/blocks.h reads them
BLOCKS = {"Q4_0": (2, 32, 18), "Q5_0": (6, 32, 22), "Q8_0": (8, 32, 34), "Q4_K": (12, 256, 144), "Q6_K": (14, 256, 210)}
BLOCK_BYTES = {type_id: (weights, size) for type_id, weights, size in BLOCKS.values()}


@cache
def _loaded(cache_dir: Path | None = None) -> str | None:
    """Load the library (building it if needed); None where it loads, else why not (one line)."""
    try:
        torch.ops.load_library(str(build(cache_dir)))
    except (BuildError, OSError) as error:
        return str(error).splitlines()[0] if str(error) else type(error).__name__
    if not torch.ops.specchat.gguf_isa():
        return "this CPU has no AVX2 and FMA"
    torch.library.register_fake("specchat::gguf_mm")(_fake_mm)
    torch.library.register_fake("specchat::gguf_rows")(_fake_rows)
    torch.library.register_fake("specchat::gguf_pack")(_fake_pack)
    torch.library.register_fake("specchat::gguf_unpack")(_fake_unpack)
    torch.library.register_fake("specchat::row_attention")(_fake_attention)
    return None


# The layouts the AVX-512 and AMX kernels read (csrc/lanes.h): (weights, bytes) per unit of a row, by type id
PACKED = {258: (128, 72), 262: (128, 88), 264: (128, 136), 268: (256, 148), 270: (256, 210), 514: (128, 72),
          524: (256, 148), 526: (256, 210)}


def _fake_mm(x: Tensor, w: Tensor, ggml_type: int, out_features: int, bias: Tensor | None = None) -> Tensor:
    return x.new_empty(x.shape[0], out_features)


def _fake_pack(w: Tensor, ggml_type: int) -> Tensor:
    cols = w.shape[1] // BLOCK_BYTES[ggml_type][1] * BLOCK_BYTES[ggml_type][0]
    layout = int(torch.ops.specchat.gguf_layout(ggml_type, cols, w.shape[0]))
    per_unit, size = PACKED.get(layout, BLOCK_BYTES[ggml_type])
    return w.new_empty(w.shape[0], cols // per_unit * size)


def _fake_unpack(w: Tensor, ggml_type: int) -> Tensor:
    per_unit, size = PACKED[ggml_type]
    per_block, block_bytes = BLOCK_BYTES[ggml_type % 256]
    return w.new_empty(w.shape[0], w.shape[1] // size * per_unit // per_block * block_bytes)


def _fake_rows(blocks: Tensor, ids: Tensor, ggml_type: int, cols: int) -> Tensor:
    return blocks.new_empty(*ids.shape, cols, dtype=torch.float32)


def _fake_attention(q: Tensor, k: Tensor, v: Tensor, seen: Tensor | None, scaling: float) -> Tensor:
    return q.new_empty(q.shape[0], q.shape[2], q.shape[1], v.shape[3])


@torch.compiler.assume_constant_result  # a compiled graph takes it as it was when compiled
def unavailable(cache_dir: Path | None = None) -> str | None:
    """Why the kernels cannot run here (one line), or None where they can."""
    return _loaded(cache_dir)


def build_id() -> str:
    """The library's short digest (its sources, flags and torch version): what a kept calibration holds for."""
    from kernels.build import library_path

    return library_path().parent.name[:8]


def isa() -> str:
    """The instruction set the kernels run with here ("amx-int8", "avx512-tiles", "avx512-vnni", "avx2"), or "" where
    they cannot run."""
    return "" if unavailable() else str(torch.ops.specchat.gguf_isa())


def isas() -> list[str]:
    """The kernels' instruction sets this CPU runs, best first (the first is the one taken by default)."""
    return [] if unavailable() else list(torch.ops.specchat.gguf_isas())


def use(name: str = "") -> str:
    """Run on one instruction set's kernels from now on ("" for the best this CPU runs); the name now in use.
    A set this CPU does not run is refused with the ones it does."""
    if (reason := unavailable()) is not None:
        raise RuntimeError(f"the GGUF block kernels cannot run here: {reason}")
    return str(torch.ops.specchat.gguf_use(name))


def prefetch(ahead: int | None = None) -> int:
    """How far ahead of the weights they stream (bytes) the kernels ask for cache lines, set to `ahead` where given
    (0: each layout's own distance); the distance now. It changes no result, only when the lines arrive."""
    if (reason := unavailable()) is not None:
        raise RuntimeError(f"the GGUF block kernels cannot run here: {reason}")
    return int(torch.ops.specchat.gguf_prefetch(-1 if ahead is None else ahead))


def row_attention(q: Tensor, k: Tensor, v: Tensor, seen: Tensor | None, scaling: float) -> Tensor:
    """Attention one query row at a time over the keys it sees, in order: q (B, H, Q, D), k and v (B, Hkv, K, D)
    float32, `seen` None (causal, the rows being the last Q keys) or bool (B or 1, Q, K). (B, Q, H, Dv)."""
    if (reason := unavailable()) is not None:
        raise RuntimeError(f"the project's kernels cannot run here: {reason}")
    return torch.ops.specchat.row_attention(q, k, v, seen, scaling)


def pack(blocks: Tensor, block_type: str) -> tuple[Tensor, int]:
    """A GGUF tensor's blocks, uint8 (rows, bytes of one row), as the kernels in use read them best, and the type id
    to run them with: the AVX-512 kernels read every type rearranged (the same values; `unpack` gives the file's bytes
    back), the tile sets (AMX, or VNNI alone) Q4_K, Q6_K and Q4_0 as tiles of 16 rows (where the rows are whole
    tiles), the AVX2 kernels every type but Q8_0 as the AVX-512 ones (Q8_0: the file's own blocks, not copied)."""
    if (reason := unavailable()) is not None:
        raise RuntimeError(f"the GGUF block kernels cannot run here: {reason}")
    type_id, per_block, block_bytes = BLOCKS[block_type]
    layout = int(torch.ops.specchat.gguf_layout(type_id, blocks.shape[-1] // block_bytes * per_block, blocks.shape[0]))
    return (blocks, type_id) if layout == type_id else (torch.ops.specchat.gguf_pack(blocks, type_id), layout)


def unpack(weights: Tensor, type_id: int) -> Tensor:
    """The file's blocks of weights that `pack` returned with `type_id` (the same tensor where it did not pack)."""
    return torch.ops.specchat.gguf_unpack(weights, type_id) if type_id in PACKED else weights


def matmul(x: Tensor, blocks: Tensor, block_type: str, out_features: int, bias: Tensor | None = None) -> Tensor:
    """x (rows, in) float32 times the weights (out_features, in) held as GGUF blocks: uint8 (out_features, bytes of
    one row), packed first as the kernels in use read them; bias float32 or None. Float32 (rows, out_features)."""
    weights, type_id = pack(blocks, block_type)
    return torch.ops.specchat.gguf_mm(x, weights, type_id, out_features, bias)


def quantize(weights: Tensor, block_type: str = "Q8_0") -> Tensor:
    """Dense weights (out, in) as GGUF blocks, uint8 (out, bytes of one row), quantized as ggml's reference quantizer
    does (Q8_0: one fp16 scale max|w| / 127 per 32 weights, int8 codes; Q4_0: one fp16 scale per 32 weights, the
    largest in magnitude over -8, 4-bit codes); `in` a multiple of 32."""
    if (reason := unavailable()) is not None:
        raise RuntimeError(f"the GGUF block kernels cannot run here: {reason}")
    return torch.ops.specchat.gguf_quantize(weights.detach().float(), BLOCKS[block_type][0])


def rows(blocks: Tensor, ids: Tensor, block_type: str, cols: int) -> Tensor:
    """Rows `ids` (integers, any shape) of a tensor (rows, cols) held as GGUF blocks, uint8 (rows, bytes of one row),
    dequantized as the format defines: float32 (*ids.shape, cols). Only the rows asked are decoded (a lookup)."""
    if (reason := unavailable()) is not None:
        raise RuntimeError(f"the GGUF block kernels cannot run here: {reason}")
    return torch.ops.specchat.gguf_rows(blocks, ids, BLOCKS[block_type][0], cols)
