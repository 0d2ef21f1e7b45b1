"""Which low-bit weights a dense model takes on a CPU under "auto": the project's Q8_0 blocks (about 1.06 bytes a
weight, int8 activations, close to lossless) or torch's packed int4 kernel (about 0.56 bytes, bfloat16 activations,
lossier). Neither wins on every CPU, so both are timed on this machine, on the model's own layer shapes (random
weights: the cost does not depend on their values), and the choice is kept per machine, shapes and kernel build."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch import nn

import kernels
from models.devices import cpu_flags, cpu_model
from models.formats.blocks import quantize_dense
from models.formats.int4 import to_int4
from utils.files import checked, key_file, read_record, write_record

LAYERS = 6  # decoder layers' worth of weights timed: past the last-level cache, as a step reads them
ROWS = (1, 4)  # a one-token step and a short verify
FORMATS = ("q8_0", "int4")  # what a choice can be
CLOSE = 1.25  # int4 must save a fifth of Q8_0's time to be worth its larger rounding error


def shapes(config) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's linears of a Llama/Qwen2-layout config."""
    hidden, inner = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    width = getattr(config, "head_dim", None) or hidden // heads
    kv = getattr(config, "num_key_value_heads", heads) * width
    return [(heads * width, hidden), (kv, hidden), (kv, hidden), (hidden, heads * width), (inner, hidden),
            (inner, hidden), (hidden, inner)]


def choose(config, cache_dir: Path) -> str:
    """"q8_0" or "int4" for a model of `config` on this CPU (timed once, then read back)."""
    layer = shapes(config)
    key = {"cpu": cpu_model(), "flags": sorted(cpu_flags() & {"avx2", "avx512f", "avx512_vnni", "avx512_bf16",
                                                               "amx_int8", "amx_bf16"}),
           "torch": torch.__version__, "kernels": kernels.build_id(), "isa": kernels.isa(),
           "threads": torch.get_num_threads(), "shapes": layer}
    path = key_file(cache_dir, key, "formats")
    kept, damaged = read_record(path, key, lambda data: checked("choice", data["choice"], str, among=FORMATS),
                                "format choice", again="timed again")
    if kept is not None:
        return kept
    if damaged:
        print(f"warning: {damaged}", file=sys.stderr)
    print("timing this CPU's low-bit kernels on the model's layer shapes (once) …", file=sys.stderr)
    seconds = time_formats(layer)
    choice = "q8_0" if seconds["q8_0"] <= CLOSE * seconds["int4"] else "int4"
    write_record(path, {"key": key, "seconds": seconds, "choice": choice})
    return choice


def time_formats(layer: list[tuple[int, int]], repeats: int = 3) -> dict[str, float]:
    """Seconds for LAYERS layers of these linears in each format, summed over ROWS, the best of `repeats`."""
    generator = torch.Generator().manual_seed(0)
    dense = nn.Sequential(*(nn.Linear(cols, rows, bias=False, dtype=torch.bfloat16)
                            for _ in range(LAYERS) for rows, cols in layer))
    with torch.no_grad():
        for rows_cols, weight in zip(layer * LAYERS, dense.parameters(), strict=True):
            weight.copy_(torch.randn(*rows_cols, generator=generator) * 0.02)
    q8_0 = nn.Sequential(*dense)  # the same layers, replaced in turn: one copy of the weights at a time
    quantize_dense(q8_0)
    int4 = nn.Sequential(*(nn.Linear(cols, rows, bias=False, dtype=torch.bfloat16)
                           for _ in range(LAYERS) for rows, cols in layer))
    to_int4(int4)
    inputs = {(dtype, rows, cols): torch.randn(rows, cols, generator=generator).to(dtype)
              for dtype in (torch.float32, torch.bfloat16) for rows in ROWS for _, cols in layer}
    best = {"q8_0": float("inf"), "int4": float("inf")}
    with torch.inference_mode():
        for _ in range(repeats):
            for name, model, dtype in (("q8_0", q8_0, torch.float32), ("int4", int4, torch.bfloat16)):
                start = time.perf_counter()
                for rows in ROWS:
                    for linear, (_, cols) in zip(model, layer * LAYERS, strict=True):
                        linear(inputs[dtype, rows, cols])
                best[name] = min(best[name], time.perf_counter() - start)
    return best
