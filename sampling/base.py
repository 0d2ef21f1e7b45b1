"""What every strategy shares: its configuration, the per-round event it yields, the stats, the stopping rule."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

from utils.checks import integer
from utils.logits_processor import GreedyProcessor, LogitsProcessor

if TYPE_CHECKING:
    import torch

MAX_SEED = 2**63 - 1  # the largest int64: one bound for the command lines and /seed (torch would take 2**64 - 1)


@dataclass(frozen=True)
class DecodeConfig:
    max_new_tokens: int = 128
    processor: LogitsProcessor = field(default_factory=GreedyProcessor)
    end_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        integer("max_new_tokens", self.max_new_tokens, 0)
        if self.seed is not None:
            integer("seed", self.seed, 0, MAX_SEED)
        object.__setattr__(self, "end_ids", tuple(int(i) for i in self.end_ids))

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        import torch  # here, not at the top: the command lines check a DecodeConfig before they import torch

        generator = torch.Generator(device=device)
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed(self.seed)
        return generator


@dataclass(frozen=True)
class Round:
    """What one round committed. `drafted` are the proposed tokens; the first `accepted` of them were committed."""

    tokens: list[int]
    drafted: list[int] = field(default_factory=list)
    accepted: int = 0
    target_forwards: int = 1
    drafter_forwards: int = 0
    elapsed: float = 0.0  # seconds from the start of the generation to the end of this round
    finished: bool = False  # an end token was committed (the output is complete)
    pool_hits: int = 0  # accepted drafts that came from an n-gram pool (lookahead: rather than its Jacobi window)


@dataclass
class Stats:
    new_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    target_forwards: int = 0
    drafter_forwards: int = 0
    pool_hits: int = 0
    time_to_first_token: float = 0.0
    total_time: float = 0.0

    def add(self, r: Round) -> None:
        if self.rounds == 0:
            self.time_to_first_token = r.elapsed
        self.rounds += 1
        self.new_tokens += len(r.tokens)
        self.drafted += len(r.drafted)
        self.accepted += r.accepted
        _grow(self.drafted_by_position, len(r.drafted))
        _grow(self.accepted_by_position, len(r.drafted))
        for i in range(len(r.drafted)):
            self.drafted_by_position[i] += 1
            self.accepted_by_position[i] += i < r.accepted
        self.target_forwards += r.target_forwards
        self.drafter_forwards += r.drafter_forwards
        self.pool_hits += r.pool_hits
        self.total_time = r.elapsed

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_tokens_per_round(self) -> float:
        """Committed tokens per target verification, the bonus token included."""
        return self.new_tokens / self.rounds if self.rounds else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_time if self.total_time > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first over the time after the first round (prefill excluded)."""
        decode_time = self.total_time - self.time_to_first_token
        return (self.new_tokens - 1) / decode_time if self.new_tokens > 1 and decode_time > 0 else 0.0

    def as_dict(self) -> dict:
        names = ("acceptance_rate", "mean_tokens_per_round", "acceptance_by_position", "tokens_per_second",
                 "decode_tokens_per_second")
        return {**vars(self), **{n: getattr(self, n) for n in names}}


def _grow(counts: list[int], n: int) -> None:
    counts.extend([0] * (n - len(counts)))


@dataclass
class Result:
    token_ids: list[int]
    stats: Stats
    finished: bool  # ended on an end token (False: stopped at max_new_tokens)


def clip(tokens: list[int], end_ids: tuple[int, ...], budget: int) -> tuple[list[int], bool]:
    """Cut a block of new tokens at the earliest end token (kept) and at the token budget; True if an end was hit."""
    for i, t in enumerate(tokens[:budget]):
        if t in end_ids:
            return tokens[: i + 1], True
    return tokens[:budget], False


def check_prompt(prompt_ids: list[int], *context_limits: int) -> None:
    if not prompt_ids:
        raise ValueError("the prompt is empty: at least one token is needed")
    for limit in context_limits:
        if len(prompt_ids) >= limit:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens, more than the model's context allows ({limit})")


class Strategy(ABC):
    """A decoding strategy: a stream of rounds, or a call returning the whole result."""

    name: str

    @abstractmethod
    def stream(self, prompt_ids: list[int], config: DecodeConfig) -> Iterator[Round]:
        ...

    def generate(self, prompt_ids: list[int], config: DecodeConfig) -> Result:
        stats, tokens, finished = Stats(), [], False
        for r in self.stream(prompt_ids, config):
            stats.add(r)
            tokens += r.tokens
            finished = r.finished
        return Result(tokens, stats, finished)


class Clock:
    """Seconds since construction, for `Round.elapsed`."""

    def __init__(self):
        self.start = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.start
