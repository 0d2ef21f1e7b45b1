"""The GGUF block kernels on this machine: the target's linears against the memory-bandwidth floor, and the whole
target step against llama.cpp's decoding of the same file on the same threads (interleaved, one run).

    python -m benchmarks.kernels [--repeats N] [--json FILE]

Kernel table: every linear of the embedded target's GGUF (its own blocks), ms for 1..16 rows, beside the floor (the
bytes read / this run's streaming-read GB/s), for each instruction set's kernels this CPU runs (an AVX-512 machine
runs the AVX2 build too). Step table: the target on `gguf` (attention row by row, as the probe runs it where the
others are not exact) on each instruction set, and with --float32 on float32 oneDNN-prepacked, ms for 1..16 new
tokens after a 128-token context; llama.cpp's eval time per token from `llama-completion` (built by
./setup.sh --llamacpp, or --llamacpp BINARY), 64 tokens. Minimum of the repeats.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import kernels
from benchmarks.llamacpp import binary, parse_completion_log
from models import invariance
from models.formats.blocks import module_name
from models.gguf import tensor_bytes, tensor_infos
from models.loading import load_model
from models.presets import EMBEDDED, default_cache_dir
from models.store import embedded_gguf
from utils.runner import CachedModel

TARGET = "qwen2.5-coder-1.5b"
ROWS = (1, 2, 4, 8, 16)
CONTEXT = 128


def target_linears(gguf: Path) -> list[tuple[torch.Tensor, str, int, int]]:
    """(blocks, type, in, out) of every linear the kernels take, in file order."""
    found = []
    for tensor in tensor_infos(gguf):
        if module_name(tensor.name, tied=False) and tensor.type_name in kernels.BLOCKS:
            cols, rows = tensor.shape
            found.append((torch.from_numpy(np.array(tensor_bytes(gguf, tensor))), tensor.type_name, cols, rows))
    return found


def packed_linears(layers) -> list[tuple[torch.Tensor, int, int, int]]:
    """(weights, type id, in, out) of each linear as the kernels in use read them (`kernels.pack`)."""
    return [(*kernels.pack(raw, kind), cols, out) for raw, kind, cols, out in layers]


def time_linears(layers, rows: int) -> float:
    inputs = {cols: torch.randn(rows, cols) for cols in {layer[2] for layer in layers}}
    start = time.perf_counter()
    for weights, type_id, cols, out in layers:
        torch.ops.specchat.gguf_mm(inputs[cols], weights, type_id, out, None)
    return time.perf_counter() - start


def streaming_read(buffer: torch.Tensor) -> float:
    """Bytes per second of one pass summing `buffer` (as large as the weights: nothing stays in cache)."""
    start = time.perf_counter()
    buffer.sum()
    return buffer.numel() * buffer.element_size() / (time.perf_counter() - start)


PROMPT = "Write a Python function that checks whether a number is prime, with a docstring."


def llamacpp_ms_per_token(gguf: Path, threads: int, executable: Path | None = None, prompt: str = PROMPT
                          ) -> float | None:
    """llama.cpp's decode time per token (ms) of `gguf` for 64 tokens after `prompt`; None where it is not built or
    does not run here (said)."""
    executable = executable or binary(default_cache_dir(), "llamacpp", "")
    if not executable.is_file():
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as file:
        file.write(prompt)
        file.flush()
        done = subprocess.run([str(executable), "-m", str(gguf), "-f", file.name, "-n", "64", "-t", str(threads),
                               "--temp", "0", "-no-cnv", "--no-display-prompt", "--ignore-eos"],
                              capture_output=True, text=True, errors="replace")
    if done.returncode != 0:  # e.g. its AMX path dies on some Xeons: LLAMA_ARG_REPACK=0 or a build without AMX runs
        print(f"{executable} exited {done.returncode}: no llama.cpp column", file=sys.stderr)
        return None
    timings = parse_completion_log(done.stderr + done.stdout)
    return timings.generate_seconds / (timings.generated - 1) * 1e3


def step_model(quantize: str) -> CachedModel:
    """The target as the app runs it (its weights packed for the kernels in use), attention row by row."""
    lm = CachedModel(load_model(TARGET, device="cpu", quantize=quantize, progress=False).model)
    invariance.apply(lm, invariance.TargetPath("rowwise", 1))
    return lm


def time_step(lm: CachedModel, context: list[int], new: list[int]) -> float:
    """Seconds of one forward of `new` after `context`."""
    with torch.inference_mode():
        lm.reset()
        lm.forward(context)
        start = time.perf_counter()
        lm.forward(new)
        seconds = time.perf_counter() - start
        lm.reset()
    return seconds


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--float32", action="store_true", help="time the float32 oneDNN-prepacked target's step too")
    parser.add_argument("--llamacpp", type=Path, help="a llama-completion binary other than ./setup.sh --llamacpp's")
    args = parser.parse_args(argv)
    if (reason := kernels.unavailable()) is not None:
        print(f"the kernels cannot run here: {reason}", file=sys.stderr)
        return 1
    gguf = embedded_gguf(EMBEDDED[TARGET], default_cache_dir())
    layers = target_linears(gguf)
    weight_bytes = sum(raw.numel() for raw, *_ in layers)
    buffer = torch.ones(weight_bytes // 4)
    isas = kernels.isas()
    linears, models, ahead = {}, {}, {}
    for isa in isas:  # each instruction set reads its own layout of the weights, as far ahead as its load chose
        kernels.use(isa)
        linears[isa], models[f"gguf, {isa}"] = packed_linears(layers), step_model("gguf")
        ahead[isa] = kernels.prefetch()
    kernels.use()
    if args.float32:
        models[f"float32-prepacked, {isas[0]}"] = step_model("none")
    del layers
    ids = torch.randint(0, 150000, (CONTEXT + max(ROWS),), generator=torch.Generator().manual_seed(0)).tolist()
    kernel_s: dict[str, dict[int, list[float]]] = {isa: {rows: [] for rows in ROWS} for isa in isas}
    step_s: dict[str, dict[int, list[float]]] = {name: {rows: [] for rows in ROWS} for name in models}
    reads = []
    threads = torch.get_num_threads()
    builds = {"": args.llamacpp or binary(default_cache_dir(), "llamacpp", "")}
    if "avx2" in isas and isas[0] != "avx2" and not args.llamacpp:  # the AVX2 build beside our AVX2 set, where built
        builds["avx2"] = binary(default_cache_dir(), "llamacpp", "avx2")
    llama: dict[str, list[float | None]] = {which: [] for which in builds}

    def use(isa: str) -> None:  # the set and its own distance (the process holds one: the last load's)
        kernels.use(isa)
        kernels.prefetch(ahead[isa])

    time_linears(linears[isas[0]], 1)  # first-call allocations
    try:
        for _ in range(args.repeats):
            reads.append(streaming_read(buffer))
            for rows in ROWS:
                for isa in isas:
                    use(isa)
                    kernel_s[isa][rows].append(time_linears(linears[isa], rows))
                for name, lm in models.items():
                    use(name.rpartition(", ")[2])
                    step_s[name][rows].append(time_step(lm, ids[:CONTEXT], ids[CONTEXT:CONTEXT + rows]))
            for which, executable in builds.items():
                llama[which].append(llamacpp_ms_per_token(gguf, threads, executable))
    finally:
        use(isas[0])  # the best set, as loaded
    floor_ms = weight_bytes / max(reads) * 1e3
    kernel_ms = {isa: {rows: min(v) * 1e3 for rows, v in per.items()} for isa, per in kernel_s.items()}
    step_ms = {name: {rows: min(v) * 1e3 for rows, v in per.items()} for name, per in step_s.items()}
    best = {which: min(m for m in ms if m is not None) for which, ms in llama.items() if ms and None not in ms}
    llama_ms, llama_avx2_ms = best.get(""), best.get("avx2")
    result = {"machine": {"cpu": _cpu_name(), "isas": isas, "threads": threads, "torch": torch.__version__},
              "prefetch_bytes": ahead,
              "weight_bytes": weight_bytes,
              "packed_bytes": {isa: sum(weights.numel() for weights, *_ in per) for isa, per in linears.items()},
              "read_gb_s": max(reads) / 1e9, "floor_ms": floor_ms,
              "kernel_ms": kernel_ms, "step_ms": step_ms, "llamacpp_ms_per_token": llama_ms,
              "llamacpp_avx2_ms_per_token": llama_avx2_ms}
    distances = ", ".join(f"{isa} {ahead[isa]} bytes ahead" if ahead[isa] else f"{isa} at its layouts' own distance"
                          for isa in isas)
    print(f"{len(linears[isas[0]])} linears, {weight_bytes / 1e9:.3f} GB in the file; streaming read "
          f"{max(reads) / 1e9:.1f} GB/s: floor {floor_ms:.1f} ms; {_cpu_name()}, {threads} threads; each set asks "
          f"for the weights' lines as this machine chose: {distances}")
    print("| rows | " + " | ".join(str(r) for r in ROWS) + " |\n|---|" + "---|" * len(ROWS))
    for isa, per in kernel_ms.items():
        print(f"| linears, {isa}, ms | " + " | ".join(f"{per[r]:.0f}" for r in ROWS) + " |")
        print(f"| × floor, {isa} | " + " | ".join(f"{per[r] / floor_ms:.2f}" for r in ROWS) + " |")
        print(f"| × one row, {isa} | " + " | ".join(f"{per[r] / per[1]:.2f}" for r in ROWS) + " |")
    for name, per in step_ms.items():
        print(f"| step, {name}, ms | " + " | ".join(f"{per[r]:.0f}" for r in ROWS) + " |")
    if llama_ms is not None:
        ours = step_ms[f"gguf, {isas[0]}"]
        print(f"llama.cpp plain decode: {llama_ms:.1f} ms per token; our gguf step ({isas[0]}) "
              f"{ours[1] / llama_ms:.2f}× of it, a verify of 8 {ours[8] / ours[1]:.2f} steps")
    if llama_avx2_ms is not None:
        ours = step_ms["gguf, avx2"]
        print(f"llama.cpp's AVX2 build: {llama_avx2_ms:.1f} ms per token; our gguf step (avx2) "
              f"{ours[1] / llama_avx2_ms:.2f}× of it, a verify of 8 {ours[8] / ours[1]:.2f} steps")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


def _cpu_name() -> str:
    """The CPU's model name, family and model as the kernel reports them (platform.processor() is empty on Linux)."""
    with contextlib.suppress(OSError):
        fields = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
                      if ":" in line)
        fields = {key.strip(): value.strip() for key, value in fields.items()}
        return f"{fields['model name']} (family {fields['cpu family']}, model {fields['model']})"
    return platform.machine()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
