"""Prompt sets in the SpecBench / MT-bench layout (one JSON object per line with `category` and `turns`), and a
conversation's token ids: what the benchmark measures on and a draft head is trained on."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from utils.checks import integer


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    turns: tuple[str, ...]  # user turns; a multi-turn prompt answers each before the next is asked


def load_prompts(path: Path | str, categories: list[str] | None = None,
                 limit: int | None = None, default_category: str | None = None) -> list[Prompt]:
    """The prompts of a JSONL file, in file order; `categories` keeps those, `limit` keeps at most that many per
    category (so a limited run still covers every category). A line without `category` gets `default_category`
    (None: it needs one).

    Raises FileNotFoundError for a missing file, ValueError (one line, naming the file) for any other bad one."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no prompt file at {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text: give a JSONL prompt file (one JSON object per line)") from None
    except OSError as error:
        raise ValueError(f"cannot read the prompt file {path}: {error.strerror or error}") from None
    prompts = [_parse(line, path, n, default_category) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if categories:
        unknown = sorted(set(categories) - {p.category for p in prompts})
        if unknown:
            known = ", ".join(sorted({p.category for p in prompts}))
            raise ValueError(f"no prompts of categories {', '.join(unknown)} in {path}; it has {known}")
        prompts = [p for p in prompts if p.category in categories]
    if limit is not None:
        limit = integer("limit", limit, 1)
        taken: Counter[str] = Counter()
        kept = []
        for p in prompts:
            if taken[p.category] < limit:
                taken[p.category] += 1
                kept.append(p)
        prompts = kept
    return prompts


def count_by_category(prompts: list[Prompt]) -> dict[str, int]:
    return dict(Counter(p.category for p in prompts))


def _parse(line: str, path: Path, number: int, default_category: str | None) -> Prompt:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{number}: not JSON ({e})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}:{number}: not a JSON object: each line must be one object such as "
                         '{"turns": ["..."]}')
    turns = record.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
        raise ValueError(f"{path}:{number}: `turns` must be a non-empty list of strings")
    category = record.get("category", default_category)
    if not isinstance(category, str) or not category:
        raise ValueError(f"{path}:{number}: `category` must be a non-empty string")
    return Prompt(str(record.get("question_id", number)), category, tuple(turns))
