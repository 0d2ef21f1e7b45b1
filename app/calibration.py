"""Per-machine calibration: what a forward costs on this machine, and the drafting settings that pay at that cost.

Speculative decoding pays only where verifying several tokens costs little more than one decode step, and that
depends on the CPU (native bf16 or not, AVX-512 or AVX2), the weight formats and the torch build: no constant tuned on
one machine holds on the next. So the target's forward over 1..W new tokens and the drafter's one-token step are
timed once per (CPU, torch, models, formats, threads), kept as JSON in the cache dir, and `choose` derives gamma's
cap, the verify width, the alternatives and the cumulative stop from those timings (docs/calibration.md).
"""

from __future__ import annotations

import datetime
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from models import invariance
from models.devices import cpu_flags, cpu_model
from models.draft_vocabulary import DraftVocabulary
from models.invariance import Invariance
from sampling.settings import CALIBRATED, StrategySettings
from utils.files import checked, key_file, read_record, write_record  # per key: "" timings, "invariance" the probe
from utils.runner import CachedModel
from utils.timing import time_forwards

WIDTHS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 16, 20)  # new tokens per timed target forward
CONTEXT = 128  # cached tokens when the forwards are timed: a short chat turn
ACCEPTANCE = 0.9  # a draft the drafter is sure of is accepted this often (the rounds where gamma's cap binds)
TREE_SLACK = 1.05  # the verify width grows past the chain while a forward costs at most this much more
VOCABULARY_GAIN = 1.02  # a draft vocabulary is taken where it commits at least this much more per target step
MAX_GAMMA = 16
SCHEMA = 3  # 3: the fastest of the repeats, the widths in turn (was their median, one width after another)
PROBE_SCHEMA = 1  # the row-invariance record (models/invariance.py); raised when the probe or the paths change


@dataclass(frozen=True)
class Calibration:
    """Timed forwards on this machine, in milliseconds; `key` says what they hold for."""

    key: dict
    target_ms: dict[int, float]  # new tokens -> one target forward
    drafter_ms: float | None  # one drafter forward over 1 new token (its decode step); None without a drafter
    context: int
    seconds: float  # how long the timing took
    date: str  # ISO date of the timing
    # The drafter's step with its output layer restricted to each draft-vocabulary size (0: the whole vocabulary,
    # timed the same way, eagerly), where the drafter has one (models/draft_vocabulary.py); {} where not timed.
    drafter_vocab_ms: dict[int, float] = field(default_factory=dict)

    @property
    def forward_ms(self) -> dict[int, float]:
        """`target_ms` made non-decreasing from the right: a forward over fewer tokens costs no more than one over
        more, so a timing the machine slowed (a one-token step above a verify of 2) gives way to the wider ones'."""
        envelope, lowest = {}, float("inf")
        for width in sorted(self.target_ms, reverse=True):
            lowest = envelope[width] = min(lowest, self.target_ms[width])
        return envelope

    @property
    def draft_cost(self) -> float | None:
        """c: the drafter's step in target steps."""
        return None if self.drafter_ms is None else self.drafter_ms / self.forward_ms[1]

    def vocabulary_cost(self, size: int) -> float | None:
        """c with the drafter's output layer restricted to `size` tokens (0: the whole vocabulary): its step less the
        time the restricted layer saved where both were timed alike (the bytes not read cost the same time in an eager
        step as in a compiled one, which spends less around them), at least a tenth of it."""
        c, timed = self.draft_cost, self.drafter_vocab_ms
        if c is None or self.drafter_ms is None or not size:
            return c
        if size not in timed or 0 not in timed:
            return None
        saved = timed[0] - timed[size]
        return max(self.drafter_ms - saved, self.drafter_ms / 10) / self.forward_ms[1]

    def verify_cost(self, tokens: int) -> float:
        """A target forward over `tokens` new tokens in one-token steps, interpolated between the timed widths."""
        ms = self.forward_ms
        widths = sorted(ms)
        if tokens <= widths[0]:
            return 1.0
        for low, high in zip(widths, widths[1:], strict=False):
            if tokens <= high:
                share = (tokens - low) / (high - low)
                return (ms[low] + share * (ms[high] - ms[low])) / ms[1]
        return ms[widths[-1]] / ms[1] * tokens / widths[-1]  # past the last: linear

    def as_dict(self) -> dict:
        return {"schema": SCHEMA, **asdict(self), "target_ms": {str(k): v for k, v in self.target_ms.items()},
                "drafter_vocab_ms": {str(k): v for k, v in self.drafter_vocab_ms.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> Calibration:
        """The calibration a kept file holds; ValueError (or KeyError, TypeError) if a value is out of its bounds."""
        target_ms = {int(k): checked(f"target_ms[{k!r}]", v, float, MS_BOUNDS)
                     for k, v in checked("target_ms", data["target_ms"], dict).items()}
        if 1 not in target_ms or len(target_ms) < 2 or not all(1 <= width <= MAX_WIDTH for width in target_ms):
            raise ValueError(f"target_ms must time 1 new token and wider forwards up to {MAX_WIDTH}, not "
                             f"{sorted(target_ms)}")
        drafter_ms = None if data["drafter_ms"] is None else checked("drafter_ms", data["drafter_ms"], float, MS_BOUNDS)
        vocab_ms = {int(k): checked(f"drafter_vocab_ms[{k!r}]", v, float, MS_BOUNDS)
                    for k, v in checked("drafter_vocab_ms", data.get("drafter_vocab_ms", {}), dict).items()}
        return cls(key=data["key"], target_ms=target_ms, drafter_ms=drafter_ms,
                   context=checked("context", data["context"], int, (1, math.inf)),
                   seconds=checked("seconds", data["seconds"], float, (0, math.inf)),
                   date=checked("date", data["date"], str), drafter_vocab_ms=vocab_ms)


MAX_WIDTH = 64  # the widest forward a kept file may hold a timing for
MS_BOUNDS = (1e-3, 1e7)  # a forward's milliseconds: from a microsecond to hours


@dataclass(frozen=True)
class Choice:
    """The drafting settings the costs call for, and why (one line each, for the banner and /stats)."""

    settings: StrategySettings
    reasons: tuple[str, ...]
    tokens_per_step: float  # what the cost model expects a round to commit per target step at these settings
    draft_vocabulary: int = 0  # the draft model's output layer restricted to this many tokens (0: all of them)


KERNEL_FLAGS = {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "avx_vnni", "avx_ne_convert",
                "fma", "f16c", "bf16", "sve", "asimd", "i8mm"}  # the CPU features that decide which kernels run


def machine_key(target: str, target_format: str, drafter: str | None, drafter_format: str | None,
                device: torch.device) -> dict:
    """What a calibration holds for: another CPU, torch, model, format or thread count is measured anew."""
    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    return {"device": device.type, "hardware": hardware, "cpu_flags": sorted(KERNEL_FLAGS & cpu_flags()),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(), "target": target, "target_format": target_format,
            "drafter": drafter, "drafter_format": drafter_format}


def measure(target: CachedModel, drafter: CachedModel | None, key: dict, widths: tuple[int, ...] = WIDTHS,
            context: int = CONTEXT, repeats: int = 5, vocabulary: DraftVocabulary | None = None) -> Calibration:
    """Time the target's forward over each of `widths` new tokens and the drafter's step after `context` tokens: the
    fastest of `repeats`, the widths in turn; and, where the drafter has a `vocabulary`, its step at each of its
    sizes and at the whole vocabulary, eagerly (a compiled step would compile anew for each output layer)."""
    started = time.perf_counter()
    vocab = min(lm.vocab_size for lm in (target, drafter) if lm is not None)
    context = min(context, target.max_length - max(widths) - 1)
    ids = [(i * 7919 + 13) % vocab for i in range(context + max(widths))]  # any tokens will do
    prompt, new = ids[:context], ids[context:]
    counts = sorted(set(widths) | {1})
    timed = time_forwards(target, prompt, [new[:n] for n in counts], repeats)
    target_ms = {n: min(times) * 1e3 for n, times in zip(counts, timed, strict=True)}  # noise only adds
    drafter_ms = None
    if drafter is not None:
        drafter_ms = min(time_forwards(drafter, prompt, [new[:1]], max(repeats, 5))[0]) * 1e3
    vocab_ms = {}
    if drafter is not None and vocabulary is not None and vocabulary.sizes:
        vocab_ms = time_vocabulary(drafter, vocabulary, prompt, new[:1], max(repeats, 5))
        # drafter_ms is the whole vocabulary's step: a restricted one timed gets back what its layer saved
        if drafter_ms is not None and vocabulary.size in vocab_ms:
            drafter_ms += vocab_ms[0] - vocab_ms[vocabulary.size]
    return Calibration(key, target_ms, drafter_ms, context, time.perf_counter() - started,
                       datetime.datetime.now().astimezone().isoformat(timespec="seconds"), vocab_ms)


def time_vocabulary(drafter: CachedModel, vocabulary: DraftVocabulary, prompt: list[int], new: list[int],
                    repeats: int) -> dict[int, float]:
    """The drafter's eager step (ms) at the whole vocabulary (0) and each of `vocabulary`'s sizes, in turn, the
    fastest of `repeats` rounds; the output layer and the step graph left as they were."""
    sizes, in_use, step = (0, *vocabulary.sizes), vocabulary.size, drafter.step_model
    best = dict.fromkeys(sizes, math.inf)
    drafter.step_model = None
    try:
        for _ in range(repeats):
            for size in sizes:
                vocabulary.use(size)
                best[size] = min(best[size], min(time_forwards(drafter, prompt, [new], 1)[0]) * 1e3)
    finally:
        vocabulary.use(in_use)
        drafter.step_model = step
    return best


def load(path: Path, key: dict) -> tuple[Calibration | None, str | None]:
    """The calibration kept at `path` if it was measured for `key` (else None), and what was wrong with the file if
    one is there but cannot serve (None: it serves, or there is none)."""
    return read_record(path, key, Calibration.from_dict, "timings", SCHEMA, again="timed again")


def save(path: Path, calibration: Calibration) -> None:
    write_record(path, calibration.as_dict())


def calibrate(cache_dir: Path, target: CachedModel, drafter: CachedModel | None, key: dict,
              again: bool = False, vocabulary: DraftVocabulary | None = None) -> tuple[Calibration, bool, str | None]:
    """The kept calibration for `key`, or a new one measured now and kept; True when it was measured now; and what
    was wrong with a kept file that could not serve (it is measured anew, never an error). A kept one without the
    timings of the drafter's `vocabulary` sizes is measured anew."""
    path = key_file(cache_dir, key)
    kept, damaged = (None, None) if again else load(path, key)
    needed = set(vocabulary.sizes) if vocabulary is not None else set()
    if kept is not None and needed <= set(kept.drafter_vocab_ms):
        return kept, False, None
    calibration = measure(target, drafter, key, vocabulary=vocabulary)
    try:
        save(path, calibration)
    except OSError:  # a read-only cache dir: the timings still serve this run
        pass
    return calibration, True, damaged


def probe(cache_dir: Path, target: CachedModel, key: dict, again: bool = False,
          tell: Callable[[str], None] | None = None) -> tuple[Invariance, bool]:
    """The target's row-invariance record for `key` (kept, or probed now and kept), its path applied to `target`;
    True when it was probed now (`tell` hears its steps). A kept record whose path this model cannot take is probed
    again."""
    path = key_file(cache_dir, key, "invariance")
    kept, damaged = (None, None) if again else read_record(path, key, lambda data: Invariance.from_dict(
        checked("invariance", data["invariance"], dict)), "invariance record", PROBE_SCHEMA, again="probed again")
    if damaged:
        print(f"warning: {damaged}", file=sys.stderr)
    if kept is not None and invariance.apply(target, kept.path):
        return kept, False
    found = invariance.probe(target, tell=tell)
    try:
        write_record(path, {"schema": PROBE_SCHEMA, "key": key, "invariance": found.as_dict()})
    except OSError:  # a read-only cache dir: the record still serves this run
        pass
    return found, True


def expected_tokens(gamma: int, acceptance: float = ACCEPTANCE) -> float:
    """Tokens a round commits from a chain of `gamma` drafts, each accepted with `acceptance` (Leviathan et al.)."""
    return (1 - acceptance ** (gamma + 1)) / (1 - acceptance)


def chain_rates(calibration: Calibration, cost: float, acceptance: float = ACCEPTANCE) -> dict[int, float]:
    """Tokens per target step of a chain of each gamma: one verify over gamma + 1 tokens and gamma drafter steps of
    `cost` (c) for expected_tokens(gamma, acceptance)."""
    return {g: expected_tokens(g, acceptance) / (calibration.verify_cost(g + 1) + g * cost)
            for g in range(1, MAX_GAMMA + 1)}


def vocabulary_choice(calibration: Calibration, coverage: dict[int, float]) -> tuple[int, str | None]:
    """The draft vocabulary size that commits the most per target step (0: the whole vocabulary), and why.

    Restricted to K tokens a drafter step costs c_K (timed), and the target's next token can be drafted at all only
    where it is among the K: a share of tokens (the held-out `coverage`), so the acceptance where the drafter is sure
    falls to ACCEPTANCE times it. Each size is weighed at its best gamma, as `choose` weighs the chain; a size is taken
    where it commits VOCABULARY_GAIN times the whole vocabulary's tokens per step or more: less is the model's noise.
    """
    c = calibration.draft_cost
    if c is None or not coverage:
        return 0, None
    whole = max(chain_rates(calibration, c).values())
    rates = {size: max(chain_rates(calibration, cost, ACCEPTANCE * share).values()) for size, share in coverage.items()
             if (cost := calibration.vocabulary_cost(size)) is not None}
    if not rates:
        return 0, None
    best = max(rates, key=rates.__getitem__)
    cost = calibration.vocabulary_cost(best)
    weighed = (f"{best} tokens: c = {cost:.2f}, {coverage[best]:.0%} of held-out answer tokens, "
               f"{rates[best]:.2f} tokens per target step against {whole:.2f} with all")
    if rates[best] < whole * VOCABULARY_GAIN:
        return 0, f"draft vocabulary: the whole (the best restricted, {weighed}, does not pay)"
    return best, f"draft vocabulary {weighed}"


def choose(calibration: Calibration, base: StrategySettings = StrategySettings(),
           coverage: dict[int, float] | None = None) -> Choice:
    """Gamma's cap, the cumulative stop, the verify width and the alternatives that pay at the measured costs.

    A round of `gamma` drafts costs one verify over gamma + 1 tokens plus gamma drafter steps (c each) and commits
    expected_tokens(gamma) where the drafter is sure; the cap is the gamma that commits most per target step. The
    draft model's cumulative stop is c times those tokens per step: one more draft pays while its chance of being
    accepted, over c, exceeds what a target step commits. The verify width grows past the chain while a wider
    forward costs at most TREE_SLACK more: the alternatives ride in places that are nearly free. Where the drafter
    has a draft vocabulary (`coverage`: each size's held-out share of answer tokens), its size comes first
    (`vocabulary_choice`) and the rest at its step's cost.
    """
    vocabulary, why_vocabulary = vocabulary_choice(calibration, coverage or {})
    c = calibration.vocabulary_cost(vocabulary)
    step_cost = c if c is not None else 0.0
    rate = chain_rates(calibration, step_cost)
    gamma = max(rate, key=rate.__getitem__)
    chain_cost = calibration.verify_cost(gamma + 1)
    widths = [n for n in range(gamma + 1, max(calibration.target_ms) + 1)
              if calibration.verify_cost(n) <= chain_cost * TREE_SLACK]
    width = max(widths)
    alternatives = base.draft_alternatives if width > gamma + 1 else 0
    cumulative = round(min(max(step_cost * rate[gamma], 0.05), 0.9), 2) if c is not None else base.draft_cumulative
    ms = calibration.forward_ms
    near4, widest = min(ms, key=lambda n: abs(n - 4)), max(ms)
    reasons = [
        f"target forward {ms[1]:.0f} ms for 1 token, {ms[near4]:.0f} ms for {near4}, {ms[widest]:.0f} ms for "
        f"{widest}; verify of {gamma + 1}: {chain_cost:.2f} steps",
        f"gamma {gamma}: the most tokens per target step ({rate[gamma]:.2f} where the drafter is sure)",
        f"verify width {width}: wider forwards cost more than {TREE_SLACK - 1:.0%} over the chain's"
        + ("" if alternatives else "; no room for alternatives"),
    ]
    if c is not None:
        reasons.insert(1, f"drafter step {calibration.drafter_ms:.0f} ms: c = {calibration.draft_cost:.2f} target "
                          f"steps; cumulative stop {cumulative:g} (c times the tokens per step)")
    if why_vocabulary:
        reasons.insert(2, why_vocabulary)
    settings = replace(base, gamma=gamma, verify_width=width, draft_alternatives=alternatives,
                       draft_cumulative=cumulative)
    return Choice(settings, tuple(reasons), rate[gamma], vocabulary)


def pair_key(pair) -> dict:
    """`machine_key` for a loaded pair (models.loading.LoadedPair)."""
    drafter = pair.drafter  # by source, not name: two saved directories may carry the same model name
    return machine_key(pair.target.source, _placed_format(pair.target), drafter.source if drafter else None,
                       _placed_format(drafter) if drafter else None, next(pair.target.model.parameters()).device)


def _placed_format(loaded) -> str:
    """The format, and where a device map put the layers: a split model is timed apart from the whole one."""
    return loaded.format + (f" · {loaded.placement}" if loaded.placement else "")


@dataclass(frozen=True)
class Tuning:
    """A calibration applied to a set of settings: the timings, the choice they called for, the settings that result
    (those the user chose kept), and why."""

    choice: Choice
    calibration: Calibration
    measured: bool  # timed now (False: the timings kept for this machine were read)
    kept: tuple[str, ...]  # calibrated settings the user had chosen, left as they were
    settings: StrategySettings
    damaged: str | None = None  # what was wrong with the kept timings that were replaced

    def summary(self, settings: StrategySettings | None = None) -> str:
        s = settings or self.settings
        alternatives = f"{s.draft_alternatives} alternatives" if s.draft_alternatives else "no alternatives"
        kept = f" (kept as set: {', '.join(self.kept)})" if self.kept else ""
        vocabulary = f" · draft vocabulary {self.choice.draft_vocabulary}" if self.choice.draft_vocabulary else ""
        return (f"gamma {s.gamma} · verify width {s.verify_width} · {alternatives} · cumulative stop "
                f"{s.draft_cumulative:g}{vocabulary}{kept}")


def tune(cache_dir: Path, target: CachedModel, drafter: CachedModel | None, key: dict, settings: StrategySettings,
         explicit: frozenset[str] = frozenset(), again: bool = False,
         vocabulary: DraftVocabulary | None = None) -> Tuning:
    """`settings` with the calibrated ones this machine's timings call for, but those the user set (`explicit`); the
    drafter's `vocabulary` size is chosen (`choice.draft_vocabulary`), not applied."""
    calibration, measured, damaged = calibrate(cache_dir, target, drafter, key, again=again, vocabulary=vocabulary)
    choice = choose(calibration, settings, vocabulary.coverage if vocabulary is not None else None)
    chosen = {name: getattr(choice.settings, name) for name in CALIBRATED if name not in explicit}
    return Tuning(choice, calibration, measured, tuple(sorted(explicit & set(CALIBRATED))), replace(settings, **chosen),
                  damaged)
