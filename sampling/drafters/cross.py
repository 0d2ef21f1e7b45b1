"""A draft model with another tokenizer than the target's: it drafts in its own tokens, which go to the target as
the target's tokens of the same text (HF's universal assisted decoding, vLLM's heterogeneous vocabularies)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from sampling.drafters.base import Draft, Drafter, chain_or_tree, trie
from sampling.drafters.model import ModelDrafter
from utils.logits_processor import LogitsProcessor

if TYPE_CHECKING:
    from models.retokenize import Retokenizer
    from utils.runner import CachedModel


@dataclass
class RetokenizedDraft(Draft):
    """A draft that reports the microseconds its round spent between the two tokenizers (`retokenize_us`)."""

    retokenize_us: int = field(default=0, kw_only=True)

    def extra(self, accepted: list[int]) -> dict[str, int]:
        return {"retokenize_us": self.retokenize_us}


class CrossVocabDrafter(Drafter):
    """`drafter` proposes in its own vocabulary after the committed text (`retokenizer.context`); each of its
    chains (one, or one per path of its tree of alternatives) becomes the target's tokens of the same text
    (`retokenizer.draft`), cut to `k`, the chains merged where they share a prefix. The draft carries no q: the
    target verifies it as one-hot, which keeps its distribution whatever the drafter proposes."""

    name = "model"

    def __init__(self, drafter: ModelDrafter, retokenizer: Retokenizer):
        self.inner, self.retokenizer = drafter, retokenizer

    @property
    def models(self) -> list[CachedModel]:
        return self.inner.models

    def start(self, prompt_ids: list[int]) -> None:
        self.inner.start(prompt_ids)

    def propose(self, ids: list[int], k: int, processor: LogitsProcessor, generator: torch.Generator | None) -> Draft:
        spent = self.retokenizer.seconds
        context = self.retokenizer.context(ids)
        tokens: list[int] = []
        parents: list[int] | None = None
        forwards = 0
        if len(context) + k <= self.inner.max_length:  # else its own context is full: the target steps alone
            own = self.inner.propose(context, k, processor, generator)
            chains = [[own.tokens[i] for i in own.path(leaf)] for leaf in _leaves(own)]
            drafts = [chain[:k] for chain in self.retokenizer.draft(ids, chains)]
            tokens, parents = trie(drafts, self.inner.max_tree)
            forwards = own.forwards
            self.inner.proposed = len(drafts[0]) if drafts else 0  # what its adaptive length hears back against
        return RetokenizedDraft(tokens, parents=chain_or_tree(parents), forwards=forwards,
                                retokenize_us=round((self.retokenizer.seconds - spent) * 1e6))

    def feedback(self, ids: list[int], accepted: int, target_logits: Tensor) -> None:
        self.inner.feedback(ids, accepted, target_logits)


def _leaves(draft: Draft) -> list[int]:
    """The draft's nodes that no other follows: the last token of a chain, each leaf of a tree."""
    if draft.parents is None:
        return [len(draft.tokens) - 1] if draft.tokens else []
    followed = set(draft.parents)
    return [i for i in range(len(draft.tokens)) if i not in followed]
