"""Time to the first token of a long prompt: the target's prefill of N tokens beside llama.cpp's prompt evaluation.

    python -m benchmarks.prefill [--target SPEC] [--quantize FORMAT] [--lengths 1024,4096] [--repeats N]
                                 [--json FILE] [--llamacpp BINARY]

The target as the app loads it (by default the embedded preset's, in its format, attention on the probed path:
`app.calibration.probe`, kept per machine), seconds from a fresh cache to the logits of a prompt's last token for a
prompt of N tokens (the project's docs/ as text); llama.cpp's prompt evaluation of the same text on the target's
embedded GGUF (built by ./setup.sh --llamacpp, or --llamacpp BINARY; its column is left out where it is not built
or the target has no embedded GGUF). Minimum of the repeats; the two interleaved.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.llamacpp import binary, parse_completion_log
from utils.runner import CachedModel

DOCS = Path(__file__).resolve().parent.parent / "docs"
LENGTHS = (1024, 4096)


def time_prefill(lm: CachedModel, prompt: list[int]) -> float:
    """Seconds from an empty cache to the last prompt token's logits (the first token's distribution)."""
    with torch.inference_mode():
        lm.reset()
        start = time.perf_counter()
        lm.forward(prompt, logits_rows=1)
        seconds = time.perf_counter() - start
        lm.reset()
    return seconds


def llamacpp_prompt_seconds(gguf: Path, threads: int, executable: Path, prompt: str) -> float | None:
    """llama.cpp's prompt evaluation (s) of `prompt` on `gguf`, one token generated; None where it is not built or
    does not run here (said)."""
    if not executable.is_file():
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as file:
        file.write(prompt)
        file.flush()
        done = subprocess.run([str(executable), "-m", str(gguf), "-f", file.name, "-n", "1", "-t", str(threads),
                               "-c", "0", "--temp", "0", "-no-cnv", "--no-display-prompt"],
                              capture_output=True, text=True, errors="replace")
    if done.returncode != 0:
        print(f"{executable} exited {done.returncode}: no llama.cpp column", file=sys.stderr)
        return None
    return parse_completion_log(done.stderr + done.stdout).prompt_seconds


def measure(lm: CachedModel, ids: list[int], lengths: list[int], repeats: int,
            llamacpp: Callable[[list[int]], float | None] | None) -> dict[str, dict[int, float]]:
    """Seconds per prompt length, the minimum of `repeats`: "target" always, "llama.cpp" where `llamacpp` answers
    (it gets the prompt's ids; None: not built). The two interleaved, each length in turn."""
    runs: dict[str, dict[int, list[float]]] = {name: {n: [] for n in lengths} for name in ("target", "llama.cpp")}
    for _ in range(repeats):
        for n in lengths:
            runs["target"][n].append(time_prefill(lm, ids[:n]))
            theirs = llamacpp(ids[:n]) if llamacpp is not None else None
            if theirs is not None:
                runs["llama.cpp"][n].append(theirs)
    return {name: {n: min(v) for n, v in per.items() if v} for name, per in runs.items()}


def table(seconds: dict[str, dict[int, float]], lengths: list[int]) -> str:
    """A markdown table, one row per contestant that has a time, "–" where it has none for a length."""
    lines = ["| prompt tokens | " + " | ".join(str(n) for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for name, per in seconds.items():
        if per:
            lines.append(f"| {name} | " + " | ".join(f"{per[n]:.2f}" if n in per else "–" for n in lengths) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    from app.calibration import pair_key, probe
    from models.loading import LoadedPair, load_model
    from models.presets import EMBEDDED, default_cache_dir, resolve_preset
    from models.store import embedded_gguf

    preset = resolve_preset("embedded")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=preset.target)
    parser.add_argument("--quantize", default=preset.target_quantize)
    parser.add_argument("--lengths", default=",".join(str(n) for n in LENGTHS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--llamacpp", type=Path, help="a llama-completion binary other than ./setup.sh --llamacpp's")
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    loaded = load_model(args.target, device="cpu", quantize=args.quantize, progress=False)
    lm = CachedModel(loaded.model)
    cache_dir = default_cache_dir()
    identity, _ = probe(cache_dir, lm, pair_key(LoadedPair(target=loaded, drafter=None, end_ids=())))
    text = "\n\n".join(path.read_text() for path in sorted(DOCS.glob("*.md")))
    ids = loaded.tokenizer(text)["input_ids"]
    if len(ids) < max(lengths) or max(lengths) >= lm.max_length:
        print(f"docs/ holds {len(ids)} tokens and the target {lm.max_length}: too few for the longest prompt asked",
              file=sys.stderr)
        return 1
    threads = torch.get_num_threads()
    executable = args.llamacpp or binary(cache_dir, "llamacpp", "")
    llamacpp = None
    if args.target in EMBEDDED and executable.is_file():
        gguf = embedded_gguf(EMBEDDED[args.target], cache_dir)
        llamacpp = lambda prompt: llamacpp_prompt_seconds(gguf, threads, executable,  # noqa: E731
                                                          str(loaded.tokenizer.decode(prompt)))
    seconds = measure(lm, ids, lengths, args.repeats, llamacpp)
    print(f"prefill of {loaded.label} to its first token, seconds; {identity.path}, {threads} threads")
    print(table(seconds, lengths))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        machine = {"threads": threads, "torch": torch.__version__, "path": str(identity.path)}
        args.json.write_text(json.dumps({"machine": machine, "target": loaded.label, "lengths": lengths,
                                         "seconds": seconds}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
