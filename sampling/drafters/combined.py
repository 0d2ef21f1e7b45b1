"""The automatic drafter: copy from the context where the context predicts the answer, the draft model elsewhere."""

from __future__ import annotations

import torch
from torch import Tensor

from sampling.drafters.base import Draft, Drafter
from sampling.drafters.prompt_lookup import PromptLookupDrafter
from sampling.settings import check
from utils.logits_processor import LogitsProcessor
from utils.runner import CachedModel


class CombinedDrafter(Drafter):
    """Prompt lookup first (free to draft, up to the loop's k tokens); when it finds fewer than `min_copy` tokens,
    the draft model proposes up to `model_gamma` tokens instead."""

    name = "auto"

    def __init__(self, lookup: PromptLookupDrafter, model: Drafter, model_gamma: int = 4, min_copy: int = 2):
        self.lookup, self.model, self.model_gamma = lookup, model, check("gamma", model_gamma)
        self.min_copy = min_copy
        self.copied = 0  # rounds drafted by lookup
        self.last: Drafter = model

    @property
    def models(self) -> list[CachedModel]:
        return [*self.lookup.models, *self.model.models]

    @property
    def max_length(self) -> int:
        return self.model.max_length

    def start(self, prompt_ids: list[int]) -> None:
        self.lookup.start(prompt_ids)
        self.model.start(prompt_ids)

    def propose(self, ids: list[int], k: int, processor: LogitsProcessor, generator: torch.Generator | None) -> Draft:
        draft = self.lookup.propose(ids, k, processor, generator)
        if len(draft.line([])) >= self.min_copy:  # the latest copy (others may ride along as a tree)
            self.last, self.copied = self.lookup, self.copied + 1
            return draft
        self.last = self.model
        return self.model.propose(ids, min(k, self.model_gamma), processor, generator)

    def feedback(self, ids: list[int], accepted: int, target_logits: Tensor) -> None:
        self.last.feedback(ids, accepted, target_logits)
