"""Lookahead decoding (Fu et al., ICML 2024): training-free drafts from a Jacobi window that the target refines in
the same forward that verifies n-grams from a pool; lossless, one drafter of the speculative loop.

THE WINDOW has N-1 rows of W tokens. Row 0 is the last committed token followed by W-1 guesses, a chain; token j of
row l >= 1 follows token j of row l-1. So the token in row l, column j guesses the position j + l after the last
committed token, and each column reads as N-1 consecutive tokens. Every forward, the target's argmax after the top
row extends each column by one token: W new N-grams for the pool. Then the window advances one Jacobi step, however
many tokens were committed (as the reference implementation does by default): the oldest row leaves, the new tokens
become the top row, and column 0 of the new row 0 becomes the last committed token. Until the window has all its
rows (N-2 warm-up steps) it grows by one row per step instead, and its columns move one position left (the last
column gets a random prompt token).

THE POOL is the n-gram drafter's online NGramStore (order N, with back-off): seeded from the prompt, fed every
committed token and the window's N-grams. Its G best continuations of up to N-1 tokens are the candidates.

THE DRAFT is one token tree rooted at the last committed token: the candidates (merged where they share a prefix),
then the window (row 0 a chain from the root, each column of rows 1.. hanging from its row-0 token). A node's
position is its depth and it sees only its ancestors, which gives the paper's attention mask. Every path is
verified; the window's own guesses are candidates too, for free, since the target computes their rows anyway.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from torch import Tensor

from sampling.drafters.base import Draft, trie
from sampling.drafters.ngram import NGramDrafter
from sampling.settings import check
from utils.logits_processor import LogitsProcessor


@dataclass
class LookaheadDraft(Draft):
    """A lookahead draft remembers the pool's candidates in it, to count the drafts accepted from the pool."""

    candidates: list[list[int]] = field(default_factory=list, kw_only=True)

    def extra(self, accepted: list[int]) -> dict[str, int]:
        """`pool_hits`: accepted drafts that a pool candidate proposed (rather than the Jacobi window alone)."""
        hit = bool(accepted) and any(c[:len(accepted)] == accepted for c in self.candidates)
        return {"pool_hits": len(accepted) if hit else 0}


class LookaheadDrafter(NGramDrafter):
    """Window size W, n-gram size N, at most G verification candidates from the pool."""

    name = "lookahead"

    def __init__(self, window: int = 2, ngram: int = 3, candidates: int = 1, reset_each_prompt: bool = True):
        window, ngram = check("lookahead_window", window), check("lookahead_ngram", ngram)
        candidates = check("lookahead_candidates", candidates)
        super().__init__(ngram, "basic", reset_each_prompt=reset_each_prompt)
        self.window, self.ngram, self.num_candidates = window, ngram, candidates
        self.rows: list[list[int]] = []
        self.draft: Draft | None = None  # the last one proposed
        self.top_nodes: list[int] | None = None  # its nodes of the window's top row (None: no window drafted)
        self.fill_from, self.random = [0], random.Random(0)

    def start(self, prompt_ids: list[int]) -> None:
        super().start(prompt_ids)
        self.fill_from, self.random = list(prompt_ids), random.Random(0)
        self.rows = [[prompt_ids[-1]] + [self._filler() for _ in range(self.window - 1)]]

    def propose(self, ids: list[int], k: int, processor: LogitsProcessor, generator: torch.Generator | None) -> Draft:
        if k == 0:  # the budget takes only the target's own token
            self.top_nodes = None
            return LookaheadDraft([])
        candidates = self.store.continuations(ids, min(k, self.ngram - 1), self.num_candidates)
        tokens, parents = trie(candidates)
        self.rows[0][0] = ids[-1]
        node = {(0, 0): -1}  # (row, column) -> tree node; row 0's column 0 is the root
        for level, row in enumerate(self.rows):
            for j in range(1 if level == 0 else 0, self.window):
                node[level, j] = len(tokens)
                parents.append(node[level, j - 1] if level == 0 else node[level - 1, j])
                tokens.append(row[j])
        self.top_nodes = [node[len(self.rows) - 1, j] for j in range(self.window)]
        self.draft = LookaheadDraft(tokens, parents=parents, candidates=candidates)
        return self.draft

    def feedback(self, ids: list[int], accepted: int, target_logits: Tensor) -> None:
        super().feedback(ids, accepted, target_logits)  # the committed tokens go into the pool
        if self.top_nodes is None:
            return
        assert self.draft is not None  # proposed with its top_nodes
        logit_rows = [self.draft.row(node) for node in self.top_nodes]
        best = iter(target_logits[[row for row in logit_rows if row is not None]].argmax(-1).tolist())
        # (W,) one Jacobi step; a column the loop cut (no room left in the context) gets a filler instead
        new = [next(best) if row is not None else self._filler() for row in logit_rows]
        rows = self.rows + [new]
        if len(rows) > self.ngram - 1:  # a full window: each column with its new token is an N-gram
            for j in range(self.window):
                self.store.add([row[j] for row in rows])
            rows = rows[1:]
        else:
            rows = [row[1:] + [self._filler()] for row in rows]
        rows[0][0] = ids[-1]
        self.rows = rows

    def _filler(self) -> int:
        return self.random.choice(self.fill_from)

