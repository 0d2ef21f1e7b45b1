"""An n-gram store learned online, and the drafter that proposes from it (n-gram assisted speculative decoding).

The store maps a context (the last 1..n-1 tokens) to counts of the tokens that followed it. It is seeded from the
prompt, updated with every committed token, and optionally with the target's top-k predictions ("filler") at the
positions it verified. A draft is a chain of lookups, each backing off from the longest known context to shorter ones.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor

from sampling.drafters.base import Draft, Drafter
from sampling.settings import check
from utils.logits_processor import LogitsProcessor

FILLER_WEIGHT = 0.25  # a target prediction counts less than a token that was actually committed


class NGramStore:
    """`kind="basic"`: every order from n-1 down to 1 with back-off; `"one-level"`: only contexts of n-1 tokens."""

    def __init__(self, n: int = 3, kind: str = "basic"):
        check("ngram_kind", kind)
        self.n, self.kind = check("ngram_n", n), kind
        self.orders = list(range(self.n - 1, 0, -1)) if kind == "basic" else [self.n - 1]
        self.counts: dict[tuple[int, ...], dict[int, float]] = defaultdict(lambda: defaultdict(float))

    def __len__(self) -> int:
        return len(self.counts)

    def add(self, tokens: list[int], start: int = 1, weight: float = 1.0) -> None:
        """Record the continuation of every context that ends just before positions `start`..len(tokens)-1."""
        for i in range(max(start, 1), len(tokens)):
            for order in self.orders:
                if i >= order:
                    self.counts[tuple(tokens[i - order:i])][tokens[i]] += weight

    def add_continuations(self, context: list[int], tokens: list[int], weight: float) -> None:
        for order in self.orders:
            if len(context) >= order:
                followers = self.counts[tuple(context[len(context) - order:])]
                for t in tokens:
                    followers[t] += weight

    def followers(self, context: list[int]) -> dict[int, float]:
        """The counts of what followed the longest known suffix of `context` (empty if none is known)."""
        for order in self.orders:
            if len(context) >= order:
                followers = self.counts.get(tuple(context[len(context) - order:]))
                if followers:
                    return followers
        return {}

    def next_token(self, context: list[int]) -> int | None:
        """The most frequent follower of the longest known suffix of `context` (ties: the earliest seen)."""
        followers = self.followers(context)
        return max(followers, key=followers.__getitem__) if followers else None

    def chain(self, context: list[int], k: int) -> list[int]:
        context, out = list(context[-(self.n - 1):]), []
        for _ in range(k):
            token = self.next_token(context)
            if token is None:
                break
            out.append(token)
            context = context[1:] + [token] if len(context) == self.n - 1 else context + [token]
        return out

    def continuations(self, context: list[int], k: int, count: int) -> list[list[int]]:
        """Up to `count` different chains of up to `k` tokens: a beam search over the store, each chain scored by the
        product of its tokens' frequencies among their followers. `count=1` gives `chain(context, k)`."""
        context = list(context[-(self.n - 1):])
        beams: list[tuple[float, list[int]]] = [(1.0, [])]
        for _ in range(k):
            grown = []
            for score, chain in beams:
                followers = self.followers(context + chain)
                total = sum(followers.values())
                ranked = sorted(followers.items(), key=lambda item: -item[1])[:count]  # stable: ties earliest seen
                grown += [(score * c / total, chain + [t]) for t, c in ranked] or [(score, chain)]
            beams = sorted(grown, key=lambda beam: -beam[0])[:count]
        return [chain for _, chain in beams if chain]


class NGramDrafter(Drafter):
    """Deterministic drafts from an online n-gram store (no q: verified as one-hot drafts)."""

    name = "ngram"

    def __init__(self, n: int = 3, kind: str = "basic", filler_top_k: int = 0, reset_each_prompt: bool = True):
        filler_top_k = check("ngram_filler_top_k", filler_top_k)
        self.store = NGramStore(n, kind)
        self.filler_top_k, self.reset_each_prompt = filler_top_k, reset_each_prompt
        self.seen = 0  # committed tokens already added to the store

    def start(self, prompt_ids: list[int]) -> None:
        if self.reset_each_prompt:
            self.store = NGramStore(self.store.n, self.store.kind)
        self.store.add(prompt_ids)
        self.seen = len(prompt_ids)

    def propose(self, ids: list[int], k: int, processor: LogitsProcessor, generator: torch.Generator | None) -> Draft:
        return Draft(self.store.chain(ids, k))

    def feedback(self, ids: list[int], accepted: int, target_logits: Tensor) -> None:
        self.store.add(ids, start=self.seen)
        if self.filler_top_k:
            # The target's top-k at each committed position it verified become weak continuations of that context.
            top = target_logits[: accepted + 1].topk(self.filler_top_k, dim=-1).indices.tolist()
            end = self.seen  # the context of verified position i ends just before ids[end + i]
            for i, tokens in enumerate(top):
                context = ids[max(0, end + i - self.store.n + 1): end + i]
                self.store.add_continuations(context, tokens, FILLER_WEIGHT)
        self.seen = len(ids)
