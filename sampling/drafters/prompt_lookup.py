"""Prompt lookup: find the last n tokens earlier in the context and propose what followed them there."""

from __future__ import annotations

from itertools import chain

import torch

from sampling.drafters.base import Draft, Drafter, check_tree_size, trie
from utils.logits_processor import LogitsProcessor


class PromptLookupDrafter(Drafter):
    """Tries n-gram sizes from `max_ngram` down to `min_ngram`; the most recent earlier match wins.

    An index from each n-gram to the ends of its occurrences is kept incrementally, so a proposal costs O(max_ngram)
    lookups instead of a scan of the context.

    `max_tree`: where the winning copy leaves room in a draft of that many tokens, what followed the n-gram's other
    occurrences (the most recent first), then shorter n-grams', ride along as a token tree: copies that share a
    beginning share its tokens, and the first token where they part is a second guess at that position.
    """

    name = "lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_tree: int | None = None):
        if int(min_ngram) != min_ngram or min_ngram < 1 or max_ngram < min_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.sizes = range(int(max_ngram), int(min_ngram) - 1, -1)
        self.max_tree = check_tree_size(max_tree)
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> where its occurrences end, oldest first
        self.indexed = 0  # the n-grams that end before this position (each with a next token) are indexed

    def start(self, prompt_ids: list[int]) -> None:
        self.ends, self.indexed = {}, 0

    def propose(self, ids: list[int], k: int, processor: LogitsProcessor, generator: torch.Generator | None) -> Draft:
        self._index(ids)
        copies = (ids[end:end + k] for size in self.sizes if len(ids) > size
                  for end in reversed(self.ends.get(tuple(ids[-size:]), ())))
        first = next(copies, [])
        if self.max_tree is None or self.max_tree <= len(first):
            return Draft(first)
        tokens, parents = trie(chain([first], copies), self.max_tree)  # the first copy is its first nodes
        return Draft(tokens, parents=parents if len(tokens) > len(first) else None)

    def _index(self, ids: list[int]) -> None:
        """Index the n-grams not indexed yet that are followed by a token."""
        for end in range(self.indexed + 1, len(ids)):
            for size in self.sizes:
                if end >= size:
                    self.ends.setdefault(tuple(ids[end - size:end]), []).append(end)
        self.indexed = max(len(ids) - 1, 0)
