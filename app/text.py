"""Text and token ids: a conversation through the tokenizer's chat template into prompt ids, and streamed ids back
into text a piece at a time. Written once here for the engine, the chat and the benchmark."""

from __future__ import annotations

from collections.abc import Sequence

from jinja2 import TemplateError


def chat_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` ({"role", "content"} dicts) through the tokenizer's chat template, ready for the
    assistant's answer. ValueError, one line, where the template rejects the conversation."""
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except (TemplateError, ValueError) as error:  # templates raise for what they do not support
        raise ValueError(f"the chat template rejected the conversation: {error}") from error
    # the template already wrote the special tokens it wants: adding the tokenizer's own would double a BOS
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class Detokenizer:
    """Turns a stream of token ids into a stream of text, decoding only a short window of recent tokens.

    `prefix` marks the start of the window (a few tokens of context, so tokenizers that strip a leading space see
    one), `read` the end of the tokens whose text is fully shown. New text is the decoded window minus the decoded
    context. A window ending in U+FFFD ends inside a multi-byte character split across tokens: the text before it
    is shown (`pending` characters of it), the rest waits for the tokens that complete the character.
    """

    def __init__(self, tokenizer, context_ids: Sequence[int] = (), context: int = 4):
        self.tokenizer = tokenizer
        self.ids = list(context_ids[-context:]) if context else []
        self.prefix = 0
        self.read = len(self.ids)
        self.pending = 0  # characters after the `read` tokens' text already shown

    def push(self, ids: list[int]) -> str:
        self.ids += ids
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end is shown as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        shown = self._decode(self.ids[self.prefix:self.read])
        new = self._decode(self.ids[self.prefix:])[len(shown):]
        if new.endswith("\ufffd") and not final:
            ready = new.rstrip("\ufffd")
            piece, self.pending = ready[self.pending:], max(self.pending, len(ready))
            return piece
        piece = new[self.pending:]
        self.prefix, self.read, self.pending = self.read, len(self.ids), 0
        return piece

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
