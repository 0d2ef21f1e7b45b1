"""Tokens of one tokenizer as tokens of another, through text: what a drafter with its own vocabulary needs to
draft for the target (the committed target tokens as its context, its drafted tokens as the target's).

Each direction decodes a look-behind window of tokens before the new ones and keeps the text after the window's
own, so that a word split across the boundary, a leading space and the bytes of one character split over tokens
come out as whole text. The chat templates' markers are swapped on the way (`template_markers`). Nothing here can
change an output: the target verifies every drafted token as its own.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

REPLACEMENT = "\ufffd"  # what a decode gives for the first bytes of a character whose last bytes are still to come
SENTINELS = ("\x01", "\x02", "\x03", "\x04")  # probe contents that no template writes itself


def template_markers(source: PreTrainedTokenizerBase, dest: PreTrainedTokenizerBase) -> list[tuple[str, str]]:
    """(source text, dest text) for each piece of chat-template text that differs between the two templates: what
    each writes around a system, user and assistant message and before the reply; longest first. Empty where either
    has no template, or their conversations do not line up piece for piece."""
    pieces = [_template_pieces(tokenizer) for tokenizer in (source, dest)]
    if None in pieces or len(pieces[0] or ()) != len(pieces[1] or ()):
        return []
    pairs = {a: b for a, b in zip(pieces[0] or (), pieces[1] or (), strict=True) if a and a != b}
    return sorted(pairs.items(), key=lambda pair: -len(pair[0]))


def _template_pieces(tokenizer: PreTrainedTokenizerBase) -> list[str] | None:
    if not tokenizer.chat_template:
        return None
    roles = ("system", "user", "assistant", "user")
    for first in (0, 1):  # some templates refuse a system message: then the conversation starts with the user
        messages = [{"role": role, "content": text} for role, text in zip(roles, SENTINELS, strict=True)][first:]
        try:
            rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 (a template raises whatever it likes on a conversation it refuses)
            continue
        if not isinstance(rendered, str) or any(s not in rendered for s in SENTINELS[first:]):
            continue
        pieces = []
        for sentinel in SENTINELS[first:]:
            before, rendered = rendered.split(sentinel, 1)
            pieces.append(before)
        return [""] * first + pieces + [rendered]
    return None


def swap(text: str, markers: list[tuple[str, str]]) -> str:
    for old, new in markers:
        text = text.replace(old, new)
    return text


def text_after(tokenizer: PreTrainedTokenizerBase, ids: list[int], start: int, window: int) -> str:
    """The text `ids[start:]` adds to `ids[:start]`, read with `window` tokens before it. It ends in REPLACEMENT
    where its last tokens hold only the first bytes of a character."""
    behind = ids[max(start - window, 0): start]
    before, whole = decode(tokenizer, behind), decode(tokenizer, behind + ids[start:])
    if not whole.startswith(before):  # the window's own text changed with what followed: take the new tokens alone
        return decode(tokenizer, ids[start:])
    return whole[len(before):]


def decode(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    text = tokenizer.decode(ids)
    assert isinstance(text, str)  # one sequence in, one string out
    return text


@dataclass
class Retokenizer:
    """One drafter's view of the target's tokens. `context` gives the drafter's tokens for the committed target
    tokens, decoding and encoding again only what is new; `draft` gives the target's tokens for chains of the
    drafter's tokens after that context. `seconds` is the time spent in both."""

    target: PreTrainedTokenizerBase
    drafter: PreTrainedTokenizerBase
    window: int = 8  # tokens read before the new ones, both ways
    seconds: float = 0.0
    _target_ids: list[int] = field(default_factory=list)  # the committed target tokens last seen
    _settled: int = 0  # how many of them `_settled_text` holds whole (the rest may end inside a character)
    _settled_text: str = ""  # their text, with the drafter's template markers
    _drafter_ids: list[int] = field(default_factory=list)  # the drafter's tokens for the text last seen
    _starts: list[int] = field(default_factory=list)  # where each of them starts in that text
    _ends: list[int] = field(default_factory=list)  # and ends

    def __post_init__(self):
        markers = template_markers(self.target, self.drafter)
        self.to_drafter, self.to_target = markers, [(new, old) for old, new in markers]

    def context(self, target_ids: list[int]) -> list[int]:
        """The drafter's tokens for the committed `target_ids`."""
        started = time.perf_counter()
        if target_ids[: len(self._target_ids)] != self._target_ids:  # not an extension: read it all again
            self._settled, self._settled_text, self._drafter_ids, self._starts, self._ends = 0, "", [], [], []
        unchanged = len(self._settled_text)
        piece = swap(text_after(self.target, target_ids, self._settled, self.window), self.to_drafter)
        text = self._settled_text + piece.rstrip(REPLACEMENT)
        if not piece.endswith(REPLACEMENT):
            self._settled, self._settled_text = len(target_ids), text
        self._target_ids = list(target_ids)
        self._encode_from(text, unchanged)
        self.seconds += time.perf_counter() - started
        return list(self._drafter_ids)

    def draft(self, target_ids: list[int], chains: list[list[int]]) -> list[list[int]]:
        """Each chain of drafter tokens (after `context(target_ids)`'s tokens) as the target tokens that follow
        `target_ids`: the chain's text re-encoded after the last committed tokens' own."""
        started = time.perf_counter()
        behind = target_ids[-self.window:]
        before = decode(self.target, behind)
        drafts, tail = [], self._drafter_ids[-self.window:]  # the look-behind only: no copy of the whole context
        for chain in chains:
            text = text_after(self.drafter, tail + chain, len(tail), self.window)
            text = swap(text.rstrip(REPLACEMENT), self.to_target)
            ids = self.target.encode(before + text, add_special_tokens=False)
            # Where the committed tokens' text is encoded as themselves again, the draft is what follows; where the
            # new text merges into the last committed token, the target can only go on after it: the text alone.
            drafts.append(ids[len(behind):] if ids[: len(behind)] == behind
                          else self.target.encode(text, add_special_tokens=False))
        self.seconds += time.perf_counter() - started
        return drafts

    def _encode_from(self, text: str, unchanged: int) -> None:
        """Make `_drafter_ids` the tokens of `text`, whose first `unchanged` characters are as before: the tokens
        ending a little before that stay, cut where a whitespace follows (else where the next token starts a
        character of its own); the rest is encoded again."""
        keep = max(bisect.bisect_right(self._ends, unchanged) - 2, 0)  # the last two may merge with what changed
        cuts = [i for i in range(keep, max(keep - self.window, 0), -1)
                if self._starts[i] >= self._ends[i - 1]]  # not inside a character that two byte tokens share
        spaced = [i for i in cuts if text[self._ends[i - 1]: self._ends[i - 1] + 1].isspace()]
        keep = (spaced or cuts or [0])[0]
        start = self._ends[keep - 1] if keep else 0
        encoded = self.drafter(text[start:], add_special_tokens=False, return_offsets_mapping=True)
        offsets = encoded["offset_mapping"]
        self._drafter_ids, self._starts, self._ends = (  # together: a Ctrl-C leaves the three lists in step
            self._drafter_ids[:keep] + list(encoded["input_ids"]),
            self._starts[:keep] + [start + begin for begin, _ in offsets],
            self._ends[:keep] + [start + end for _, end in offsets])
