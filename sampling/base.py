"""What every strategy shares: its configuration, the per-round event it yields, the stats, the stopping rule."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import KW_ONLY, dataclass, field
from itertools import zip_longest
from typing import TYPE_CHECKING

from utils.checks import integer
from utils.logits_processor import GreedyProcessor, LogitsProcessor

if TYPE_CHECKING:
    import torch

    from utils.runner import CachedModel

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
    _: KW_ONLY
    drafted: list[int] = field(default_factory=list)
    accepted: int = 0
    target_forwards: int = 1
    drafter_forwards: int = 0
    elapsed: float = 0.0  # seconds from the start of the generation to the end of this round
    finished: bool = False  # an end token was committed (the output is complete)
    extra: dict[str, int] = field(default_factory=dict)  # the drafter's own counts (`Draft.extra`)


# The counts a generation run elsewhere (HF's generate, llama.cpp) may not expose: None there.
DRAFT_COUNTS = ("drafted", "accepted", "tested", "drafted_by_position", "accepted_by_position", "target_forwards",
                "drafter_forwards")


@dataclass
class Stats:
    """The counts and timings of one generation (built round by round with `add`), or of several summed (`combine`):
    every rate is a ratio of sums, computed here for the chat, the benchmark and its summaries alike."""

    new_tokens: int = 0
    rounds: int = 0
    tokens_by_round: list[int] = field(default_factory=list)
    drafted: int | None = 0
    accepted: int | None = 0
    tested: int | None = 0  # drafts compared with the target: the accepted ones and each round's first rejected one
    drafted_by_position: list[int] | None = field(default_factory=list)
    accepted_by_position: list[int] | None = field(default_factory=list)
    target_forwards: int | None = 0
    drafter_forwards: int | None = 0
    extra: dict[str, int] = field(default_factory=dict)  # a drafter's own counts (lookahead: pool_hits)
    time_to_first_token: float = 0.0  # summed over the generations combined
    total_time: float = 0.0
    runs: int = 1  # generations summed
    answered: int = 0  # generations that committed a token: each one's first token is the prefill's, not decode's

    @classmethod
    def measured(cls, new_tokens: int, rounds: int, time_to_first_token: float, total_time: float,
                 tokens_by_round: list[int] | None = None, **counts) -> Stats:
        """The stats of a generation run elsewhere (HF's generate, llama.cpp, a saved measurement): the `counts`
        (DRAFT_COUNTS) it does not give are None."""
        unknown = [name for name in counts if name not in DRAFT_COUNTS]
        if unknown:
            raise ValueError(f"unknown count {unknown[0]!r}; choose from {', '.join(DRAFT_COUNTS)}")
        return cls(new_tokens=new_tokens, rounds=rounds, tokens_by_round=list(tokens_by_round or []),
                   time_to_first_token=time_to_first_token, total_time=total_time, answered=min(new_tokens, 1),
                   **{**dict.fromkeys(DRAFT_COUNTS), **counts})

    def add(self, r: Round) -> None:
        if (self.drafted is None or self.accepted is None or self.tested is None or self.drafted_by_position is None
                or self.accepted_by_position is None or self.target_forwards is None or self.drafter_forwards is None):
            raise ValueError("add() counts a strategy's rounds; these stats were measured elsewhere, their draft "
                             "counts unknown (None)")
        if self.rounds == 0:
            self.time_to_first_token = r.elapsed
        self.rounds += 1
        self.new_tokens += len(r.tokens)
        self.answered = min(self.new_tokens, 1)
        self.tokens_by_round.append(len(r.tokens))
        self.drafted += len(r.drafted)
        self.accepted += r.accepted
        self.tested += min(len(r.drafted), r.accepted + 1)
        _grow(self.drafted_by_position, len(r.drafted))
        _grow(self.accepted_by_position, len(r.drafted))
        for i in range(len(r.drafted)):
            self.drafted_by_position[i] += 1
            self.accepted_by_position[i] += i < r.accepted
        self.target_forwards += r.target_forwards
        self.drafter_forwards += r.drafter_forwards
        _add_counts(self.extra, r.extra)
        self.total_time = r.elapsed

    @classmethod
    def combine(cls, parts: Iterable[Stats]) -> Stats:
        """Several generations' stats summed: a count any of them lacks (None) is None in the sum."""
        total = cls(runs=0)
        for s in parts:
            for name in ("new_tokens", "rounds", "time_to_first_token", "total_time", "runs", "answered"):
                setattr(total, name, getattr(total, name) + getattr(s, name))
            total.tokens_by_round = total.tokens_by_round + s.tokens_by_round
            for name in ("drafted", "accepted", "tested", "target_forwards", "drafter_forwards"):
                mine, theirs = getattr(total, name), getattr(s, name)
                setattr(total, name, None if mine is None or theirs is None else mine + theirs)
            for name in ("drafted_by_position", "accepted_by_position"):
                setattr(total, name, _add_lists(getattr(total, name), getattr(s, name)))
            _add_counts(total.extra, s.extra)
        return total

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted and self.accepted is not None else 0.0

    @property
    def mean_tokens_per_round(self) -> float:
        """Committed tokens per target verification, the bonus token included."""
        return self.new_tokens / self.rounds if self.rounds else 0.0

    @property
    def acceptance_by_position(self) -> list[float] | None:
        if self.drafted_by_position is None or self.accepted_by_position is None:
            return None
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position, strict=False)]

    @property
    def decode_time(self) -> float:
        return self.total_time - self.time_to_first_token

    @property
    def mean_time_to_first_token(self) -> float:
        return self.time_to_first_token / self.runs if self.runs else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_time if self.total_time > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after each generation's first over the time after its first round (prefill excluded)."""
        decode_tokens, decode_time = self.new_tokens - self.answered, self.decode_time
        return decode_tokens / decode_time if decode_tokens > 0 and decode_time > 0 else 0.0

    def as_dict(self) -> dict:
        names = ("acceptance_rate", "mean_tokens_per_round", "acceptance_by_position", "decode_time",
                 "tokens_per_second", "decode_tokens_per_second")
        return {**vars(self), **{n: getattr(self, n) for n in names}}


def _grow(counts: list[int], n: int) -> None:
    counts.extend([0] * (n - len(counts)))


def _add_lists(a: list[int] | None, b: list[int] | None) -> list[int] | None:
    """Position by position; the shorter list counts 0 beyond its end."""
    if a is None or b is None:
        return None
    return [x + y for x, y in zip_longest(a, b, fillvalue=0)]


def _add_counts(into: dict[str, int], counts: dict[str, int]) -> None:
    for name, n in counts.items():
        into[name] = into.get(name, 0) + n


@dataclass
class Result:
    """A whole generation: its token ids, whether it ended on an end token, and its stats. The chat, the benchmark
    and the HF baselines all hand this back."""

    token_ids: list[int] = field(default_factory=list)
    finished: bool = False  # ended on an end token (False: stopped at max_new_tokens, the context's end, or cut)
    stats: Stats = field(default_factory=Stats)

    @classmethod
    def from_rounds(cls, rounds: Iterable[Round]) -> Result:
        result = cls()
        for r in rounds:
            result.add(r)
        return result

    def add(self, r: Round) -> None:
        self.token_ids += r.tokens
        self.finished = r.finished
        self.stats.add(r)


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

    @property
    @abstractmethod
    def models(self) -> list[CachedModel]:
        """The cached models this strategy feeds (their caches are what a run changes)."""

    def generate(self, prompt_ids: list[int], config: DecodeConfig) -> Result:
        return Result.from_rounds(self.stream(prompt_ids, config))


class Clock:
    """Seconds since construction, for `Round.elapsed`."""

    def __init__(self):
        self.start = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.start
