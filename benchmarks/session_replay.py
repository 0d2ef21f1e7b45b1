"""How well the session's earlier text drafts, replayed on answers the target wrote, without a model.

The answers (an answers.jsonl.gz of train_head.py; default: the ones the project ships) come one after another as a
session would hold them. At each position of each answer that prompt lookup leaves to the draft model (no copy of two
tokens or more in the context), the session text so far drafts a tree (`SessionText.draft`), and the target's own
next tokens (the answer) say how many of its drafts a greedy verify would accept. The rounds are counted by the length
of the match that drafted them: what `--session-match` weighs.

    python -m benchmarks.session_replay [--answers FILE] [--count N] [--out DIR]
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from pathlib import Path

from sampling.drafters.base import Draft
from sampling.drafters.prompt_lookup import PromptLookupDrafter
from sampling.drafters.session import KEY, SessionText

SHIPPED = Path(__file__).resolve().parents[1] / "heads" / "answers" / "qwen2.5-coder-1.5b.jsonl.gz"
DEPTH, NODES = 8, 13  # a round's draft: the loop's copy length, the verify width's nodes


def replay(answers: list[tuple[list[int], int]], min_copy: int = 2) -> dict[int, dict[str, int]]:
    """Per match length (16: 16 or more): the rounds it drafted, those whose first draft was right, drafts accepted;
    key 0 counts the rounds the session had no match for."""
    text, rows = SessionText(), {}
    for ids, start in answers:
        lookup = PromptLookupDrafter(3, 2, NODES)
        position = start
        while position < len(ids):
            context = ids[:position]
            if len(lookup.propose(context, DEPTH, None, None).line([])) >= min_copy:
                position += 1  # prompt lookup's round: not the session's to draft
                continue
            found = text.draft(context, DEPTH, NODES)
            row = rows.setdefault(found.matched if found else 0, {"rounds": 0, "first": 0, "accepted": 0})
            row["rounds"] += 1
            accepted = Draft(found.tokens, parents=found.parents).matching(ids[position:]) if found else 0
            row["first"] += accepted > 0
            row["accepted"] += accepted
            position += accepted + 1
        text.add(ids)
    return dict(sorted(rows.items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--answers", type=Path, default=SHIPPED)
    p.add_argument("--count", type=int, default=400, help="answers replayed, in a seed-0 shuffle")
    p.add_argument("--out", type=Path, help="a directory for replay.json")
    args = p.parse_args(argv)
    with gzip.open(args.answers, "rt", encoding="utf-8") as file:  # train_head.py's answers: {"start", "ids"} a line
        rows = [(row["ids"], int(row["start"])) for row in map(json.loads, file) if not row.get("read")]
    random.Random(0).shuffle(rows)
    table = replay(rows[: args.count])
    print("| match | rounds | first draft right | drafts accepted a round |\n|---|---|---|---|")
    for matched, row in table.items():
        if matched:
            print(f"| {matched} | {row['rounds']} | {row['first'] / row['rounds']:.0%} | "
                  f"{row['accepted'] / row['rounds']:.2f} |")
    print(f"({table.get(0, {}).get('rounds', 0)} rounds without a match of {KEY} tokens)")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "replay.json").write_text(json.dumps({"answers": str(args.answers), "count": args.count,
                                                          "by_match": table}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
