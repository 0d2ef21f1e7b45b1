"""The REPL: read a line, run a slash-command or a chat turn, repeat until /quit or Ctrl-D.

Ctrl-C at the prompt clears the line; during a generation it stops the turn (see chat/turn.py for what is kept).
Up-arrow recalls earlier prompts through `readline`, with the history in a file when one is given.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from chat.commands import Outcome, build_commands, dispatch
from chat.render import ConsoleView, banner, comparison_table, interrupt_notice, turn_rows, warn
from chat.session import ChatSession, ContextOverflow, ModelInfo
from chat.turn import Turn, run_turn
from chat.undecodable import accept_undecodable_stdin, notice, replace_undecodable

HISTORY_LINES = 1000


class ChatApp:
    def __init__(self, session: ChatSession, console: Console, info: ModelInfo, history_file: Path | None = None,
                 compare: bool = True, debug: bool = False):
        self.session, self.console, self.info = session, console, info
        self.history_file = history_file
        self.compare, self.debug = compare, debug
        self.commands = build_commands()
        self.turns: list[Turn] = []  # everything asked this session (the model's history may have dropped some)

    def run(self) -> int:
        readline = self._start_readline()
        accept_undecodable_stdin()
        self.console.print(banner(self.info, self.session, self.compare))
        try:
            while (line := self.read()) is not None:
                if self.handle(line) is Outcome.QUIT:
                    break
        finally:
            if readline is not None and self.history_file is not None:
                try:
                    readline.write_history_file(self.history_file)
                except OSError:
                    pass  # no writable history file: recall still worked within the session
        return 0

    def read(self) -> str | None:
        """One input line (lines ending in a backslash continue), bytes that are not UTF-8 replaced; "" after Ctrl-C,
        None at end of input."""
        try:
            line = input(self._prompt("you ›"))
            while line.endswith("\\"):
                line = line[:-1] + "\n" + input(self._prompt("    …"))
        except KeyboardInterrupt:
            self.console.print()
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
            if text:
                self.ask(text.removeprefix("/"))
        except KeyboardInterrupt:  # between a generation and its table: the turn is already recorded
            self.console.print("interrupted", style="yellow")
        return Outcome.CONTINUE

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

    def _prompt(self, text: str) -> str:
        if not self.console.is_terminal or self.console.no_color:
            return text + " "
        return f"\001\033[1;36m\002{text}\001\033[0m\002 "  # \001..\002: invisible to readline's width count

    def _start_readline(self):
        try:
            import readline
        except ImportError:  # some platforms have no readline: plain input() still works
            return None
        if self.history_file is not None:
            try:
                self.history_file.parent.mkdir(parents=True, exist_ok=True)
                readline.read_history_file(self.history_file)
            except OSError:
                pass  # first run: no history yet
        readline.set_history_length(HISTORY_LINES)
        return readline

