"""What the user sends, read as whole messages: a line editor on a terminal (prompt_toolkit), plain lines from a pipe.

On a terminal: Enter sends; Alt+Enter (or Esc then Enter) adds a line; a paste is one message whatever its newlines
(bracketed paste); a message that opens with \"\"\" goes on over Enter until a line ends with \"\"\" (for terminals
without bracketed paste); a line ending in a backslash goes on on the next; Tab completes commands, strategy names and
file paths; Up recalls earlier messages, kept across sessions in the history file.
From a pipe (not a terminal): one message a line, with the same \"\"\" blocks and backslash continuations.

Both readers hand back text in the REPL's own syntax, where a line starting with / is a command and // escapes it:
text that is a message by how it came (a \"\"\" block, a paste of several lines) and starts with / comes back
escaped, so a pasted path or comment is sent, not run. Both raise EOFError at the end of input (Ctrl-D) and
KeyboardInterrupt for Ctrl-C, as `input()` does.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from prompt_toolkit import PromptSession
from prompt_toolkit.completion import Completer
from prompt_toolkit.formatted_text import FormattedText
from prompt_toolkit.history import FileHistory
from prompt_toolkit.input import Input
from prompt_toolkit.key_binding import KeyBindings, KeyPressEvent
from prompt_toolkit.keys import Keys
from prompt_toolkit.output import Output

from chat.transcript import write_file

BLOCK = '"""'
HISTORY_ENTRIES = 1000  # the most messages Up recalls (and the history file keeps)


def block_open(text: str) -> bool:
    """Whether `text` opens a \"\"\" block that no later \"\"\" has closed yet."""
    text = text.strip()
    return text.startswith(BLOCK) and not (len(text) >= 2 * len(BLOCK) and text.endswith(BLOCK))


def unblock(text: str) -> str:
    """A message as the REPL reads it: a \"\"\" block's inside (escaped, it is text), anything else as it is."""
    stripped = text.strip()
    if not stripped.startswith(BLOCK):
        return text
    inside = stripped[len(BLOCK):]
    return as_text(inside.removesuffix(BLOCK) if inside.endswith(BLOCK) else inside)


def as_text(text: str) -> str:
    """`text` escaped so that the REPL sends it as a message even where it starts with a slash."""
    text = text.strip("\n")
    return "/" + text if text.lstrip().startswith("/") else text


class LineReader(Protocol):
    def read(self, prompt: str) -> str:
        """The next message; EOFError at the end of input, KeyboardInterrupt for Ctrl-C."""
        ...


class PipedReader:
    """Standard input that is not a terminal: a message a line (backslash continuations and \"\"\" blocks joined)."""

    def read(self, prompt: str) -> str:
        line = input(prompt + " ")
        while line.endswith("\\") or block_open(line):
            try:
                more = input("")
            except EOFError:  # input ended inside a block: what came is sent, not lost
                break
            line = (line[:-1] if line.endswith("\\") else line) + "\n" + more
        return unblock(line)


class TerminalReader:
    """prompt_toolkit's line editor; `input` and `output` default to the terminal (tests pass a pipe and a dummy)."""

    def __init__(self, completer: Completer | None = None, history_file: Path | None = None, color: bool = True,
                 input: Input | None = None, output: Output | None = None):
        self.color = color
        self.pasted = False  # the message began with a paste of several lines: it is text, whatever its first char
        history = None
        if history_file is not None:
            with contextlib.suppress(OSError):  # no writable place: recall still works within the session
                history = KeptHistory(history_file)
        self.prompt_session: PromptSession[str] = PromptSession(
            history=history, completer=completer, complete_while_typing=False, multiline=True,
            key_bindings=self._bindings(), prompt_continuation=self._continuation, input=input, output=output,
            enable_history_search=False, mouse_support=False)
        self.prompt_session.default_buffer.on_text_changed += self._emptied

    def _emptied(self, buffer) -> None:
        if not buffer.text:
            self.pasted = False  # what is typed next decides again

    def read(self, prompt: str) -> str:
        self.pasted = False
        style = "bold ansicyan" if self.color else ""
        text = self.prompt_session.prompt(FormattedText([(style, prompt), ("", " ")]))
        return as_text(text) if self.pasted else unblock(text)

    def _continuation(self, width: int, line_number: int, wrap_count: int) -> str:
        return "…".rjust(width - 1) + " "

    def _bindings(self) -> KeyBindings:
        bindings = KeyBindings()

        @bindings.add("enter")
        def _enter(event: KeyPressEvent) -> None:
            """Send, except where the message goes on: a chosen completion, a trailing backslash, an open block."""
            buffer = event.current_buffer
            if buffer.complete_state is not None and buffer.complete_state.current_completion is not None:
                buffer.complete_state = None  # Enter takes the completion (a directory's path goes on)
                return
            if buffer.document.is_cursor_at_the_end and buffer.text.endswith("\\"):
                buffer.delete_before_cursor(1)
                buffer.insert_text("\n")
            elif block_open(buffer.text):
                buffer.insert_text("\n")
            else:
                buffer.validate_and_handle()

        @bindings.add("escape", "enter")
        def _new_line(event: KeyPressEvent) -> None:
            event.current_buffer.insert_text("\n")

        @bindings.add(Keys.BracketedPaste)
        def _paste(event: KeyPressEvent) -> None:
            data = event.data.replace("\r\n", "\n").replace("\r", "\n")  # terminals paste lines ending in \r
            buffer = event.current_buffer
            if not buffer.text.strip() and "\n" in data.strip():
                self.pasted = True
            buffer.insert_text(data)

        return bindings


class KeptHistory(FileHistory):
    """prompt_toolkit's history file, which also reads one entry a line (the file readline wrote), keeps the last
    `HISTORY_ENTRIES`, and is rewritten in its own format when it held more or held lines of the old one."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        super().__init__(str(path))
        self.path = path

    def load_history_strings(self) -> Iterable[str]:
        try:
            lines = self.path.read_bytes().decode("utf-8", errors="replace").splitlines()
        except FileNotFoundError:
            return []
        entries: list[str] = []
        current: list[str] | None = None
        old_format = False
        for line in lines:
            if line.startswith("+"):
                current = (current or []) + [line[1:]]
                continue
            if current is not None:
                entries.append("\n".join(current))
                current = None
            if line and not line.startswith("#"):
                entries.append(line)  # readline's: one entry a line
                old_format = True
        if current is not None:
            entries.append("\n".join(current))
        kept = entries[-HISTORY_ENTRIES:]
        if old_format or len(kept) < len(entries):
            self._rewrite(kept)
        return list(reversed(kept))  # newest first

    def _rewrite(self, entries: list[str]) -> None:
        text = "".join("\n" + "".join(f"+{line}\n" for line in entry.split("\n")) for entry in entries)
        with contextlib.suppress(OSError):
            write_file(self.path, text, replace=True)


def is_terminal() -> bool:
    """Whether the chat talks to a person at a terminal (else it reads lines, as from a script)."""
    return sys.stdin.isatty() and sys.stdout.isatty() and os.environ.get("TERM") != "dumb"
