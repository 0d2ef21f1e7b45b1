"""The target's one-token step as the context grows, beside llama.cpp's decoding at the same context (one run).

    python -m benchmarks.context [--contexts 128,512,1024,2048] [--repeats N] [--json FILE]

The embedded target on the GGUF kernels, attention row by row (as `benchmarks.kernels` runs it), ms per one-token
step after a context of N tokens (the project's docs/ as text), with its KV cache grown in place (`GrowingLayer`, the
app's) and concatenated each step (`DynamicLayer`'s `torch.cat`, the cache before); llama.cpp's decode time per token
for 64 tokens after a prompt of the same N tokens (built by ./setup.sh --llamacpp, or --llamacpp BINARY). Minimum
of the repeats; the two caches and llama.cpp interleaved.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import kernels
from benchmarks.kernels import TARGET, _cpu_name, llamacpp_ms_per_token, time_step
from models import invariance
from models.loading import load_model
from models.presets import EMBEDDED, default_cache_dir
from models.store import embedded_gguf
from utils.caching import stop_growing
from utils.runner import CachedModel

DOCS = Path(__file__).resolve().parent.parent / "docs"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="128,512,1024,2048")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--llamacpp", type=Path, help="a llama-completion binary other than ./setup.sh --llamacpp's")
    args = parser.parse_args(argv)
    contexts = [int(n) for n in args.contexts.split(",")]
    if (reason := kernels.unavailable()) is not None:
        print(f"the kernels cannot run here: {reason}", file=sys.stderr)
        return 1
    loaded = load_model(TARGET, device="cpu", quantize="gguf", progress=False)
    grown, concatenated = CachedModel(loaded.model), CachedModel(loaded.model)
    stop_growing(concatenated.cache)  # for good: a reset crops the cache, its layers stay
    for lm in (grown, concatenated):
        invariance.apply(lm, invariance.TargetPath("rowwise", 1))
    text = "\n\n".join(path.read_text() for path in sorted(DOCS.glob("*.md")))
    ids = loaded.tokenizer(text)["input_ids"]
    if len(ids) < max(contexts) + 1:
        print(f"docs/ holds {len(ids)} tokens, fewer than the longest context asked", file=sys.stderr)
        return 1
    gguf = embedded_gguf(EMBEDDED[TARGET], default_cache_dir())
    threads = torch.get_num_threads()
    runs: dict[str, dict[int, list[float]]] = {name: {n: [] for n in contexts}
                                               for name in ("grown in place", "concatenated", "llama.cpp")}
    for _ in range(args.repeats):
        for n in contexts:
            for name, lm in (("grown in place", grown), ("concatenated", concatenated)):
                runs[name][n].append(time_step(lm, ids[:n], ids[n:n + 1]) * 1e3)
            prompt = str(loaded.tokenizer.decode(ids[:n]))
            llama = llamacpp_ms_per_token(gguf, threads, args.llamacpp, prompt)
            if llama is not None:
                runs["llama.cpp"][n].append(llama)
    ms = {name: {n: min(v) for n, v in per.items() if v} for name, per in runs.items()}
    print(f"one-token step of {TARGET} (gguf, {kernels.isa()}) after N tokens, ms; {_cpu_name()}, {threads} threads")
    print("| context | " + " | ".join(str(n) for n in contexts) + " |\n|---|" + "---|" * len(contexts))
    for name, per in ms.items():
        if per:
            print(f"| {name} | " + " | ".join(f"{per[n]:.1f}" if n in per else "–" for n in contexts) + " |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        machine = {"cpu": _cpu_name(), "isa": kernels.isa(), "threads": threads, "torch": torch.__version__}
        args.json.write_text(json.dumps({"machine": machine, "contexts": contexts, "step_ms": ms}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
