"""Server-sent events as OpenAI streams them: one `data: <json>` event per chunk, then `data: [DONE]`."""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy holds the events back


def event(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
