"""The bounds checks every settings dataclass uses: one phrasing of "an integer >= n" and "a number in [a, b)".

Plain Python, importable without torch: the command lines check their flags with these before loading anything.
"""

from __future__ import annotations

import math
import operator


class SettingError(ValueError):
    """A setting is out of bounds. `setting` names it as the code does (`top_p`); a command line puts its flag's name
    in front of `requirement` instead (`str(error)` is "top_p must be a number in (0, 1], got 2.0")."""

    def __init__(self, setting: str, requirement: str, value):
        self.setting, self.requirement, self.value = setting, requirement, value
        super().__init__(f"{setting} {requirement}, got {value!r}")


def integer(setting: str, value, low: int, high: int | None = None) -> int:
    """`value` as an int, if it is an integer (not a bool, not a float) from `low` to `high` (None: no upper bound)."""
    bounds = f">= {low}" if high is None else f"from {low} to {high}"
    try:
        number = operator.index(value)
    except TypeError:
        number = None
    if isinstance(value, bool) or number is None or number < low or (high is not None and number > high):
        raise SettingError(setting, f"must be an integer {bounds}", value)
    return number


def number(setting: str, value, low: float, high: float = math.inf, low_open: bool = False,
           high_open: bool = False, hint: str = "") -> float:
    """`value` as a float, if it is a finite number in the interval from `low` to `high` (open where asked).

    `hint` follows the requirement in the message (", use 0 for greedy")."""
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    at_least = f"must be a finite number {'>' if low_open else '>='} {low:g}"
    requirement = at_least if high == math.inf else f"must be a number in {interval}"
    if low == -math.inf and high == math.inf:
        requirement = "must be a finite number"
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise SettingError(setting, requirement + hint, value) from None
    inside = (low < x if low_open else low <= x) and (x < high if high_open else x <= high)
    if isinstance(value, bool) or not math.isfinite(x) or not inside:
        raise SettingError(setting, requirement + hint, value)
    return x


def choice(setting: str, value, choices: tuple) -> None:
    if value not in choices:
        raise SettingError(setting, f"must be one of {', '.join(map(str, choices))}", value)


def switch(setting: str, value) -> None:
    if not isinstance(value, bool):
        raise SettingError(setting, "must be True or False", value)
