"""What the trained-head drafters (EAGLE, Medusa) share: the target's features, and the draft tree they keep.

Both read the target's last hidden state of every committed token but the last (`CachedModel.hidden`: the verify
forward that already runs computes them, and the cache helpers keep them row for row through rollback). The first
round of a prompt has no features for it yet: it drafts nothing, and its verify forward, the prefill, makes them.

Candidates come with a score, the head's log-probability of the whole path to them; the draft keeps the `max_tree`
best (a child scores no higher than its parent, so the kept nodes form a tree), as EAGLE-2 and Medusa's pruned
trees do. A tree of one branch per depth is a chain. Every draft is deterministic: verified by the target's rules for
one-hot drafts (sampling included), it never changes the output distribution.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sampling.drafters.base import Draft, Drafter, chain_or_tree, check_tree_size
from sampling.heads.networks import DraftHead
from sampling.settings import check
from utils.caching import common_prefix_length
from utils.runner import CachedModel


class HeadDrafter(Drafter):
    def __init__(self, target: CachedModel, head: DraftHead, branch: int = 4, max_tree: int | None = None):
        self.target, self.head, self.branch = target, head, check("head_branch", branch)
        self.max_tree = check_tree_size(max_tree)
        target.keep_hidden()

    @property
    def max_length(self) -> int:
        return self.target.max_length

    def features(self, ids: list[int]) -> Tensor | None:
        """(len(ids) - 1, H): the target's feature at every committed position but the last; None where the target
        has not seen them all (a new prompt)."""
        need = len(ids) - 1
        if need < 1 or common_prefix_length(self.target.tokens, ids) < need:
            return None
        return self.target.hidden[:need].to(self.head.dtype)

    def tree(self, tokens: list[int], parents: list[int], scores: list[float], forwards: int) -> Draft:
        """The best `max_tree` candidates (draft-vocabulary indices) as a draft of token ids, proposed in `forwards`
        head forwards."""
        order = sorted(range(len(tokens)), key=lambda i: (-scores[i], i))[: self.max_tree]
        kept = sorted(order)  # a parent comes before its children
        new = {old: i for i, old in enumerate(kept)}
        ids = self.head.token_ids(torch.tensor([tokens[i] for i in kept], dtype=torch.long,
                                               device=self.head.out.device)).tolist()
        tree_parents = [new[parents[i]] if parents[i] >= 0 else -1 for i in kept]
        return Draft(ids, parents=chain_or_tree(tree_parents), forwards=forwards)
