"""The accuracy gate beside llama.cpp's own figures: `llama-perplexity --kl-divergence` of the embedded target's
Q4_K_M GGUF against the same file dequantized to float32 (an F32 GGUF written once into the cache dir), and the
project's gguf format against its float32 reference, on the gate's text and in llama-perplexity's chunking.

    python -m benchmarks.kld [--json FILE]

llama-perplexity needs twice its context in tokens and scores the second half of each context only: on the gate's
1,025 tokens that is -c 512, two chunks (the first 1,024 tokens, each chunk fed afresh), each predicting its tokens
257..511 (from 0) from the ones before them, 510 predictions. The project's gguf is measured on those same
predictions, and on the whole text teacher-forced as the gate runs it (1,024 predictions). llama-perplexity is built
by ./setup.sh --llamacpp.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

CONTEXT = 512  # llama-perplexity's -c: the gate's 1,025 tokens hold two such chunks
_NUMBER = r"(-?[0-9.]+)"


@dataclass(frozen=True)
class Closeness:
    """A model against its reference on the same predictions."""

    positions: int
    top1: float  # share of positions where the two argmaxes agree
    kl: float  # mean KL(reference || model), nats
    perplexity: float
    reference_perplexity: float

    def row(self, name: str) -> str:
        change = self.perplexity / self.reference_perplexity - 1
        return (f"| {name} | {self.positions} | {self.top1:.2%} | {self.perplexity:.3f} vs "
                f"{self.reference_perplexity:.3f} ({change:+.2%}) | {self.kl:.5f} |")


def write_f32(source: Path, dest: Path) -> Path:
    """`source` with every tensor dequantized to float32 (gguf.quants, as transformers reads a GGUF), its metadata and
    tokenizer copied; written once to `dest` and kept."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, Keys, LlamaFileType
    from gguf.quants import dequantize

    if dest.is_file():
        return dest
    reader = GGUFReader(str(source))
    partial = dest.with_name(dest.name + ".partial")
    writer = GGUFWriter(str(partial), arch=str(reader.fields[Keys.General.ARCHITECTURE].contents()))
    for field in reader.fields.values():
        if field.name == Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer writes these itself
        value = int(LlamaFileType.ALL_F32) if field.name == Keys.General.FILE_TYPE else field.contents()
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub_type)
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}  # numpy order: (rows, cols)
    for tensor in reader.tensors:
        shape = shapes[tensor.name]
        writer.add_tensor_info(tensor.name, shape, np.dtype(np.float32), 4 * math.prod(shape), GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:  # one tensor in memory at a time
        writer.write_tensor_data(dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
                                 .reshape(shapes[tensor.name]))
    writer.close()
    partial.replace(dest)
    return dest


def parse_kld_log(log: str) -> Closeness:
    """llama-perplexity --kl-divergence's summary: chunks and context, 'Mean PPL(Q)', 'Mean PPL(base)', 'Mean KLD',
    'Same top p' (top-1 agreement, in %)."""
    found = [re.search(pattern, log) for pattern in (
        r"computing over (\d+) chunks, n_ctx=(\d+)", rf"Mean PPL\(Q\)\s*:\s*{_NUMBER}",
        rf"Mean PPL\(base\)\s*:\s*{_NUMBER}", rf"Mean\s+KLD:\s*{_NUMBER}", rf"Same top p:\s*{_NUMBER}")]
    chunks, ppl, ppl_base, kld, same = found
    if not (chunks and ppl and ppl_base and kld and same):
        raise ValueError("llama-perplexity printed no KL-divergence summary; its log ends: " + log.strip()[-300:])
    context = int(chunks.group(2))
    return Closeness(int(chunks.group(1)) * (context - 1 - context // 2), float(same.group(1)) / 100,
                     float(kld.group(1)), float(ppl.group(1)), float(ppl_base.group(1)))


def parse_perplexity_log(log: str) -> float:
    """llama-perplexity's 'Final estimate: PPL = X +/- Y'."""
    found = re.search(rf"Final estimate: PPL = {_NUMBER}", log)
    if found is None:
        raise ValueError("llama-perplexity printed no perplexity; its log ends: " + log.strip()[-300:])
    return float(found.group(1))


def read_base_logits(path: Path) -> tuple[list[int], torch.Tensor]:
    """A --kl-divergence-base file: the tokens llama.cpp evaluated, and the log-probabilities it scored, (positions,
    V) float32, as it stores them: per position a float scale and offset, then one uint16 per token; a token 16 nats
    or more below the top one reads as the offset."""
    raw = path.read_bytes()
    if raw[:8] != b"_logits_":
        raise ValueError(f"{path} is not a llama-perplexity --kl-divergence-base file")
    context, vocab, chunks = np.frombuffer(raw, np.int32, 3, 8)
    tokens = np.frombuffer(raw, np.int32, chunks * context, 20)
    row = 2 * ((vocab + 1) // 2) + 4  # uint16s per position
    stored = np.frombuffer(raw, np.uint16, offset=20 + 4 * tokens.size).reshape(-1, row)
    scale_offset = stored[:, :4].copy().view(np.float32)  # (positions, 2)
    log_probs = stored[:, 4:4 + vocab] * scale_offset[:, :1] + scale_offset[:, 1:]
    return tokens.tolist(), torch.from_numpy(log_probs.astype(np.float32))


def closeness_to_base(base_log_probs: torch.Tensor, logits: torch.Tensor, targets: list[int]) -> Closeness:
    """`logits` against llama.cpp's stored reference, as llama-perplexity computes it (tokens within 16 nats only)."""
    log_q = logits.double().log_softmax(-1)
    log_p = base_log_probs.double()
    kl = (log_p.exp() * (log_p - log_q)).where(log_p > -16, 0).sum(-1).mean()
    index = torch.tensor(targets)[:, None]
    return Closeness(len(targets), float((log_q.argmax(-1) == log_p.argmax(-1)).double().mean()), float(kl),
                     math.exp(-float(log_q.gather(1, index).mean())), math.exp(-float(log_p.gather(1, index).mean())))


def closeness(expected: torch.Tensor, logits: torch.Tensor, targets: list[int]) -> Closeness:
    from benchmarks.formats import kl_divergence

    index = torch.tensor(targets)
    return Closeness(len(targets), float((logits.argmax(-1) == expected.argmax(-1)).double().mean()),
                     kl_divergence(expected, logits),
                     math.exp(float(torch.nn.functional.cross_entropy(logits, index))),
                     math.exp(float(torch.nn.functional.cross_entropy(expected, index))))


def chunked(model, tokens: list[int], context: int = CONTEXT) -> torch.Tensor:
    """What llama-perplexity scores: each chunk of `context` tokens fed afresh, the logits of its second half but the
    last (each predicting the next token of its chunk)."""
    from benchmarks.accuracy import next_token_logits

    return torch.cat([next_token_logits(model, tokens[start:start + context])[context // 2:]
                      for start in range(0, len(tokens) - context + 1, context)])


def chunked_targets(tokens: list[int], context: int = CONTEXT) -> list[int]:
    return [t for start in range(0, len(tokens) - context + 1, context)
            for t in tokens[start + context // 2 + 1:start + context]]


def llama_perplexity(executable: Path, model: Path, text: Path, base: Path, threads: int, kld: bool) -> tuple[
        list[str], str, float]:
    """One llama-perplexity run: its command, its log, seconds (model load included)."""
    command = [str(executable), "-m", str(model), "-f", str(text), "-c", str(CONTEXT), "-t", str(threads),
               "--kl-divergence-base", str(base), *(["--kl-divergence"] if kld else [])]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, errors="replace", check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{executable.name} exited {done.returncode}: " + done.stderr.strip()[-300:])
    return command, done.stdout + done.stderr, time.perf_counter() - start


def main(argv: list[str]) -> int:
    from transformers import AutoModelForCausalLM

    import kernels
    from benchmarks.accuracy import next_token_logits
    from benchmarks.formats import TARGET, text_ids
    from benchmarks.llamacpp import version
    from models.devices import cpu_model
    from models.loading import load_model
    from models.presets import EMBEDDED, default_cache_dir
    from models.store import embedded_gguf

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    cache_dir, entry = default_cache_dir(), EMBEDDED[TARGET]
    executable = cache_dir / f"llama.cpp-{version()}" / "bin" / "llama-perplexity"
    if not executable.is_file():
        print(f"{executable} is not built: run ./setup.sh --llamacpp", file=sys.stderr)
        return 1
    threads, seconds = torch.get_num_threads(), {}
    start = time.perf_counter()
    ours = load_model(TARGET, device="cpu", quantize="gguf", progress=False)  # the format as the app loads it
    if ours.quantize != "gguf":
        print(f"the gguf format cannot run here ({kernels.unavailable()})", file=sys.stderr)
        return 1
    ids = text_ids(ours.tokenizer)
    seconds["load_our_gguf"] = time.perf_counter() - start
    start, gguf = time.perf_counter(), embedded_gguf(entry, cache_dir)
    f32 = write_f32(gguf, gguf.parent / f"{gguf.stem}-f32-{entry.sha256[:12]}.gguf")
    seconds["write_f32"] = time.perf_counter() - start  # nothing where it was written before
    with tempfile.TemporaryDirectory() as work:
        text, logits_file = Path(work) / "text.txt", Path(work) / "base.kld"
        text.write_text(str(ours.tokenizer.decode(ids)), encoding="utf-8")
        base_command, base_log, seconds["llamacpp_f32"] = llama_perplexity(executable, f32, text, logits_file,
                                                                           threads, kld=False)
        kld_command, kld_log, seconds["llamacpp_q4_k_m"] = llama_perplexity(executable, gguf, text, logits_file,
                                                                            threads, kld=True)
        tokens, base_log_probs = read_base_logits(logits_file)
    print(f"llama-perplexity: F32 {seconds['llamacpp_f32']:.0f} s, Q4_K_M {seconds['llamacpp_q4_k_m']:.0f} s",
          file=sys.stderr, flush=True)
    llama = parse_kld_log(kld_log)
    targets = chunked_targets(tokens)
    start = time.perf_counter()
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    with torch.inference_mode():
        expected_whole, expected = next_token_logits(reference.eval(), ids), chunked(reference, tokens)
    del reference
    gc.collect()
    seconds["our_float32_reference"] = time.perf_counter() - start
    references = closeness_to_base(base_log_probs, expected, targets)  # the two float32 references, one another
    start = time.perf_counter()
    with torch.inference_mode():
        ours_whole, ours_chunked = next_token_logits(ours.model, ids), chunked(ours.model, tokens)
    seconds["our_gguf"] = time.perf_counter() - start
    results = {"chunked": closeness(expected, ours_chunked, targets),
               "whole": closeness(expected_whole, ours_whole, ids[1:]), "llamacpp_q4_k_m": llama,
               "llamacpp_f32_vs_ours_float32": references}
    print(f"llama.cpp's tokens are the gate's first {len(tokens)}: {tokens == ids[:len(tokens)]}; its F32 "
          f"perplexity {parse_perplexity_log(base_log):.4f}; {kernels.isa()} kernels, {threads} threads")
    print("| model against its float32 reference | predictions | top-1 agreement | perplexity | mean KL |\n"
          "|---|---|---|---|---|")
    print(results["chunked"].row("our gguf, llama-perplexity's chunks"))
    print(llama.row("llama.cpp Q4_K_M (llama-perplexity)"))
    print(results["whole"].row("our gguf, the whole text (the gate)"))
    print(references.row("our float32 reference against llama.cpp's F32"))
    print("seconds: " + ", ".join(f"{name} {value:.0f}" for name, value in seconds.items()))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        record = {"machine": {"cpu": cpu_model(), "isa": kernels.isa(), "kernels_build": kernels.build_id(),
                              "cores": os.cpu_count(), "threads": threads, "torch": torch.__version__,
                              "llama_cpp": version()},
                  "text": {"tokens": len(ids), "llamacpp_tokens": len(tokens),
                           "llamacpp_tokens_match": tokens == ids[:len(tokens)], "context": CONTEXT},
                  "commands": [base_command, kld_command], "seconds": seconds,
                  "llamacpp_f32_perplexity": parse_perplexity_log(base_log),
                  "llamacpp_log_ends": {"f32": base_log[-3000:], "q4_k_m": kld_log[-6000:]},
                  **{name: asdict(value) for name, value in results.items()}}
        args.json.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
