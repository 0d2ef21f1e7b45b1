"""The drafter interface: propose k tokens (with the probabilities they were sampled from, when there are any),
then hear back what the target committed."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from utils.checks import integer
from utils.logits_processor import LogitsProcessor

if TYPE_CHECKING:
    from utils.runner import CachedModel


@dataclass
class Draft:
    """A chain of tokens, or a tree of them: with `parents`, token i follows token parents[i] (< i), or the last
    committed token for -1, and the target verifies every path at once (`CachedModel.extend_tree`). It also reports
    what proposing it cost (`forwards`) and, through `extra`, any counts of the drafter's own."""

    tokens: list[int]
    _: KW_ONLY
    q: Tensor | None = None  # (len(tokens), V) drafter probabilities; None: a deterministic draft (one-hot)
    parents: list[int] | None = None  # None: a chain, token i follows token i - 1
    kept: list[int] | None = None  # after `within` cut it: the proposed nodes that are left, in order
    forwards: int = 0  # model forward passes spent proposing it (0 for drafters without a model)

    def __post_init__(self):
        if self.parents is not None and (self.q is not None or len(self.parents) != len(self.tokens)):
            raise ValueError("a tree draft needs one parent per token and is deterministic (no q)")

    def __len__(self) -> int:
        return len(self.tokens)

    def within(self, depth: int) -> Draft:
        """Cut this draft, in place, to its nodes at most `depth` deep (a chain: its first `depth` tokens): the
        speculative loop does so where the context has no room for more, for every drafter. In place, so that the
        drafter that proposed it finds the target's logits of its own nodes through `row`."""
        depths: list[int] = []
        for parent in self.parents or range(-1, len(self.tokens) - 1):
            depths.append(depths[parent] + 1 if parent >= 0 else 1)
        keep = [i for i, d in enumerate(depths) if d <= depth]
        if len(keep) == len(self.tokens):
            return self
        new_index = {old: new for new, old in enumerate(keep)}  # a kept node's parent is shallower: kept too
        if self.parents is not None:
            self.parents = [new_index.get(self.parents[i], -1) for i in keep] if keep else None
        self.tokens = [self.tokens[i] for i in keep]
        self.q = self.q[: len(keep)] if self.q is not None else None
        self.kept = keep if self.kept is None else [self.kept[i] for i in keep]
        return self

    def row(self, node: int) -> int | None:
        """The row of the target's verify logits for proposed node `node` (row 0 is the last committed token's);
        None where `within` cut the node."""
        if self.kept is None:
            return node + 1
        return self.kept.index(node) + 1 if node in self.kept else None

    def path(self, last: int) -> list[int]:
        """Indices of the tokens from the root to token `last` (-1: none)."""
        if self.parents is None:
            return list(range(last + 1))
        path = []
        while last >= 0:
            path.append(last)
            last = self.parents[last]
        return path[::-1]

    def matching(self, truth: list[int]) -> int:
        """How many of its tokens greedy verification keeps where the target's next tokens are `truth` (the longest
        path that `truth` begins with)."""
        best, depth = 0, {-1: 0}
        for i, (token, parent) in enumerate(zip(self.tokens, self.parents or range(-1, len(self) - 1), strict=True)):
            if parent in depth and depth[parent] < len(truth) and token == truth[depth[parent]]:
                depth[i] = depth[parent] + 1
                best = max(best, depth[i])
        return best

    def extra(self, accepted: list[int]) -> dict[str, int]:
        """The drafter's own counts for a round that committed the drafts `accepted` (none for most drafters)."""
        return {}

    def line(self, path: list[int]) -> list[int]:
        """The tokens of the candidate that `path` belongs to: `path`, then first children down to a leaf."""
        if self.parents is None:
            return self.tokens
        nodes, last = list(path), path[-1] if path else -1
        while last in self.parents:
            last = self.parents.index(last)
            nodes.append(last)
        return [self.tokens[i] for i in nodes]


def chain_or_tree(parents: list[int] | None) -> list[int] | None:
    """A draft's `parents` as `Draft` takes them: None where they make a chain (token i follows token i - 1)."""
    return None if parents is None or parents == list(range(-1, len(parents) - 1)) else parents


def trie(chains: Iterable[list[int]], limit: int | None = None) -> tuple[list[int], list[int]]:
    """Token chains after the root merged into a tree where they share a prefix: (tokens, parents), nodes in the
    order the chains come; at most `limit` nodes (the chains that do not fit are cut there)."""
    tokens: list[int] = []
    parents: list[int] = []
    child: dict[tuple[int, int], int] = {}
    for chain in chains:
        if len(tokens) == limit:
            break
        node = -1
        for t in chain:
            if (node, t) not in child:
                if len(tokens) == limit:
                    break
                child[node, t] = len(tokens)
                tokens.append(t)
                parents.append(node)
            node = child[node, t]
    return tokens, parents


def check_tree_size(max_tree: int | None) -> int | None:
    """A drafter's cap on its draft's tokens (None: no cap)."""
    # The tree a verify forward takes besides the last committed token: verify_width - 1 (the settings bound that).
    return None if max_tree is None else integer("max_tree", max_tree, 1)


class Drafter(ABC):
    name: str

    @property
    def max_length(self) -> int:
        """The longest context the drafter can take (a model drafter: its model's)."""
        return 1 << 31

    @property
    def models(self) -> list[CachedModel]:
        """The cached models this drafter feeds (none for drafters without a model)."""
        return []

    def start(self, prompt_ids: list[int]) -> None:
        """A new generation begins from `prompt_ids`."""

    @abstractmethod
    def propose(self, ids: list[int], k: int, processor: LogitsProcessor, generator: torch.Generator | None) -> Draft:
        """Up to `k` tokens that may follow the committed `ids`."""

    def feedback(self, ids: list[int], accepted: int, target_logits: Tensor) -> None:
        """The round committed: `ids` is now the whole committed sequence; `accepted` drafts were kept;
        `target_logits` (k+1, V) are the target's logits at the verified positions (a tree: its root, then each
        token, whether it was accepted or not)."""
