"""A smaller causal LM as the drafter, with its own KV cache."""

from __future__ import annotations

import torch
from torch import Tensor

from sampling.drafters.base import Draft, Drafter
from utils.caching import CachedModel
from utils.logits_processor import LogitsProcessor


class ModelDrafter(Drafter):
    """Drafts k tokens autoregressively from the same processor as the target (so q and p are comparable).

    Its cache is re-synced at the start of each proposal with `CachedModel.extend`: after a rejection it is cropped
    to the common prefix, after an all-accepted round the last draft and the bonus token are fed.
    """

    name = "model"

    def __init__(self, lm: CachedModel, vocab_size: int):
        self.lm = lm
        # The target's output size: drafter logits are cut or padded to it (embedding sizes differ by padding;
        # that both share one tokenizer is checked when the pair is loaded).
        self.vocab_size = vocab_size

    @property
    def forwards(self) -> int:
        return self.lm.forwards

    @property
    def max_length(self) -> int:
        return self.lm.max_length

    def propose(self, ids: list[int], k: int, processor: LogitsProcessor, generator: torch.Generator | None) -> Draft:
        tokens, probs = [], []
        logits = self.lm.extend(ids)  # (1, V_drafter)
        for i in range(k):
            logits = self._align(logits)
            if processor.is_greedy:
                token = int(logits.argmax(-1))  # greedy verification never reads q: no softmax
            else:
                probs.append(processor.probs(logits))
                token = int(processor.sample(probs[-1], generator))
            tokens.append(token)
            if i + 1 < k:
                logits = self.lm.forward([token])
        return Draft(tokens, torch.cat(probs) if probs else None)

    def _align(self, logits: Tensor) -> Tensor:
        """Drafter logits over the target's vocabulary: extra (padding) rows cut, missing ones -inf."""
        surplus = logits.shape[-1] - self.vocab_size
        if surplus > 0:
            return logits[..., : self.vocab_size]
        if surplus < 0:
            return torch.nn.functional.pad(logits, (0, -surplus), value=float("-inf"))
        return logits
