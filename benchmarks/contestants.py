"""What the runner measures: a contestant turns prompt ids into a timed `Result` (sampling.base), the type every
strategy returns.

Ours wrap a registry strategy and read its stream of rounds; the HF baselines (hf_baselines.py) wrap `generate`.
Both count tokens the same way: new token ids, cut at the first end token (kept) and at max_new_tokens.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

from sampling.base import DecodeConfig, Result, Strategy
from sampling.drafters.combined import CombinedDrafter
from sampling.drafters.model import ModelDrafter
from utils.runner import CachedModel


class Contestant(ABC):
    name: str
    kind: str  # "ours" | "hf"
    uses_drafter_model: bool = False

    @abstractmethod
    def run(self, prompt_ids: list[int], config: DecodeConfig) -> Result:
        ...

    @abstractmethod
    def describe(self) -> dict:
        """JSON-ready: what exactly was run."""


class OurStrategy(Contestant):
    """A registry strategy. Its models' caches are emptied before each run: every contestant prefills the whole
    prompt, as HF's `generate` does (no prefix reuse between strategies or turns)."""

    kind = "ours"

    def __init__(self, strategy: Strategy, models: list[CachedModel], settings: dict, uses_drafter_model: bool):
        self.strategy, self.models, self.settings = strategy, models, settings
        self.name = strategy.name
        self.uses_drafter_model = uses_drafter_model
        # Draft length of speculative strategies; none for a mixed drafter (auto), which one gamma does not describe.
        drafter = getattr(strategy, "drafter", None)
        mixed = isinstance(drafter, CombinedDrafter)
        self.gamma: int | None = None if mixed else getattr(strategy, "gamma", None)
        # A draft model that stops early drafts fewer than gamma tokens in most rounds (its bound is taken at the
        # mean draft length).
        self.stops_early = isinstance(drafter, ModelDrafter) and bool(drafter.confidence or drafter.cumulative
                                                                      or drafter.adaptive)

    def run(self, prompt_ids: list[int], config: DecodeConfig) -> Result:
        for lm in self.models:
            lm.reset()
        result, first = Result(), None
        start = time.perf_counter()
        for r in self.strategy.stream(prompt_ids, config):
            if first is None:
                first = time.perf_counter() - start
            result.add(r)
        total = time.perf_counter() - start
        # Timed from the call, as HF's generate is (the rounds' own clock starts after the stream's checks).
        result.stats.time_to_first_token = first if first is not None else total
        result.stats.total_time = total
        return result

    def describe(self) -> dict:
        return {"name": self.name, "kind": self.kind, "class": type(self.strategy).__name__, "gamma": self.gamma,
                "stops_early": self.stops_early, "uses_drafter_model": self.uses_drafter_model,
                "settings": self.settings}
