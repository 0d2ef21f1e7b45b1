"""The accuracy gate for a lossy target format: teacher-forced on a fixed text, how often the format's next-token
argmax agrees with the reference model's, and both perplexities.

A quantized target is still the target only if it predicts as the reference does: the gate asks for top-1
agreement >= 99% and perplexity within 1% on at least 1,000 tokens (docs/formats.md has the figures per format).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MIN_AGREEMENT = 0.99
MAX_PERPLEXITY_CHANGE = 0.01


@dataclass(frozen=True)
class Agreement:
    tokens: int  # positions compared (each predicts the next token of the text)
    top1: float  # share of positions where the two argmaxes agree
    perplexity: float  # of the model on the text
    reference_perplexity: float

    @property
    def perplexity_change(self) -> float:
        return self.perplexity / self.reference_perplexity - 1

    @property
    def passes(self) -> bool:
        return self.top1 >= MIN_AGREEMENT and abs(self.perplexity_change) <= MAX_PERPLEXITY_CHANGE

    def line(self) -> str:
        verdict = "passes" if self.passes else "fails"
        return (f"top-1 agreement {self.top1:.2%} over {self.tokens} tokens, perplexity {self.perplexity:.3f} vs "
                f"{self.reference_perplexity:.3f} ({self.perplexity_change:+.2%}): {verdict} the gate")


@torch.inference_mode()
def next_token_logits(model, ids: list[int], chunk: int = 256) -> torch.Tensor:
    """(len(ids) - 1, V) float32 logits predicting ids[1:], fed in chunks through one cache (bounded memory)."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    cache, rows = DynamicCache(config=model.config), []
    for start in range(0, len(ids) - 1, chunk):
        piece = torch.tensor([ids[start:min(start + chunk, len(ids) - 1)]], device=device)
        positions = torch.arange(start, start + piece.shape[1], device=device)[None]
        out = model(input_ids=piece, position_ids=positions, past_key_values=cache, use_cache=True)
        rows.append(out.logits[0].float())
    return torch.cat(rows)


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    targets = torch.tensor(ids[1:], device=logits.device)
    return math.exp(float(torch.nn.functional.cross_entropy(logits, targets)))


def compare(model, reference, ids: list[int]) -> Agreement:
    """`model` against `reference` on the text `ids` (teacher-forced: both see the text, not their own outputs)."""
    if len(ids) < 2:
        raise ValueError("the accuracy text needs at least 2 tokens")
    ours, theirs = next_token_logits(model, ids), next_token_logits(reference, ids)
    top1 = float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())
    return Agreement(len(ids) - 1, top1, perplexity(ours, ids), perplexity(theirs, ids))
