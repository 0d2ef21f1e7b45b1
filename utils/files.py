"""Files that outlive an interruption and a second process: written whole or not at all, records read back checked;
directories locked in use.

POSIX only (fcntl), as the rest of the project's file handling assumes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any, TypeVar, cast

from utils.errors import one_line

T = TypeVar("T")


class Busy(Exception):
    """Another process holds the lock."""


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """`write(temporary)` beside `path`, then the temporary moved onto it (os.replace): whoever reads `path`, even
    after a Ctrl-C or a crash mid-write, finds the old file or the whole new one, never a part."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(temporary)
        with open(temporary, "rb+") as written:
            os.fsync(written.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def key_file(cache_dir: Path, key: dict, kind: str = "") -> Path:
    """Where a record of `kind` kept for `key` (what it holds for: machine, versions, models) lives in the cache dir."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir / "calibration" / f"{digest}{'.' + kind if kind else ''}.json"


def write_record(path: Path, record: dict) -> None:
    """`record` as JSON at `path`, whole or not at all (its directory made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(record, indent=1) + "\n"

    def write(partial: Path) -> None:
        partial.write_text(text, encoding="utf-8")

    write_atomically(path, write)


KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "a JSON object",
         list: "a JSON array"}  # as a kept record's reader names what it expected


def read_record(path: Path, key: dict, parse: Callable[[dict], T], what: str, schema: int | None = None,
                again: str = "measured again") -> tuple[T | None, str | None]:
    """What `parse` makes of the record kept at `path` for `key`, and what was wrong with one that cannot serve.

    (None, None): none is kept, or the record holds for another key or `schema` (replaced without a word). (None, one
    line naming the file, what was wrong and that it is measured `again`): the file is damaged, or `parse` refused a
    value (ValueError, TypeError, KeyError: `checked` says which and why)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as error:
        return None, f"unreadable kept {what} in {path} ({type(error).__name__}): {again}"
    kept_key = json.loads(json.dumps(key))  # the key as JSON gives it back: a tuple as a list
    if not isinstance(data, dict) or data.get("key") != kept_key or schema not in (None, data.get("schema")):
        return None, None
    try:
        return parse(data), None
    except (ValueError, TypeError, KeyError) as error:
        reason = f"no {error.args[0]!r}" if isinstance(error, KeyError) else one_line(error)
        return None, f"unusable kept {what} in {path} ({reason}): {again}"


def checked(name: str, value: Any, kind: type[T], bounds: tuple[float, float] | None = None,
            among: Collection | None = None) -> T:
    """`value` if it is a `kind` (a bool is no number, an int is a float) within `bounds` (inclusive, finite) and
    among `among`; else TypeError or ValueError naming it: a kept record's values are read through this."""
    accepted = (int, float) if kind is float else kind
    read: Any = value  # its type is `kind`, known at run time only
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, accepted):
        raise TypeError(f"{name} must be {KINDS.get(kind, kind.__name__)}, not {value!r}")
    if bounds is not None and not (math.isfinite(read) and bounds[0] <= read <= bounds[1]):
        raise ValueError(f"{name} must be from {bounds[0]:g} to {bounds[1]:g}, not {value!r}")
    if among is not None and value not in among:
        raise ValueError(f"{name} must be one of {', '.join(map(str, among))}, not {value!r}")
    return cast(T, float(read) if kind is float else read)


@contextlib.contextmanager
def exclusive(directory: Path, wait: bool = True, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold an exclusive lock on `directory` (made if absent): the directory itself is locked, so no lock file is
    left in it, nor one that a process deleting it would let two others lock at once.

    When another process holds it: with `wait`, `on_wait()` once, then block until it is released; else raise Busy.
    The system releases the lock when its holder ends, however it ends, so a killed process leaves none behind."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                raise Busy(str(directory)) from None
            if on_wait is not None:
                on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
