"""Plain decoding with a KV cache: one forward, one token. The baseline every other strategy must equal."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from sampling.base import Clock, DecodeConfig, Round, Strategy, check_prompt, clip
from utils.runner import CachedModel


class Autoregressive(Strategy):
    def __init__(self, lm: CachedModel, name: str = "autoregressive"):
        self.lm, self.name = lm, name

    @property
    def models(self) -> list[CachedModel]:
        return [self.lm]

    @torch.inference_mode()
    def stream(self, prompt_ids: list[int], config: DecodeConfig) -> Iterator[Round]:
        check_prompt(prompt_ids, self.lm.max_length)
        clock, generator, processor = Clock(), config.make_generator(self.lm.device), config.processor
        ids, budget = list(prompt_ids), config.max_new_tokens
        while budget > 0:
            logits = self.lm.extend(ids)  # the first call prefills (reusing any cached prefix), then one token each
            token = int(processor.sample(processor.probs(logits), generator))
            tokens, finished = clip([token], config.end_ids, budget)
            ids += tokens
            budget -= len(tokens)
            yield Round(tokens, elapsed=clock(), finished=finished)
            if finished:
                return
