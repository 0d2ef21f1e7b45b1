"""Prompt lookup: find the last n tokens earlier in the context and propose what followed them there."""

from __future__ import annotations

import torch

from sampling.drafters.base import Draft, Drafter
from utils.logits_processor import LogitsProcessor


class PromptLookupDrafter(Drafter):
    """Tries n-gram sizes from `max_ngram` down to `min_ngram`; the most recent earlier match wins.

    An index from each n-gram to the end of its latest occurrence is kept incrementally, so a proposal costs
    O(max_ngram) lookups instead of a scan of the context.
    """

    name = "lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if int(min_ngram) != min_ngram or min_ngram < 1 or max_ngram < min_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.sizes = range(int(max_ngram), int(min_ngram) - 1, -1)
        self.latest: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # the n-grams that end before this position (each with a next token) are indexed

    def start(self, prompt_ids: list[int]) -> None:
        self.latest, self.indexed = {}, 0

    def propose(self, ids: list[int], k: int, processor: LogitsProcessor, generator: torch.Generator | None) -> Draft:
        self._index(ids)
        for size in self.sizes:
            end = self.latest.get(tuple(ids[-size:])) if len(ids) > size else None
            if end is not None:
                return Draft(ids[end:end + k])
        return Draft([])

    def _index(self, ids: list[int]) -> None:
        """Index the n-grams not indexed yet that are followed by a token."""
        for end in range(self.indexed + 1, len(ids)):
            for size in self.sizes:
                if end >= size:
                    self.latest[tuple(ids[end - size:end])] = end
        self.indexed = max(len(ids) - 1, 0)
