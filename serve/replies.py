"""The response bodies in OpenAI's shapes, from the engine's Reply and its stats: a whole chat completion or text
completion, or the chunks of a streamed one. Each carries `usage` and llama.cpp's `timings` (with its speculation
counts `draft_n` and `draft_n_accepted`), which the measuring harnesses read."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any


def timings(stats: Any) -> dict[str, float | int]:
    """llama-server's per-request timings: the prompt's prefill, the generation after it, and the drafts."""
    prompt_n, predicted_n = stats.prompt_tokens, stats.new_tokens
    prompt_ms, predicted_ms = stats.prompt_seconds * 1e3, stats.decode_seconds * 1e3
    return {"prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": prompt_n / prompt_ms * 1e3 if prompt_ms > 0 else 0.0,
            "predicted_n": predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
            "predicted_per_second": predicted_n / predicted_ms * 1e3 if predicted_ms > 0 else 0.0,
            "draft_n": stats.drafted or 0, "draft_n_accepted": stats.accepted or 0}


def usage(stats: Any) -> dict[str, int]:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens}


def extension(stats: Any) -> dict[str, Any]:
    """What the `specchat` extension reports back: the strategy that ran and its rounds."""
    return {"strategy": stats.strategy, "rounds": stats.rounds}


@dataclass
class Shape:
    """One response's identity (id, creation time, model name) and its bodies."""

    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    object = ""
    chunk_object = ""
    prefix = ""

    def __post_init__(self):
        self.id = self.id or f"{self.prefix}-{uuid.uuid4().hex}"

    def _envelope(self, obj: str, choices: list[dict]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _totals(self, reply: Any) -> dict[str, Any]:
        return {"usage": usage(reply.stats), "timings": timings(reply.stats), "specchat": extension(reply.stats)}

    def whole(self, reply: Any) -> dict[str, Any]:
        raise NotImplementedError

    def opening(self) -> dict[str, Any] | None:
        """The first chunk of a stream, before any text (None: none)."""
        return None

    def piece(self, text: str) -> dict[str, Any]:
        raise NotImplementedError

    def closing(self, reply: Any) -> dict[str, Any]:
        """The last chunk with choices: the finish reason, with the timings (as llama-server sends them)."""
        raise NotImplementedError

    def usage_chunk(self, reply: Any) -> dict[str, Any]:
        """stream_options.include_usage: one more chunk, with no choices and the usage."""
        return {**self._envelope(self.chunk_object, []), **self._totals(reply)}


class ChatShape(Shape):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    prefix = "chatcmpl"

    def whole(self, reply: Any) -> dict[str, Any]:
        choice = {"index": 0, "message": {"role": "assistant", "content": reply.text}, "logprobs": None,
                  "finish_reason": reply.finish_reason}
        return {**self._envelope(self.object, [choice]), **self._totals(reply)}

    def _chunk(self, delta: dict[str, str], finish_reason: str | None) -> dict[str, Any]:
        return self._envelope(self.chunk_object,
                              [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}])

    def opening(self) -> dict[str, Any]:
        return self._chunk({"role": "assistant", "content": ""}, None)

    def piece(self, text: str) -> dict[str, Any]:
        return self._chunk({"content": text}, None)

    def closing(self, reply: Any) -> dict[str, Any]:
        return {**self._chunk({}, reply.finish_reason), "timings": timings(reply.stats),
                "specchat": extension(reply.stats)}


class CompletionShape(Shape):
    object = "text_completion"
    chunk_object = "text_completion"
    prefix = "cmpl"

    def _choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def whole(self, reply: Any) -> dict[str, Any]:
        return {**self._envelope(self.object, [self._choice(reply.text, reply.finish_reason)]), **self._totals(reply)}

    def piece(self, text: str) -> dict[str, Any]:
        return self._envelope(self.object, [self._choice(text, None)])

    def closing(self, reply: Any) -> dict[str, Any]:
        return {**self._envelope(self.object, [self._choice("", reply.finish_reason)]),
                "timings": timings(reply.stats), "specchat": extension(reply.stats)}
