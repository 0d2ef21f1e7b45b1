"""The automatic drafter: copy from the context where the context predicts the answer, from the session's earlier
text where it holds a long enough match, the draft model elsewhere."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sampling.drafters.base import Draft, Drafter, chain_or_tree
from sampling.drafters.prompt_lookup import PromptLookupDrafter
from sampling.drafters.session import SessionText
from sampling.settings import check
from utils.logits_processor import LogitsProcessor
from utils.runner import CachedModel


@dataclass
class SessionDraft(Draft):
    """A round drafted from the session's earlier text: it counts its rounds and the drafts accepted."""

    def extra(self, accepted: list[int]) -> dict[str, int]:
        return {"session_rounds": 1, "session_accepted": len(accepted)}


class CombinedDrafter(Drafter):
    """Prompt lookup first (free to draft, up to the loop's k tokens); when it finds fewer than `min_copy` tokens,
    the `session`'s earlier text where its last `session_match` tokens or more occurred there (a tree of what
    followed, the most frequent first, as many nodes as lookup's tree may hold), else the draft model proposes up
    to `model_gamma` tokens."""

    name = "auto"

    def __init__(self, lookup: PromptLookupDrafter, model: Drafter, model_gamma: int = 4, min_copy: int = 2,
                 session: SessionText | None = None, session_match: int = 0):
        self.lookup, self.model, self.model_gamma = lookup, model, check("gamma", model_gamma)
        self.min_copy = min_copy
        self.session, self.session_match = session, check("session_min_match", session_match)
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
        if self.session is not None and self.session_match:
            found = self.session.draft(ids, k, self.lookup.max_tree or k, self.session_match)
            if found is not None:
                self.last = self.lookup  # no model ran: nothing to hear back
                return SessionDraft(found.tokens, parents=chain_or_tree(found.parents))
        self.last = self.model
        return self.model.propose(ids, min(k, self.model_gamma), processor, generator)

    def feedback(self, ids: list[int], accepted: int, target_logits: Tensor) -> None:
        self.last.feedback(ids, accepted, target_logits)
