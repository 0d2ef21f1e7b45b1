"""Checks of the paths a command line is given, made before anything loads (plain Python, no torch)."""

from __future__ import annotations

import os
from pathlib import Path


def output_dir_problem(path: Path, flag: str = "--out") -> str | None:
    """Why `path` cannot be the output directory (one line, with the fix), or None where it can be (made if absent)."""
    existing = next(p for p in (path, *path.parents) if p.exists() or p == p.parent)
    if not existing.is_dir():
        where = "is a file" if existing == path else f"lies under the file {existing}"
        return f"{flag} {path} {where}, not a directory: give a directory path"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{flag} {path}: {existing} is not writable: give a directory you can write to"
    return None


def default_cache_dir() -> Path:
    """Where converted models, calibrations and built kernels are kept."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specchat"
