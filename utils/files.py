"""Files that outlive an interruption and a second process: written whole or not at all; directories locked in use.

POSIX only (fcntl), as the rest of the project's file handling assumes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path


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
