"""Medusa: heads on the target's last feature, head j guessing the token j + 1 places after the next one."""

from __future__ import annotations

import torch

from sampling.drafters.base import Draft
from sampling.heads.drafting import HeadDrafter
from sampling.heads.networks import DraftHead
from utils.logits_processor import LogitsProcessor
from utils.runner import CachedModel


class MedusaDrafter(HeadDrafter):
    """From the target's feature at the position before the last committed token (whose logits chose it), each head
    rates the token at its own depth, independently of the tokens before it: the candidates are every path through
    the heads' `branch` best tokens, scored by the product of their probabilities, the best `max_tree` kept."""

    name = "medusa"

    def __init__(self, target: CachedModel, head: DraftHead, branch: int = 4, max_tree: int | None = None):
        super().__init__(target, head, branch, max_tree)
        if head.config.kind != "medusa":
            raise ValueError(f"the medusa drafter needs a medusa head, not a {head.config.kind} head")

    @torch.inference_mode()
    def propose(self, ids: list[int], k: int, processor: LogitsProcessor, generator: torch.Generator | None) -> Draft:
        features = self.features(ids)
        if features is None or k < 1:
            return Draft([])
        outputs = self.head.module(features[-1:])[: k]
        own = self.head.config.own_lm_head
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        frontier = [(-1, 0.0)]
        for out in outputs:  # depth by depth: every kept node of the last depth times this head's best tokens
            logp = (out.float() if own else self.head.logits(out))[0].log_softmax(-1)
            top = logp.topk(min(self.branch, logp.shape[-1]))
            nodes = []
            for parent, score in frontier:
                for value, index in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                    nodes.append((len(tokens), score + value))
                    tokens.append(index)
                    parents.append(parent)
                    scores.append(score + value)
            # only the nodes that can still be among the best max_tree grow further
            frontier = sorted(nodes, key=lambda node: -node[1])[: self.max_tree or len(nodes)]
        return self.tree(tokens, parents, scores, forwards=1)
