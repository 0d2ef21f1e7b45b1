"""What the runner measures: a contestant turns prompt ids into a timed `Generation`.

Ours wrap a registry strategy and read its stream of rounds; the HF baselines (hf_baselines.py) wrap `generate`.
Both count tokens the same way: new token ids, cut at the first end token (kept) and at max_new_tokens.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from sampling.base import DecodeConfig, Stats, Strategy
from sampling.drafters.combined import CombinedDrafter
from sampling.drafters.model import ModelDrafter
from utils.caching import CachedModel


@dataclass
class Generation:
    token_ids: list[int]
    finished: bool  # ended on an end token
    time_to_first_token: float  # seconds from the call to the first committed token(s)
    total_time: float
    rounds: int  # target verification rounds (one per token for plain decoding)
    # Draft statistics; None where the contestant does not expose them (HF).
    drafted: int | None = None
    accepted: int | None = None
    tested: int | None = None  # drafts compared with the target: the accepted ones and each round's first rejected one
    drafted_by_position: list[int] | None = None
    accepted_by_position: list[int] | None = None
    target_forwards: int | None = None
    drafter_forwards: int | None = None
    tokens_by_round: list[int] = field(default_factory=list)

    @property
    def decode_time(self) -> float:
        return self.total_time - self.time_to_first_token


class Contestant(ABC):
    name: str
    kind: str  # "ours" | "hf"
    uses_drafter_model: bool = False

    @abstractmethod
    def run(self, prompt_ids: list[int], config: DecodeConfig) -> Generation:
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

    def run(self, prompt_ids: list[int], config: DecodeConfig) -> Generation:
        for lm in self.models:
            lm.reset()
        stats, tokens, finished, tested, per_round = Stats(), [], False, 0, []
        start = time.perf_counter()
        first = None
        for r in self.strategy.stream(prompt_ids, config):
            if first is None:
                first = time.perf_counter() - start
            stats.add(r)
            tokens += r.tokens
            finished = r.finished
            tested += min(len(r.drafted), r.accepted + 1)
            per_round.append(len(r.tokens))
        total = time.perf_counter() - start
        return Generation(
            token_ids=tokens, finished=finished, time_to_first_token=first if first is not None else total,
            total_time=total, rounds=stats.rounds, drafted=stats.drafted, accepted=stats.accepted, tested=tested,
            drafted_by_position=stats.drafted_by_position, accepted_by_position=stats.accepted_by_position,
            target_forwards=stats.target_forwards, drafter_forwards=stats.drafter_forwards, tokens_by_round=per_round)

    def describe(self) -> dict:
        return {"name": self.name, "kind": self.kind, "class": type(self.strategy).__name__, "gamma": self.gamma,
                "stops_early": self.stops_early, "uses_drafter_model": self.uses_drafter_model,
                "settings": self.settings}
