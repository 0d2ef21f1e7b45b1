"""The embedded target in each candidate weight format: its forward cost for 1..14 new tokens on this machine, and the
accuracy gate against the dequantized GGUF in float32 (docs/formats.md has a run's figures).

    python -m benchmarks.formats timing [FORMAT ...]
    python -m benchmarks.formats accuracy [FORMAT ...]

Formats: float32, float32-prepacked, bfloat16, int8, int4 (the low-bit ones with bfloat16 activations), q4k (the
GGUF's own Q4_K tensors on the int4 kernel, bfloat16 activations there, the rest float32 prepacked), gguf (every
linear in the file's own blocks on the project's kernels, int8 activations per block, the rest float32), q8_0 (the
dense weights quantized to Q8_0 blocks at load, on the same kernels: what a dense model's `auto` may take),
gguf-compiled (gguf as the chat runs it: attention row by row, the whole forward compiled). The accuracy
text is the first 1,025 tokens of the project's prompt set, in order; the reference is read from the GGUF file the
embedded wheels carry (assembled into the cache dir once).
"""

from __future__ import annotations

import copy
import gc
import json
import sys

import torch
from transformers import AutoModelForCausalLM

from benchmarks.accuracy import Agreement, next_token_logits, perplexity
from benchmarks.names import DEFAULT_PROMPTS
from models import invariance
from models.formats import blocks, q4k
from models.formats.int4 import to_int4
from models.formats.int8 import to_int8
from models.formats.prepack import available as prepack_available
from models.formats.prepack import prepack, unpack
from models.loading import load_model
from models.presets import EMBEDDED, default_cache_dir
from models.store import embedded_gguf
from utils.runner import CachedModel
from utils.timing import time_forward

TARGET = "qwen2.5-coder-1.5b"
FORMATS = ("float32", "float32-prepacked", "bfloat16", "int8", "int4", "q4k", "gguf", "q8_0", "gguf-compiled")
TEXT_TOKENS = 1025
WIDTHS = (1, 2, 4, 8, 14)
PREFILL = 150  # a prompt's tokens


def text_ids(tokenizer) -> list[int]:
    ids: list[int] = []
    for line in DEFAULT_PROMPTS.read_text(encoding="utf-8").splitlines():
        for turn in json.loads(line)["turns"]:
            ids += tokenizer.encode(turn + "\n\n", add_special_tokens=False)
    return ids[:TEXT_TOKENS]


def build(base, name: str):
    # the loaded bfloat16 model is prepacked where oneDNN has native bf16: start from plain linears
    model = unpack(copy.deepcopy(base))
    if name == "bfloat16" and prepack_available(torch.bfloat16):
        prepack(model)  # as the app runs a bfloat16 target here
    elif name.startswith("float32"):
        model = model.float()
        if name == "float32-prepacked":
            prepack(model)
    elif name == "int8":
        to_int8(model)
    elif name == "int4":
        to_int4(model)
    elif name == "q4k":
        model = model.float()
        q4k.apply(model, embedded_gguf(EMBEDDED[TARGET], default_cache_dir()))
        prepack(model)
    elif name in ("gguf", "gguf-compiled"):
        model = model.float()
        blocks.apply(model, embedded_gguf(EMBEDDED[TARGET], default_cache_dir()))
    elif name == "q8_0":
        model = model.float()
        blocks.quantize_dense(model)
    elif name not in FORMATS:
        raise SystemExit(f"unknown format {name!r}; choose from {', '.join(FORMATS)}")
    return model.eval()


def cached(model, name: str) -> CachedModel:
    """`model` as `CachedModel` runs it; gguf-compiled: attention row by row and the whole forward compiled."""
    lm = CachedModel(model)
    if name == "gguf-compiled":
        invariance.apply(lm, invariance.TargetPath("rowwise", 1))
        lm.compile_whole()
        lm.adopt_compiled()
    return lm


def cached_logits(lm: CachedModel, ids: list[int], chunk: int = 256) -> torch.Tensor:
    """`next_token_logits` through `lm`'s own forward."""
    lm.reset()
    rows = [lm.forward(ids[start:min(start + chunk, len(ids) - 1)], logits_rows=min(chunk, len(ids) - 1 - start))
            for start in range(0, len(ids) - 1, chunk)]
    return torch.cat(rows)


def kl_divergence(reference: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean over positions of KL(reference || model) in nats, as llama-perplexity --kl-divergence reports it."""
    log_p, log_q = reference.double().log_softmax(-1), logits.double().log_softmax(-1)
    return float((log_p.exp() * (log_p - log_q)).sum(-1).mean())


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("timing", "accuracy"):
        print(__doc__, file=sys.stderr)
        return 2
    names = argv[1:] or list(FORMATS)
    base = load_model(TARGET, device="cpu", dtype="bfloat16", progress=False)  # the cache's own bf16 weights
    ids = text_ids(base.tokenizer)
    if argv[0] == "timing":
        for name in names:
            lm = cached(build(base.model, name), name)
            ms = {n: time_forward(lm, ids[:128], ids[128:128 + n], 3) * 1e3 for n in WIDTHS}
            prefill = time_forward(lm, ids[:1], ids[1:1 + PREFILL], 1)
            print(f"{name:18s} " + " ".join(f"{n}: {ms[n]:.0f} ms" for n in WIDTHS)
                  + f"  verify of 8: {ms[8] / ms[1]:.2f} steps  {PREFILL}-token prefill: {prefill:.2f} s", flush=True)
            del lm
            gc.collect()
        return 0
    gguf = embedded_gguf(EMBEDDED[TARGET], default_cache_dir())
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    with torch.inference_mode():
        expected = next_token_logits(reference.eval(), ids)
    del reference
    gc.collect()
    reference_perplexity = perplexity(expected, ids)
    for name in names:
        model = build(base.model, name)
        with torch.inference_mode():
            logits = (cached_logits(cached(model, name), ids) if name == "gguf-compiled"
                      else next_token_logits(model, ids))
        top1 = float((logits.argmax(-1) == expected.argmax(-1)).float().mean())
        agreement = Agreement(len(ids) - 1, top1, perplexity(logits, ids), reference_perplexity)
        print(f"{name:18s} {agreement.line()}; mean KL(reference || {name}) {kl_divergence(expected, logits):.5f}",
              flush=True)
        del model, logits
        gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
