"""Phrase drafter: where the committed tokens end like a stretch of a known phrase, propose the rest of that phrase.

The worked example of docs/design.md's "Add your own drafter". The phrases are token sequences given up front: a
project's boilerplate, a license header, an API's usual call chains, stock sentences of a support chat. Like prompt
lookup, but the text copied from comes from a fixed list instead of the context.
"""

from __future__ import annotations

import torch

from sampling.drafters.base import Draft, Drafter
from utils.logits_processor import LogitsProcessor


class PhraseDrafter(Drafter):
    """Finds the longest match (at least `min_match` tokens) between the end of the committed tokens and a stretch of
    one of `phrases`, and drafts the tokens that follow that stretch in the phrase. No model: no q, so the loop
    verifies the draft as one-hot, which is lossless greedy and sampled alike."""

    name = "phrases"

    def __init__(self, phrases: list[list[int]], min_match: int = 2):
        if int(min_match) != min_match or min_match < 1:
            raise ValueError(f"min_match must be a whole number of tokens >= 1, got {min_match}")
        self.phrases = [list(phrase) for phrase in phrases]
        self.min_match = int(min_match)

    def propose(self, ids: list[int], k: int, processor: LogitsProcessor, generator: torch.Generator | None) -> Draft:
        best, longest = [], self.min_match - 1
        for phrase in self.phrases:
            for end in range(1, len(phrase)):  # the match ends at phrase[end - 1]; phrase[end:] may follow
                length = matching_tail(ids, phrase[:end])
                if length > longest:
                    best, longest = phrase[end:end + k], length
        return Draft(best)  # empty where nothing matches: the round is then a plain target step


def matching_tail(a: list[int], b: list[int]) -> int:
    """How many tokens at the end of `a` equal those at the end of `b`."""
    length = 0
    while length < min(len(a), len(b)) and a[-1 - length] == b[-1 - length]:
        length += 1
    return length
