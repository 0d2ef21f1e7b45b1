"""Input whose bytes are not UTF-8: Python hands such bytes over as lone surrogates ("surrogateescape", on the command
line always, on standard input as `accept_undecodable_stdin` sets it), which no tokenizer encodes. They are replaced by
U+FFFD, and the user is told once per line."""

from __future__ import annotations

import io
import re
import sys

REPLACEMENT = "\ufffd"
_SURROGATES = re.compile("[\ud800-\udfff]")


def replace_undecodable(text: str) -> tuple[str, int]:
    """`text` with every lone surrogate (an undecodable byte) replaced by U+FFFD, and how many there were."""
    return _SURROGATES.subn(REPLACEMENT, text)


def notice(where: str, count: int) -> str:
    return f"{where} had {count} invalid UTF-8 byte{'s' * (count != 1)}: replaced by {REPLACEMENT} (send UTF-8 text)"


def accept_undecodable_stdin() -> None:
    """Read invalid UTF-8 on standard input as surrogates instead of raising UnicodeDecodeError (which would end the
    chat and lose the rest of the input); `replace_undecodable` then cleans each line."""
    if isinstance(sys.stdin, io.TextIOWrapper) and sys.stdin.errors == "strict":
        sys.stdin.reconfigure(errors="surrogateescape")
