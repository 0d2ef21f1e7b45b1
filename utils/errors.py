"""The one-line reason a loader message quotes from the exception that caused it."""

from __future__ import annotations


def first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    text = lines[0].strip() if lines else type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."
