"""EAGLE: a one-layer head drafts from the target's own features, feature by feature (EAGLE-2's dynamic tree)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from sampling.drafters.base import Draft
from sampling.heads.drafting import HeadDrafter
from sampling.heads.networks import DraftHead, HeadCache
from utils.caching import common_prefix_length, tree_attention
from utils.logits_processor import LogitsProcessor
from utils.runner import CachedModel


class EagleDrafter(HeadDrafter):
    """Head position i reads (the target's feature at i, token i + 1) and predicts the feature at i + 1, whose
    logits (the target's output layer) give token i + 2. Committed positions carry the target's real features (the
    head's cache keeps them across rounds); a draft node carries the feature its parent predicted.

    Each depth feeds the `branch` best nodes of the last one in one head forward (tree attention over the head's
    cache) and gives each its `branch` likeliest children; drafting stops at depth `k` or once no node at the frontier
    is likelier than `cumulative` (the draft model's stopping rule, in the head's estimate).
    """

    name = "eagle"

    def __init__(self, target: CachedModel, head: DraftHead, branch: int = 4, max_tree: int | None = None,
                 cumulative: float = 0.0):
        super().__init__(target, head, branch, max_tree)
        if head.config.kind != "eagle":
            raise ValueError(f"the eagle drafter needs an eagle head, not a {head.config.kind} head")
        self.cumulative = cumulative
        self.cache = HeadCache()
        self.fed: list[int] = []  # the tokens of the head's cached (real) positions: ids[1:] of what it has read

    @torch.inference_mode()
    def propose(self, ids: list[int], k: int, processor: LogitsProcessor, generator: torch.Generator | None) -> Draft:
        features = self.features(ids)
        if features is None or k < 1:
            return Draft([])
        n, head = len(ids), self.head
        # 1. The head reads the committed positions it has not read (always the last one: its output is the draft's
        # first feature).
        reuse = min(common_prefix_length(self.fed, ids[1:]), n - 2, len(self.cache))
        self.cache.crop(reuse)
        fresh = n - 1 - reuse
        mask = torch.ones(fresh, n - 1, dtype=torch.bool, device=features.device)
        mask[:, reuse:] = mask[:, reuse:].tril()
        out = self._run(features[reuse:], ids[reuse + 1:], torch.arange(reuse, n - 1), mask)
        self.fed = ids[1:]
        # 2. Grow the tree depth by depth from the last position's predicted feature.
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        forwards = 1
        frontier = self._children(out[-1:], torch.zeros(1, dtype=torch.float64), [-1], tokens, parents, scores)
        columns: dict[int, int] = {}  # a fed node's column in the head's cache
        inputs = {node: out[-1] for node in frontier}  # the feature a node is read with: its parent's prediction
        for depth in range(2, k + 1):
            expand = sorted(frontier, key=lambda i: -scores[i])[: self.branch]
            if not expand or math.exp(scores[expand[0]]) < self.cumulative:
                break
            base = len(self.cache)
            mask = torch.zeros(len(expand), base + len(expand), dtype=torch.bool, device=features.device)
            mask[:, : n - 1] = True
            columns.update({node: base + row for row, node in enumerate(expand)})
            fed = list(columns)  # each row sees the fed nodes on its path: itself and its ancestors
            mask[:, [columns[node] for node in fed]] = tree_attention(parents)[0][expand][:, fed]
            feats = torch.stack([inputs[node] for node in expand])
            positions = torch.full((len(expand),), n - 2 + depth - 1, dtype=torch.long)
            out = self._run(feats, head.token_ids(torch.tensor([tokens[i] for i in expand])).tolist(), positions, mask)
            forwards += 1
            frontier = self._children(out, torch.tensor([scores[i] for i in expand], dtype=torch.float64), expand,
                                      tokens, parents, scores)
            inputs.update({child: out[expand.index(parents[child])] for child in frontier})
        self.cache.crop(n - 1)
        return self.tree(tokens, parents, scores, forwards)

    def _run(self, features: Tensor, token_ids: list[int], positions: Tensor, mask: Tensor) -> Tensor:
        """Head forward over rows (feature, token) at `positions`; their predicted features, (T, H)."""
        embeds = self.head.embeds(torch.tensor(token_ids, dtype=torch.long, device=features.device))
        out = self.head.module(features[None], embeds[None], positions.to(features.device), mask, self.cache)
        return out[0]

    def _children(self, feats: Tensor, base: Tensor, nodes: list[int], tokens: list[int], parents: list[int],
                  scores: list[float]) -> list[int]:
        """Each node's `branch` likeliest next tokens, appended as its children; their indices."""
        logp = self.head.logits(feats).log_softmax(-1).double() + base[:, None]
        top = logp.topk(min(self.branch, logp.shape[-1]), -1)
        children = []
        for node, values, indices in zip(nodes, top.values.tolist(), top.indices.tolist(), strict=True):
            for value, index in zip(values, indices, strict=True):
                children.append(len(tokens))
                tokens.append(index)
                parents.append(node)
                scores.append(value)
        return children
