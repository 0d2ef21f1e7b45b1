"""The measurement loop: a warm-up, then every contestant on every prompt turn, interleaved.

Method
- Warm-up: each contestant decodes the first prompt once (a few tokens), unrecorded.
- Interleaving: for each prompt turn all contestants run back to back (A B C, A B C, ...), starting at a different
  contestant for each prompt (the order rotates), so machine drift and order effects hit all alike.
- Multi-turn prompts: every turn is measured. Turn k+1's context is the conversation so far with *our
  autoregressive* answers, so every contestant gets exactly the same prompt ids on every turn.
- Every run starts from empty KV caches (no prefix reuse between contestants or turns).
- Greedy runs: each output is compared token by token with our autoregressive output for the same prompt turn.
- Checkpoint: each finished prompt (all its turns, all contestants) is appended to a JSONL file, so a run stopped
  half-way (hours on a CPU) resumes where it was, if nothing that shapes a measurement has changed.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from benchmarks.contestants import Contestant
from benchmarks.names import REFERENCE
from sampling.base import DecodeConfig, Result
from utils.prompts import Prompt


@dataclass(frozen=True)
class Encoder:
    """Text <-> ids for the target model's chat format (the engine sees ids only)."""

    encode: Callable[[list[dict[str, str]]], list[int]]  # messages -> prompt ids
    decode: Callable[[list[int]], str]  # new ids -> answer text (end tokens dropped)


@dataclass(frozen=True)
class RunSettings:
    config: DecodeConfig
    warmup_tokens: int = 8
    context_limit: int = 1 << 31  # prompt + max_new_tokens must fit (smallest context among the models)
    progress: bool = True
    # What a turn's prompt and its reference answer are handed to once every contestant ran it: the session's text
    # that the turns after draft from (the chat's rule: no contestant copies another's answer to the same turn).
    remember: Callable[[list[int]], None] | None = None


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where the outputs differ (the shorter length if one is a prefix of the other)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


class CheckpointMismatch(ValueError):
    pass


class Checkpoint:
    """Finished prompts in a JSONL file: a header line with the run's fingerprint, then one line per prompt.

    `resume=True` keeps the prompts already in the file (the fingerprint must be equal: models, dtype, decoding,
    contestants, ...); `resume=False` starts the file afresh. A line cut short by an interruption is ignored.
    """

    def __init__(self, path: Path, fingerprint: dict, resume: bool):
        self.path, self.fingerprint = Path(path), json.loads(json.dumps(fingerprint, default=str))  # as read back
        self.done: dict[str, dict] = {}
        if resume and self.path.exists():
            self._load()
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps({"fingerprint": self.fingerprint}) + "\n", encoding="utf-8")

    def _load(self) -> None:
        lines = self.path.read_text(encoding="utf-8").splitlines()
        header = json.loads(lines[0]).get("fingerprint") if lines else None
        if header != self.fingerprint:
            changed = sorted(k for k in {*(header or {}), *self.fingerprint}
                             if (header or {}).get(k) != self.fingerprint.get(k))
            raise CheckpointMismatch(f"{self.path} belongs to a run with other settings (differs in: "
                                     f"{', '.join(changed)}); rerun with the same settings, or without --resume")
        for line in lines[1:]:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # the last line of an interrupted write
                continue
            self.done[record["prompt_id"]] = record
        kept = [lines[0], *(json.dumps(record, default=str) for record in self.done.values())]
        self.path.write_text("\n".join(kept) + "\n", encoding="utf-8")  # new records never follow a cut line

    def saved(self, prompt: Prompt) -> dict | None:
        record = self.done.get(prompt.id)
        return record if record is not None and record["turns"] == list(prompt.turns) else None

    def save(self, prompt: Prompt, measurements: list[dict], skipped: list[dict]) -> None:
        record = {"prompt_id": prompt.id, "turns": list(prompt.turns), "measurements": measurements,
                  "skipped": skipped}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=str) + "\n")


def run_benchmark(prompts: list[Prompt], contestants: list[Contestant], encoder: Encoder,
                  settings: RunSettings, checkpoint: Checkpoint | None = None) -> tuple[list[dict], list[dict]]:
    """Measurements (one dict per prompt turn per contestant) and the prompt turns skipped (with the reason)."""
    names = [c.name for c in contestants]
    if REFERENCE not in names:
        raise ValueError(f"the contestants must include {REFERENCE!r}: it is the baseline and builds later turns")
    config = settings.config
    _warm_up(prompts, contestants, encoder, settings)
    measurements, skipped = [], []
    total = sum(len(p.turns) for p in prompts) * len(contestants)
    with tqdm(total=total, desc="bench", unit="run", file=sys.stderr, disable=not settings.progress) as bar:
        for index, prompt in enumerate(prompts):
            if checkpoint is not None and (saved := checkpoint.saved(prompt)) is not None:
                measurements += saved["measurements"]
                skipped += saved["skipped"]
                bar.update(len(contestants) * len(prompt.turns))
                continue
            first_measurement, first_skipped = len(measurements), len(skipped)
            order = contestants[index % len(contestants):] + contestants[: index % len(contestants)]
            messages: list[dict[str, str]] = []
            for turn, text in enumerate(prompt.turns):
                messages.append({"role": "user", "content": text})
                prompt_ids = encoder.encode(messages)
                if len(prompt_ids) + config.max_new_tokens > settings.context_limit:
                    reason = (f"{len(prompt_ids)} prompt tokens + {config.max_new_tokens} new tokens exceed the "
                              f"context of {settings.context_limit}")
                    skipped.append({"prompt_id": prompt.id, "category": prompt.category, "turn": turn,
                                    "reason": reason})
                    bar.update(len(contestants) * (len(prompt.turns) - turn))
                    break
                runs = {}
                for position, contestant in enumerate(order):
                    bar.set_postfix_str(f"{prompt.id} turn {turn + 1} {contestant.name}")
                    runs[contestant.name] = (position, contestant.run(prompt_ids, config))
                    bar.update(1)
                reference = runs[REFERENCE][1]
                for contestant in contestants:
                    position, generation = runs[contestant.name]
                    measurements.append(_record(prompt, turn, len(prompt_ids), contestant, position, generation,
                                                reference, config, encoder))
                if settings.remember is not None:
                    settings.remember(prompt_ids + reference.token_ids)
                messages.append({"role": "assistant", "content": encoder.decode(reference.token_ids)})
            if checkpoint is not None:
                checkpoint.save(prompt, measurements[first_measurement:], skipped[first_skipped:])
    return measurements, skipped


def _warm_up(prompts: list[Prompt], contestants: list[Contestant], encoder: Encoder, settings: RunSettings) -> None:
    if not prompts or settings.warmup_tokens <= 0:
        return
    config = settings.config
    warm = DecodeConfig(min(settings.warmup_tokens, config.max_new_tokens), config.processor, config.end_ids,
                        config.seed)
    prompt_ids = encoder.encode([{"role": "user", "content": prompts[0].turns[0]}])
    if len(prompt_ids) + warm.max_new_tokens > settings.context_limit:
        prompt_ids = prompt_ids[: max(1, settings.context_limit - warm.max_new_tokens)]
    for contestant in tqdm(contestants, desc="warm-up", file=sys.stderr, disable=not settings.progress):
        contestant.run(prompt_ids, warm)


def _record(prompt: Prompt, turn: int, prompt_tokens: int, contestant: Contestant, position: int,
            g: Result, reference: Result, config: DecodeConfig, encoder: Encoder) -> dict:
    s = g.stats
    greedy = config.processor.is_greedy
    difference = first_difference(g.token_ids, reference.token_ids) if greedy else None
    return {
        "prompt_id": prompt.id,
        "category": prompt.category,
        "turn": turn,
        "strategy": contestant.name,
        "kind": contestant.kind,
        "order": position,
        "prompt_tokens": prompt_tokens,
        "new_tokens": s.new_tokens,
        "finished": g.finished,
        "time_to_first_token": s.time_to_first_token,
        "decode_time": s.decode_time,
        "total_time": s.total_time,
        "tokens_per_second": s.tokens_per_second,
        "decode_tokens_per_second": s.decode_tokens_per_second,
        "rounds": s.rounds,
        "mean_tokens_per_round": s.mean_tokens_per_round,
        "tokens_by_round": s.tokens_by_round,
        "drafted": s.drafted,
        "accepted": s.accepted,
        "tested": s.tested,
        "drafted_by_position": s.drafted_by_position,
        "accepted_by_position": s.accepted_by_position,
        "target_forwards": s.target_forwards,
        "drafter_forwards": s.drafter_forwards,
        "drafter_counts": s.extra,  # the drafter's own (re-tokenizing microseconds, lookahead's pool hits)
        "identical_to_autoregressive": (difference is None) if greedy else None,
        "first_difference": difference,
        "token_ids": g.token_ids,
        "text": encoder.decode(g.token_ids),
    }
