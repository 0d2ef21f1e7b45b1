"""Drafts from the whole session: every prompt and answer of a chat (or a server's requests) so far, indexed so that
the end of the context finds where it occurred before and what followed it there, each continuation weighed by how
often it followed (SuffixDecoding's idea, over n-grams instead of a suffix tree).

The context's own text is prompt lookup's (sampling/drafters/prompt_lookup.py); this reaches the text that is no longer
in the context: earlier conversations, other requests, turns dropped from a long chat. Its owner decides what goes in
(`SessionText.add`), once a turn is over: a turn's runs under several strategies all draft from the same text, so
that the live comparison does not hand one strategy another's answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from utils.checks import integer

END = -1  # between two documents: no continuation runs across it


@dataclass(frozen=True)
class Continuations:
    """A tree of continuations (`parents` as `Draft`'s), each node's `weights` the share of the matched occurrences it
    followed; `expected`, their sum, is the tokens the target is expected to accept where it agrees as often."""

    tokens: list[int]
    parents: list[int]
    weights: list[float]
    matched: int  # the context's tokens that matched

    @property
    def expected(self) -> float:
        return sum(self.weights)


class SessionText:
    """Documents of token ids, each n-gram of `min_match`..`max_match` tokens indexed to where it occurred; a draft
    follows the longest n-gram at the end of the context found here, over its `occurrences` most recent occurrences."""

    def __init__(self, min_match: int = 2, max_match: int = 16, occurrences: int = 64):
        self.min_match = integer("min_match", min_match, 1)
        self.max_match = integer("max_match", max_match, self.min_match)
        self.occurrences = integer("occurrences", occurrences, 1)
        self.clear()

    def clear(self) -> None:
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions just after its occurrences, oldest first
        self.documents = 0

    def __len__(self) -> int:
        """The tokens held (without the marks between documents)."""
        return len(self.tokens) - self.documents

    def add(self, ids: list[int]) -> None:
        """One more document: a prompt and its answer, as the model saw them."""
        if not ids:
            return
        start = len(self.tokens)
        self.tokens += list(ids)
        self.tokens.append(END)
        self.documents += 1
        for end in range(start + 1, len(self.tokens) - 1):  # each n-gram followed by a token of the same document
            for size in range(self.min_match, min(self.max_match, end - start) + 1):
                self.ends.setdefault(tuple(self.tokens[end - size:end]), []).append(end)

    def draft(self, context: list[int], depth: int, nodes: int, at_least: int = 1,
              min_weight: float = 0.0) -> Continuations | None:
        """The continuations of the longest n-gram ending `context` that occurred here: a tree of at most `nodes`
        tokens and `depth` levels, the most frequent first, none followed by under `min_weight` of the occurrences;
        None where no n-gram of `at_least` tokens (and `min_match`) or more occurred, or nothing followed it."""
        lowest = max(self.min_match, at_least)
        for size in range(min(self.max_match, len(context)), lowest - 1, -1):
            ends = self.ends.get(tuple(context[-size:]))
            if ends:
                found = self._tree(ends[-self.occurrences:], size, max(depth, 0), nodes, min_weight)
                return found if found.tokens else None
        return None

    def _tree(self, ends: list[int], matched: int, depth: int, nodes: int, min_weight: float) -> Continuations:
        counts: dict[tuple[int, ...], int] = {}  # a continuation's first tokens -> the occurrences it began
        for end in ends:
            for length in range(1, depth + 1):
                token = self.tokens[end + length - 1]
                if token == END:
                    break
                key = tuple(self.tokens[end:end + length])
                counts[key] = counts.get(key, 0) + 1
        # A prefix counts at least as much as what extends it: sorted by count, then length, every node's parent
        # comes before it, and is kept wherever it is.
        ranked = sorted(counts, key=lambda key: (-counts[key], len(key)))
        chosen = [key for key in ranked if counts[key] >= min_weight * len(ends)][:nodes]
        index = {key: i for i, key in enumerate(chosen)}
        return Continuations([key[-1] for key in chosen], [index.get(key[:-1], -1) for key in chosen],
                            [counts[key] / len(ends) for key in chosen], matched)
