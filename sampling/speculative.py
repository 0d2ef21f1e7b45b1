"""Speculative decoding: one loop for every drafter (draft model, n-gram store, prompt lookup, ...)."""

from __future__ import annotations

from typing import Iterator

import torch

from sampling.base import Clock, DecodeConfig, Round, Strategy, check_prompt, clip
from sampling.drafters.base import Drafter
from sampling.verify import accept_greedy, accept_stochastic
from utils.caching import CachedModel


class Speculative(Strategy):
    def __init__(self, target: CachedModel, drafter: Drafter, gamma: int = 4, name: str = "speculative"):
        if int(gamma) != gamma or gamma < 1:
            raise ValueError(f"gamma (draft length) must be an integer >= 1, got {gamma}")
        self.target, self.drafter, self.gamma, self.name = target, drafter, int(gamma), name

    @torch.inference_mode()
    def stream(self, prompt_ids: list[int], config: DecodeConfig) -> Iterator[Round]:
        check_prompt(prompt_ids, self.target.max_length, self.drafter.max_length)
        clock, generator, processor = Clock(), config.make_generator(self.target.device), config.processor
        ids, budget = list(prompt_ids), config.max_new_tokens
        self.drafter.start(ids)
        while budget > 0:
            drafter_forwards = self.drafter.forwards
            # 1. Draft: never more than the budget can take after the target's own token.
            draft = self.drafter.propose(ids, min(self.gamma, budget - 1), processor, generator)
            x = torch.tensor(draft.tokens, dtype=torch.long, device=self.target.device)
            # 2. Verify all drafts and the bonus position in one target forward.
            logits = self.target.extend(ids + draft.tokens, keep=len(draft) + 1)  # (k+1, V)
            # 3. Accept.
            if processor.is_greedy:
                accepted, token = accept_greedy(x, logits)
            else:
                accepted, token = accept_stochastic(x, processor.probs(logits), draft.q, generator)
            tokens, finished = clip(draft.tokens[:accepted] + [token], config.end_ids, budget)
            ids += tokens
            budget -= len(tokens)
            # 4. Roll back: the target's cache keeps every committed token but the last.
            self.target.crop(len(ids) - 1)
            self.drafter.feedback(ids, accepted, logits)
            yield Round(tokens, draft.tokens, accepted, 1, self.drafter.forwards - drafter_forwards, clock(), finished)
            if finished:
                return
