"""A smaller causal LM as the drafter, with its own KV cache."""

from __future__ import annotations

import torch
from torch import Tensor

from sampling.drafters.base import Draft, Drafter, check_tree_size
from sampling.settings import check
from utils.logits_processor import LogitsProcessor
from utils.runner import CachedModel


class ModelDrafter(Drafter):
    """Drafts k tokens autoregressively from the same processor as the target (so q and p are comparable).

    Its cache is re-synced at the start of each proposal with `CachedModel.extend`: after a rejection it is cropped
    to the common prefix, after an all-accepted round the last draft and the bonus token are fed.

    Three ways to spend fewer drafter forwards on tokens the target will reject (none changes the output):
    `confidence`: stop drafting once the drafter's probability of its own token falls below it (HF's
    assistant_confidence_threshold); `adaptive`: HF's heuristic schedule, the draft length grows by 2 after an
    all-accepted round and shrinks by 1 otherwise, within [1, k]; `cumulative`: a cost model. One more draft token
    costs a drafter forward (c target steps) and is worth one token when it and every draft before it are accepted,
    which the drafter estimates as the product P of its probabilities of its tokens; it pays while P / c exceeds the
    tokens per target step the loop commits (r), so drafting stops once P < c * r: `cumulative` is that product.

    `alternatives` (greedy only): at each depth the drafter's next-best tokens ride along as leaves of a token tree,
    free on the drafter side (the same logits). Where the target rejects the chain's token at some depth but picks
    one of these, that depth still commits and the target's token after it comes too: one more token that round, for
    a wider verify forward (nearly free where the calibration measures it so). `max_tree`
    caps the draft, chain and alternatives together: where they would not fit, the alternatives kept are those the
    drafter rates likeliest to be committed (the probability it gives the chain before them times theirs).
    """

    name = "model"

    def __init__(self, lm: CachedModel, vocab_size: int, confidence: float = 0.0, adaptive: bool = False,
                 alternatives: int = 0, cumulative: float = 0.0, max_tree: int | None = None):
        confidence, cumulative = check("draft_confidence", confidence), check("draft_cumulative", cumulative)
        alternatives = check("draft_alternatives", alternatives)
        self.lm = lm
        # The target's output size: drafter logits are cut or padded to it (embedding sizes differ by padding;
        # that both share one tokenizer is checked when the pair is loaded).
        self.vocab_size = vocab_size
        self.confidence, self.adaptive, self.alternatives = confidence, adaptive, alternatives
        self.cumulative, self.max_tree = cumulative, check_tree_size(max_tree)
        self.draft_length: int | None = None  # the adaptive schedule's current length
        self.proposed = 0

    @property
    def models(self) -> list[CachedModel]:
        return [self.lm]

    @property
    def max_length(self) -> int:
        return self.lm.max_length

    def start(self, prompt_ids: list[int]) -> None:
        self.draft_length = None

    @torch.inference_mode()
    def propose(self, ids: list[int], k: int, processor: LogitsProcessor, generator: torch.Generator | None) -> Draft:
        if self.adaptive:
            self.draft_length = k if self.draft_length is None else min(self.draft_length, k)
            k = self.draft_length
        tokens, probs, leaves = [], [], []  # leaves: (estimated chance of commit, depth, token), greedy only
        forwards = self.lm.forwards
        whole = 1.0  # the drafter's estimate that every draft so far is accepted
        rated = self.confidence or self.cumulative or (self.alternatives and self.max_tree)
        logits = self.lm.extend(ids)  # (1, V_drafter)
        for i in range(k):
            logits = self._align(logits)
            if processor.is_greedy:
                # greedy verification never reads q: no softmax unless a stopping rule or the tree cap asks
                best = (logits.softmax(-1) if rated else logits)[0].topk(1 + self.alternatives)
                (token, *others), (p, *q) = best.indices.tolist(), best.values.tolist()
                p = p if rated else 1.0
                leaves += [(whole * q[j], i, leaf) for j, leaf in enumerate(others)]
            else:
                probs.append(processor.probs(logits))
                token = int(processor.sample(probs[-1], generator))
                p = float(probs[-1][0, token])
            tokens.append(token)
            whole *= p
            if i + 1 == k or p < self.confidence or whole < self.cumulative:
                break
            logits = self.lm.forward([token])
        self.proposed = len(tokens)
        if self.max_tree is not None:
            room = max(self.max_tree - len(tokens), 0)
            leaves = sorted(sorted(leaves, key=lambda leaf: -leaf[0])[:room], key=lambda leaf: leaf[1])
        if leaves:  # the chain first (token i follows i - 1), then each alternative beside the chain's token
            parents = list(range(-1, len(tokens) - 1)) + [depth - 1 for _, depth, _ in leaves]
            return Draft(tokens + [leaf for _, _, leaf in leaves], parents=parents,
                         forwards=self.lm.forwards - forwards)
        return Draft(tokens, q=torch.cat(probs) if probs else None, forwards=self.lm.forwards - forwards)

    def feedback(self, ids: list[int], accepted: int, target_logits: Tensor) -> None:
        if self.adaptive and self.draft_length is not None:
            grow = accepted == self.proposed
            self.draft_length = self.draft_length + 2 if grow else max(1, self.draft_length - 1)

    def _align(self, logits: Tensor) -> Tensor:
        """Drafter logits over the target's vocabulary: extra (padding) rows cut, missing ones -inf."""
        surplus = logits.shape[-1] - self.vocab_size
        if surplus > 0:
            return logits[..., : self.vocab_size]
        if surplus < 0:
            return torch.nn.functional.pad(logits, (0, -surplus), value=float("-inf"))
        return logits
