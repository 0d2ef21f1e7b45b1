"""specchat's Python face: `from app import Engine` (app/engine.py).

The name is looked up on first use, so that the scripts' flag modules (app.flags, app.settings) load without torch
and answer --help or a bad flag at once."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.engine import Engine, Reply, ReplyStats, Stream

__all__ = ["Engine", "Reply", "ReplyStats", "Stream"]


def __getattr__(name: str):
    if name in __all__:
        from app import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'app' has no attribute {name!r}")
