"""Speculative decoding: one loop for every drafter (draft model, n-gram store, prompt lookup, ...)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from sampling.base import Clock, DecodeConfig, Round, Strategy, check_prompt, clip
from sampling.drafters.base import Draft, Drafter
from sampling.settings import check
from sampling.verify import (
    accept_greedy,
    accept_stochastic,
    accept_tree_greedy,
    accept_tree_stochastic,
    accept_tree_typical,
)
from utils.logits_processor import LogitsProcessor
from utils.runner import CachedModel


class Speculative(Strategy):
    def __init__(self, target: CachedModel, drafter: Drafter, gamma: int = 4, name: str = "speculative",
                 typical: tuple[float, float] | None = None):
        """`typical`: (threshold, alpha) for Medusa's typical acceptance when sampling, which does NOT keep the
        target's distribution (an explicit opt-in; `lossless` says so); None: the lossless rules."""
        self.target, self.drafter, self.gamma, self.name = target, drafter, check("gamma", gamma), name
        self.typical = typical

    @property
    def lossless(self) -> bool:
        return self.typical is None

    @property
    def models(self) -> list[CachedModel]:
        return list({id(lm): lm for lm in [self.target, *self.drafter.models]}.values())  # a drafter may be the target

    @torch.inference_mode()
    def stream(self, prompt_ids: list[int], config: DecodeConfig) -> Iterator[Round]:
        check_prompt(prompt_ids, self.target.max_length, self.drafter.max_length)
        clock, generator, processor = Clock(), config.make_generator(self.target.device), config.processor
        accept = acceptance_rule(processor, generator, self.typical)
        draft_generator = self._draft_generator(generator, config)
        ids, budget = list(prompt_ids), config.max_new_tokens
        limit = min(self.target.max_length, self.drafter.max_length)
        self.drafter.start(ids)
        while budget > 0 and len(ids) <= limit:  # the context full: a stop like the budget's (not finished)
            # 1. Draft: a chain or a tree; no deeper than the budget can take after the target's own token, nor than
            # the context has room for (the verify forward puts the deepest node at position len(ids) - 1 + depth).
            room = limit - len(ids)
            draft = self.drafter.propose(ids, min(self.gamma, budget - 1, room), processor,
                                         draft_generator).within(room)
            # 2. Verify every drafted token and the bonus position in one target forward: (1 + len(draft), V).
            logits = (self.target.extend(ids + draft.tokens, logits_rows=len(draft) + 1) if draft.parents is None
                      else self.target.extend_tree(ids, draft.tokens, draft.parents))
            # 3. Accept: a prefix of the chain, a path of the tree.
            path, token = accept(draft, logits)
            tokens, finished = clip([draft.tokens[i] for i in path] + [token], config.end_ids, budget)
            start = len(ids)
            ids += tokens
            budget -= len(tokens)
            # 4. Roll back: the target's cache keeps every committed token but the last (a tree's path moved in place).
            self.target.crop_to_path(start, [start + i for i in path[: len(tokens) - 1]])
            self.drafter.feedback(ids, len(path), logits)
            yield Round(tokens, drafted=draft.line(path), accepted=len(path), target_forwards=1,
                        drafter_forwards=draft.forwards, elapsed=clock(), finished=finished,
                        extra=draft.extra(tokens[: len(path)]))
            if finished:
                return

    def _draft_generator(self, generator: torch.Generator, config: DecodeConfig) -> torch.Generator:
        """The target's generator, or for a drafter on another device one of its own there, seeded alike: tokens
        cross between devices, caches and generators do not."""
        devices = {lm.device for lm in self.drafter.models}
        if len(devices) != 1 or self.target.device in devices:
            return generator
        return config.make_generator(devices.pop())


# An acceptance rule: the accepted drafts as indices into `draft.tokens` (a prefix of a chain, a path of a tree) and
# the token to commit after them, from the draft and the target's logits over it.
Rule = Callable[[Draft, Tensor], tuple[list[int], int]]


def acceptance_rule(processor: LogitsProcessor, generator: torch.Generator | None,
                    typical: tuple[float, float] | None = None) -> Rule:
    """The rule a generation verifies with, chosen once: greedy, speculative sampling (lossless), or Medusa's typical
    acceptance when sampling with `typical` (NOT lossless); each takes chains and trees."""

    def tensors(draft: Draft, logits: Tensor) -> tuple[Tensor, Tensor | None]:
        x = torch.tensor(draft.tokens, dtype=torch.long, device=logits.device)
        parents = None if draft.parents is None else torch.tensor(draft.parents, dtype=torch.long,
                                                                  device=logits.device)
        return x, parents

    def greedy(draft: Draft, logits: Tensor) -> tuple[list[int], int]:
        x, parents = tensors(draft, logits)
        if parents is None:
            accepted, token = accept_greedy(x, logits)
            return draft.path(accepted - 1), token
        last, token = accept_tree_greedy(x, parents, logits)
        return draft.path(last), token

    def sampled(draft: Draft, logits: Tensor) -> tuple[list[int], int]:
        x, parents = tensors(draft, logits)
        if parents is None:
            q = None if draft.q is None else draft.q.to(logits.device)  # a drafter may run on another device
            accepted, token = accept_stochastic(x, processor.probs(logits), q, generator)
            return draft.path(accepted - 1), token
        last, token = accept_tree_stochastic(x, parents, processor.probs(logits), generator)
        return draft.path(last), token

    def typical_acceptance(draft: Draft, logits: Tensor) -> tuple[list[int], int]:
        x, parents = tensors(draft, logits)
        chain = torch.arange(-1, len(draft) - 1, device=logits.device) if parents is None else parents
        assert typical is not None  # chosen only with it
        last, token = accept_tree_typical(x, chain, processor.probs(logits), *typical, generator)
        return draft.path(last), token

    if processor.is_greedy:
        return greedy
    return sampled if typical is None else typical_acceptance
