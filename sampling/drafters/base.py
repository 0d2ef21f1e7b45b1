"""The drafter interface: propose k tokens (with the probabilities they were sampled from, when there are any),
then hear back what the target committed."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import Tensor

from utils.logits_processor import LogitsProcessor


@dataclass
class Draft:
    tokens: list[int]
    q: Tensor | None = None  # (len(tokens), V) drafter probabilities; None: a deterministic draft (one-hot)

    def __len__(self) -> int:
        return len(self.tokens)


class Drafter(ABC):
    name: str
    forwards: int = 0  # model forward passes spent drafting (0 for drafters without a model)
    max_length: int = 1 << 31  # the longest context the drafter can take

    def start(self, prompt_ids: list[int]) -> None:
        """A new generation begins from `prompt_ids`."""

    @abstractmethod
    def propose(self, ids: list[int], k: int, processor: LogitsProcessor, generator: torch.Generator | None) -> Draft:
        """Up to `k` tokens that may follow the committed `ids`."""

    def feedback(self, ids: list[int], accepted: int, target_logits: Tensor) -> None:
        """The round committed: `ids` is now the whole committed sequence; `accepted` drafts were kept;
        `target_logits` (k+1, V) are the target's logits at the verified positions."""
