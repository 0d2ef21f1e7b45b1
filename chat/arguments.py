"""The slash-commands' arguments: numbers, switches, one word, a logits processor with its values; `UsageError`
for a wrong one (its message says what is expected)."""

from __future__ import annotations

import inspect

from app.settings import processor_params
from utils.logits_processor import PROCESSORS, LogitsProcessor

# What Tab completes for a command's argument (`Command.completes`), besides a tuple of the words it takes.
FILE = "file"
COMMAND = "command"
STRATEGY_LIST = "strategies"


class UsageError(ValueError):
    """A command's argument is wrong; the message says what is expected."""


def parse_int(text: str, what: str) -> int:
    """An integer argument; its bounds are the settings' own (SettingError, worded by `dispatch`)."""
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"{what} must be an integer, got {text!r}") from None


def parse_float(text: str, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise UsageError(f"{what} must be a number, got {text!r}") from None


def parse_switch(text: str, current: bool) -> bool:
    """on/off (and friends); no argument flips the current value."""
    word = text.strip().lower()
    if not word:
        return not current
    if word in ("on", "yes", "true", "1"):
        return True
    if word in ("off", "no", "false", "0"):
        return False
    raise UsageError(f"expected on or off, got {text!r}")


def one_word(text: str) -> str:
    if len(text.split()) > 1:
        raise UsageError(f"expected one value, got {text!r}")
    return text.strip()


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


# ---------------------------------------------------------------------------------------------
# Processors


def parse_processor(text: str) -> LogitsProcessor:
    """`NAME [VALUE ...] [key=value ...]`: values in the constructor's order, defaults for the rest."""
    words = text.split()
    name = words[0].lower()
    if name not in PROCESSORS:
        raise UsageError(f"unknown processor {words[0]!r}; choose from {', '.join(PROCESSORS)}")
    cls = PROCESSORS[name]
    params = {p.name: p for p in processor_params(cls)}
    positional = [w for w in words[1:] if "=" not in w]
    if len(positional) > len(params):
        expected = ", ".join(params) or "no values"
        raise UsageError(f"{name} takes {expected}; got {len(positional)} values")
    kwargs = {p: _number(w, params[p]) for p, w in zip(params, positional, strict=False)}
    for word in (w for w in words[1:] if "=" in w):
        key, _, value = word.partition("=")
        key = key.lower().replace("-", "_")
        if key not in params:
            raise UsageError(f"{name} has no parameter {key!r}; it takes {', '.join(params) or 'none'}")
        kwargs[key] = _number(value, params[key])
    return cls(**kwargs)


def _number(text: str, param: inspect.Parameter) -> float | int:
    """A processor value as its parameter's type; the processor checks its bounds."""
    if isinstance(param.default, int) and not isinstance(param.default, bool):
        return parse_int(text, param.name)
    return parse_float(text, param.name)
