"""The project's own errors, and the one-line reason a message quotes from the exception that caused it."""

from __future__ import annotations

REASON_CHARS = 400


class ModelLoadError(Exception):
    """A model could not be loaded. The message says what was tried and how to fix it."""


def one_line(error: BaseException) -> str:
    """`error`'s whole message on one line, capped at `REASON_CHARS`.

    why the whole message: transformers often ends its first line with "one of:" and gives the cause below it."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 3] + "..."
