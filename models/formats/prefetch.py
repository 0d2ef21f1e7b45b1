"""How far ahead of the weights they stream the project's kernels ask for cache lines, on this machine. The hardware
prefetcher alone brings the lines too late while the dot products run, and the distance that serves best is a property
of the machine's memory more than of the code (docs/kernels.md: on one Xeon host a one-token pass 14% faster asking
four units ahead, where an earlier AMX Xeon host had measured it slower). So each candidate is timed on the
model's own linears, a one-token step and a verify of four, and the choice is kept per machine and kernel build."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import kernels
from models.devices import cpu_flags, cpu_model
from models.formats.blocks import BlockLinear
from utils.files import checked, key_file, read_record, write_record

CANDIDATES = (0, 4096, 8192, 16384)  # bytes ahead; 0: each layout's own (1 KB for lanes, one or two units for tiles)
MOST_AHEAD = 1 << 20  # the farthest distance the kernels take (bytes)
ROWS = (1, 4)  # a one-token step and a short verify
REPEATS = 3
BETTER = 0.97  # another distance is taken where it saves 3% of the layouts' own time: less is the timing's noise
LEAST_BYTES = 512 << 20  # past the last-level caches seen (300 MB on the Xeon): a pass streams them from memory


def tune(model: nn.Module, cache_dir: Path, again: bool = False, announce: bool = True, least_bytes: int = LEAST_BYTES,
         timer: Callable[[list[BlockLinear]], dict[int, float]] | None = None) -> int | None:
    """Set the kernels' distance to this machine's kept choice, timing it first on `model`'s block linears where none
    is kept (or `again`) and they hold `least_bytes` or more (fewer stay in cache, and a timing on them says nothing
    about memory); the distance set, or None where nothing was chosen. `announce`: say so on stderr before timing."""
    if kernels.unavailable() is not None:
        return None
    key = {"cpu": cpu_model(), "flags": sorted(cpu_flags() & {"avx2", "avx512f", "avx512_vnni", "amx_int8"}),
           "torch": torch.__version__, "kernels": kernels.build_id(), "isa": kernels.isa(),
           "threads": torch.get_num_threads()}
    path = key_file(cache_dir, key, "prefetch")
    if not again:
        kept, damaged = read_record(path, key, lambda data: checked("ahead", data["ahead"], int, (0, MOST_AHEAD)),
                                    "prefetch distance", again="timed again")
        if kept is not None:
            return kernels.prefetch(kept)
        if damaged:
            print(f"warning: {damaged}", file=sys.stderr)
    linears = [module for module in model.modules() if isinstance(module, BlockLinear)]
    if sum(linear.blocks.numel() for linear in linears) < least_bytes:
        return None
    if announce:
        print("timing how far ahead this CPU's kernels read the weights (once) …", file=sys.stderr)
    seconds = (timer or time_distances)(linears)
    best = min(seconds, key=seconds.__getitem__)
    ahead = best if seconds[best] <= BETTER * seconds[0] else 0
    try:
        write_record(path, {"key": key, "seconds": seconds, "ahead": ahead})
    except OSError:  # a read-only cache dir: the choice still serves this run
        pass
    return kernels.prefetch(ahead)


def time_distances(linears: list[BlockLinear]) -> dict[int, float]:
    """Seconds of every linear at each row count of ROWS, summed, for each candidate distance: the best of REPEATS,
    the candidates taken in turn within each repeat (the machine's pace drifts over seconds)."""
    generator = torch.Generator().manual_seed(0)
    inputs = {(rows, width): torch.randn(rows, width, generator=generator)
              for rows in ROWS for width in {linear.in_features for linear in linears}}
    before = kernels.prefetch()
    best = dict.fromkeys(CANDIDATES, float("inf"))
    try:
        with torch.inference_mode():
            for linear in linears:  # first calls: scratch buffers, pages
                linear(inputs[1, linear.in_features])
            for _ in range(REPEATS):
                for ahead in CANDIDATES:
                    kernels.prefetch(ahead)
                    start = time.perf_counter()
                    for rows in ROWS:
                        for linear in linears:
                            linear(inputs[rows, linear.in_features])
                    best[ahead] = min(best[ahead], time.perf_counter() - start)
    finally:
        kernels.prefetch(before)
    return best
