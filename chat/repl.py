"""The REPL: read a message, run a slash-command or a chat turn, repeat until /quit or Ctrl-D.

Input comes through `chat.editor`: a line editor on a terminal (a paste is one message, Alt+Enter adds a line, \"\"\"
blocks, Tab completion, history across sessions), plain lines from a pipe. Ctrl-C at the prompt clears the message
(and any text /read held for it); during a generation it stops the turn (see chat/turn.py for what is kept).
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from chat.commands import Outcome, build_commands, dispatch
from chat.completion import CommandCompleter
from chat.editor import LineReader, PipedReader, TerminalReader, is_terminal
from chat.message_commands import Pending
from chat.render import ConsoleView, banner, comparison_table, interrupt_notice, say, turn_rows, warn
from chat.session import ChatSession, ContextOverflow, ModelInfo
from chat.turn import Turn, run_turn
from chat.undecodable import accept_undecodable_stdin, notice, replace_undecodable


class ChatRepl:
    def __init__(self, session: ChatSession, console: Console, info: ModelInfo, history_file: Path | None = None,
                 compare: bool = True, debug: bool = False):
        self.session, self.console, self.info = session, console, info
        self.history_file = history_file
        self.compare, self.debug = compare, debug
        self.commands = build_commands()
        self.turns: list[Turn] = []  # everything asked this session (the model's history may have dropped some)
        self.earlier: list[dict] = []  # the turns of a conversation resumed with /load, as its file has them (/save)
        self.pending = Pending()

    def run(self, reader: LineReader | None = None) -> int:
        """Read and answer until /quit or the end of input; `reader` defaults to the terminal's editor, or to plain
        lines where standard input or output is not a terminal."""
        if reader is None:
            reader = self.terminal_reader() if is_terminal() else PipedReader()
        accept_undecodable_stdin()
        self.console.print(banner(self.info, self.session, self.compare))
        while (line := self.read(reader)) is not None:
            if self.handle(line) is Outcome.QUIT:
                break
        return 0

    def terminal_reader(self, **io) -> TerminalReader:
        """The line editor, completing this REPL's commands; `io`: prompt_toolkit's input and output (tests)."""
        color = self.console.is_terminal and not self.console.no_color
        return TerminalReader(CommandCompleter(lambda: self.commands), self.history_file, color=color, **io)

    def read(self, reader: LineReader) -> str | None:
        """One message, bytes that are not UTF-8 replaced; "" after Ctrl-C, None at the end of input."""
        try:
            line = reader.read(self._prompt())
        except KeyboardInterrupt:
            self.console.print()
            if self.pending:
                say(self.console, f"dropped the text read from {', '.join(self.pending.names)}", style="dim")
                self.pending = Pending()
            return ""
        except EOFError:
            self.console.print()
            return None
        line, undecodable = replace_undecodable(line)
        if undecodable:
            warn(self.console, notice("the line", undecodable))
        return line

    def handle(self, line: str) -> Outcome:
        text = line.strip()
        try:
            if text.startswith("/") and not text.startswith("//"):
                return dispatch(self, text)
            if text or self.pending:
                self.send(text.removeprefix("/"))
        except KeyboardInterrupt:  # between a generation and its table: the turn is already recorded
            self.console.print("interrupted", style="yellow")
        return Outcome.CONTINUE

    def send(self, text: str) -> Turn | None:
        """`text` after whatever /read held, as one message; the held text stays held where the turn failed."""
        pending, self.pending = self.pending, Pending()
        turn = self.ask(pending.before(text))
        if turn is None:
            self.pending = pending
        return turn

    def ask(self, text: str) -> Turn | None:
        settings = self.session.settings
        strategies = settings.strategies if self.compare else settings.strategies[:1]
        view = ConsoleView(self.console, self.session.tokenizer, self.session.end_ids, self.debug)
        try:
            turn = run_turn(self.session, text, view, strategies)
        except ContextOverflow as error:
            warn(self.console, error.advice("/length"))
            return None
        except ValueError as error:  # the chat template rejected the conversation, an empty prompt
            warn(self.console, str(error))
            return None
        except RuntimeError as error:  # out of memory and the like: this turn is lost, the session is not
            warn(self.console, f"generation failed: {error}")
            return None
        self.turns.append(turn)
        if len(turn.runs) > 1:
            self.console.print(comparison_table(turn_rows(turn), settings.processor.is_greedy,
                                                yardstick=self.info.yardstick))
        if turn.interrupted:
            warn(self.console, interrupt_notice(turn))
        return turn

    def regen(self) -> Turn | None:
        """The last message again with the current strategies and settings; its answer replaces the last one in the
        history (the caches are cropped back to the prompt, not refilled). Where no answer comes, the old one stays."""
        text = self.last_message()
        if text is None:
            return None
        taken = self.session.retract(text)
        turn = self.ask(text)
        if taken and (turn is None or turn.answer is None):
            self.session.restore(taken)
            say(self.console, "the previous answer stays in the history", style="dim")
        return turn

    def last_message(self) -> str | None:
        """What /regen sends again: the last message asked, or the last one of a resumed conversation."""
        if self.turns:
            return self.turns[-1].user
        history = self.session.history
        if len(history) >= 2 and history[-1].role == "assistant":
            return history[-2].content
        return None

    def _prompt(self) -> str:
        return f"you [{', '.join(self.pending.names)}] ›" if self.pending else "you ›"
