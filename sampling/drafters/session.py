"""Drafts from the whole session: every prompt and answer of a chat (or a server's requests) so far, indexed so that
the end of the context finds where it occurred before and what followed it there, each continuation weighed by how
often it followed (SuffixDecoding's idea, over n-grams instead of a suffix tree).

Each position is indexed by the KEY tokens before it; a match found there is measured back, token by token, up to
LONGEST. The text is bounded (MAX_TOKENS, the oldest documents leave first): a server's session does not end.

The context's own text is prompt lookup's (sampling/drafters/prompt_lookup.py); this reaches the text that is no longer
in the context: earlier conversations, other requests, turns dropped from a long chat. Its owner decides what goes in
(`SessionText.add`), once a turn is over: a turn's runs under several strategies all draft from the same text, so
that the live comparison does not hand one strategy another's answer.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from utils.checks import integer

END = -1  # between two documents: no match or continuation runs across it
KEY = 4  # the tokens a position is indexed by: the shortest match
LONGEST = 16  # a match is measured back this far at most
CANDIDATES = 256  # the most recent occurrences of the last KEY tokens measured back, each draft
MAX_TOKENS = 1 << 16  # the most tokens held (a few MB of index); past it the oldest documents go, down to 3/4 of it


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
    """Documents of token ids, each position indexed by the KEY tokens before it; a draft follows the longest match of
    the context's end (KEY to LONGEST tokens) over its `occurrences` most recent occurrences of that length."""

    def __init__(self, occurrences: int = 64, max_tokens: int = MAX_TOKENS):
        self.occurrences = integer("occurrences", occurrences, 1)
        self.max_tokens = integer("max_tokens", max_tokens, 1)
        self.clear()

    def clear(self) -> None:
        self.tokens: list[int] = []  # the documents, each followed by END
        self.ends: dict[tuple[int, ...], list[int]] = {}  # KEY tokens -> the positions after them, oldest first
        self.kept: deque[list[int]] = deque()  # the documents, oldest first

    @property
    def documents(self) -> int:
        return len(self.kept)

    def __len__(self) -> int:
        """The tokens held (without the marks between documents)."""
        return len(self.tokens) - len(self.kept)

    def add(self, ids: list[int]) -> None:
        """One more document: a prompt and its answer, as the model saw them (its last max_tokens at most)."""
        ids = list(ids)[-self.max_tokens:]
        if not ids:
            return
        if len(self) + len(ids) > self.max_tokens:
            held = len(self)
            while self.kept and held + len(ids) > self.max_tokens * 3 // 4:
                held -= len(self.kept.popleft())
            kept = list(self.kept)
            self.clear()
            for document in kept:
                self._index(document)
        self._index(ids)

    def _index(self, ids: list[int]) -> None:
        start = len(self.tokens)
        self.tokens += ids
        self.tokens.append(END)
        self.kept.append(ids)
        for end in range(start + KEY, start + len(ids)):  # the KEY tokens before it and itself in the document
            self.ends.setdefault(tuple(self.tokens[end - KEY:end]), []).append(end)

    def draft(self, context: list[int], depth: int, nodes: int, at_least: int = KEY) -> Continuations | None:
        """The continuations of the longest match of the end of `context` (KEY to LONGEST tokens): a tree of at most
        `nodes` tokens and `depth` levels, the most frequent first; None where no match of `at_least` tokens or more
        is here, or nothing followed it."""
        if len(context) < KEY:
            return None
        ends = self.ends.get(tuple(context[-KEY:]))
        if not ends:
            return None
        best, chosen = 0, []
        for end in reversed(ends[-CANDIDATES:]):  # the most recent first
            length = self._matched(end, context)
            if length > best:
                best, chosen = length, [end]
            elif length == best:
                chosen.append(end)
        if best < at_least:
            return None
        found = self._tree(chosen[: self.occurrences], best, max(depth, 0), nodes)
        return found if found.tokens else None

    def _matched(self, end: int, context: list[int]) -> int:
        """How many tokens before position `end` equal the end of `context` (KEY at least, LONGEST at most)."""
        length = KEY
        while (length < min(LONGEST, len(context)) and end - length - 1 >= 0
               and self.tokens[end - length - 1] == context[-length - 1]):  # END equals no token: stops there
            length += 1
        return length

    def _tree(self, ends: list[int], matched: int, depth: int, nodes: int) -> Continuations:
        counts: dict[tuple[int, ...], int] = {}  # a continuation's first tokens -> the occurrences it began
        for end in ends:
            for length in range(1, depth + 1):
                if self.tokens[end + length - 1] == END:
                    break
                key = tuple(self.tokens[end:end + length])
                counts[key] = counts.get(key, 0) + 1
        # A prefix counts at least as much as what extends it: sorted by count, then length, every node's parent
        # comes before it, and is kept wherever it is.
        chosen = sorted(counts, key=lambda key: (-counts[key], len(key)))[:nodes]
        index = {key: i for i, key in enumerate(chosen)}
        return Continuations([key[-1] for key in chosen], [index.get(key[:-1], -1) for key in chosen],
                            [counts[key] / len(ends) for key in chosen], matched)
