"""3. Held-out: the prompts kept out are drafted by the project's own drafter over the stored features; tokens per
target step, chain and tree."""

from __future__ import annotations

import math
import time


class StoredFeatures:
    """A stand-in for the target's cached model over one stored sequence: what the head drafters read."""

    max_length = 1 << 31

    def __init__(self, ids: list[int], features):
        self.all_ids, self.features = ids, features
        self.tokens: list[int] = []

    def keep_hidden(self) -> None:
        pass

    def at(self, length: int) -> None:
        self.tokens = self.all_ids[: length - 1]

    @property
    def hidden(self):
        return self.features[: len(self.tokens)]


def held_out_tokens_per_step(head, rows: list[dict], depth: int, tree: int, branch: int, limit: int = 1200,
                             seconds: float = math.inf) -> dict[str, float | int]:
    """Mean tokens per target step, greedy, when the drafter drafts at each answer position of `rows` (the answer
    being the target's own greedy text, a draft is accepted as far as it matches it); at most `limit` positions and
    half of `seconds` each for the chain and the tree (`positions`: the fewer they had)."""
    from sampling.heads.eagle import EagleDrafter
    from sampling.heads.medusa import MedusaDrafter
    from utils.logits_processor import GreedyProcessor

    results: dict[str, float | int] = {"positions": limit}
    for name, width in (("chain", 1), ("tree", branch)):
        steps = accepted = 0
        deadline = time.monotonic() + seconds / 2
        for row in rows:
            ids = row["ids"].tolist()
            stored = StoredFeatures(ids, row["features"].float())
            make = EagleDrafter if head.config.kind == "eagle" else MedusaDrafter
            drafter = make(stored, head, width, depth if name == "chain" else tree)
            for n in range(max(row["start"], 2), len(ids)):
                if steps >= limit or time.monotonic() >= deadline:
                    break
                stored.at(n)
                draft = drafter.propose(ids[:n], depth, GreedyProcessor(), None)
                accepted += draft.matching(ids[n:])
                steps += 1
        results[f"{name}_tokens_per_step"] = round(1 + accepted / max(steps, 1), 3)
        results["positions"] = min(results["positions"], steps)
    return results
