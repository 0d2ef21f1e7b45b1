"""llama.cpp's plain decoding of the target's own GGUF, timed once on this machine: the speed a CPU user already has,
which the chat's comparison names beside its own (where `./setup.sh --llamacpp` built llama.cpp and the target is an
embedded model). Kept with the calibration, under a key of this machine, threads, llama.cpp's version and the file.
The runner is handed in (`Contestant`): the app does not lean on the benchmark's package."""

from __future__ import annotations

import datetime
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from app.calibration import key_file, machine_key, write_record

if TYPE_CHECKING:
    from sampling.base import DecodeConfig, Result


class Contestant(Protocol):
    """llama.cpp's plain decoding of one GGUF, on PROMPT (benchmarks.llamacpp makes one: `infer.py` hands it in)."""

    target_name: str
    version: str
    build: str  # "" where llama.cpp was built for this CPU, else the instruction set it was built for ("avx2")
    gguf: str

    def run(self, config: DecodeConfig) -> Result: ...

SCHEMA = 2
PROMPT = "Write a Python function that tells whether a number is prime, and explain how it works."
NEW_TOKENS = 96  # as many as the benchmark's turns
RUNS = 2


@dataclass(frozen=True)
class Yardstick:
    tokens_per_second: float  # new tokens over prompt evaluation and generation, llama.cpp's own times (as ours)
    tokens: int
    threads: int
    measured: str  # when, ISO 8601
    build: str = ""  # the instruction set it was built for where not this CPU's best ("avx2": --kernels avx2)

    def line(self) -> str:
        build = f" (its {self.build.upper()} build)" if self.build else ""
        return (f"llama.cpp{build}, plain decoding of the same GGUF, timed on this machine ({self.threads} threads, "
                f"{self.tokens} tokens, {self.measured[:10]}): {self.tokens_per_second:.1f} tok/s")

    def versus(self, tokens_per_second: float) -> str:
        """`line`, and a rate as a share of it."""
        return f"{self.line()}; the fastest here: {tokens_per_second / self.tokens_per_second:.2f}× of it"


def yardstick(cache_dir: Path, llamacpp: Contestant, again: bool = False) -> tuple[Yardstick | None, bool]:
    """The kept timing for this machine and `llamacpp`'s binary and file, or one made now (seconds, with `llamacpp.run`
    on PROMPT) and kept; True when made now. None where llama.cpp fails (the chat goes on without it)."""
    import torch

    from sampling.base import DecodeConfig

    key = {**machine_key(llamacpp.target_name, "gguf", None, None, torch.device("cpu")), "llamacpp": llamacpp.version,
           "gguf": llamacpp.gguf, "new_tokens": NEW_TOKENS}
    path = key_file(cache_dir, key, "llamacpp")
    if not again:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("schema") == SCHEMA and data.get("key") == key:
                return Yardstick(**data["yardstick"]), False
        except (OSError, ValueError, KeyError, TypeError):
            pass
    try:  # the faster of two runs, as a timing of ours takes the best of its repeats
        runs = [llamacpp.run(DecodeConfig(max_new_tokens=NEW_TOKENS)) for _ in range(RUNS)]
    except (OSError, RuntimeError, ValueError):  # a binary that does not run here: no yardstick, no error
        return None, False
    best = max(runs, key=lambda result: result.stats.tokens_per_second)
    made = Yardstick(round(best.stats.tokens_per_second, 2), best.stats.new_tokens, torch.get_num_threads(),
                     datetime.datetime.now().astimezone().isoformat(timespec="seconds"), llamacpp.build)
    try:
        write_record(path, {"schema": SCHEMA, "key": key, "yardstick": asdict(made)})
    except OSError:  # a read-only cache dir: it still serves this run
        pass
    return made, True
