"""The REPL: read a line, run a slash-command or a chat turn, repeat until /quit or Ctrl-D.

Ctrl-C at the prompt clears the line; during a generation it stops the turn (see chat/turn.py for what is kept).
Up-arrow recalls earlier prompts through `readline`, with the history in a file when one is given.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from chat.commands import Outcome, build_commands, describe_processor, dispatch, running, warn
from chat.render import ConsoleView, comparison_table, turn_rows
from chat.session import ChatSession, ModelInfo
from chat.turn import Turn, run_turn

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
        self.console.print(self.banner())
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
        """One input line (lines ending in a backslash continue); "" after Ctrl-C, None at end of input."""
        try:
            line = input(self._prompt("you ›"))
            while line.endswith("\\"):
                line = line[:-1] + "\n" + input(self._prompt("    …"))
            return line
        except KeyboardInterrupt:
            self.console.print()
            return ""
        except EOFError:
            self.console.print()
            return None

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
        if self.session.compiling:
            try:
                with self.console.status("the drafter's one-token step is still compiling (once per start; "
                                         "--no-compile skips it) …"):
                    self.session.wait_for_compile()
            except KeyboardInterrupt:
                warn(self, "the prompt was not run: the drafter is still compiling (it goes on in the background)")
                return None
        try:
            turn = run_turn(self.session, text, view, strategies)
        except ValueError as error:  # the prompt does not fit the context
            warn(self, str(error))
            return None
        except RuntimeError as error:  # out of memory and the like: this turn is lost, the session is not
            warn(self, f"generation failed: {error}")
            return None
        self.turns.append(turn)
        if len(turn.runs) > 1:
            self.console.print(comparison_table(turn_rows(turn), settings.processor.is_greedy))
        if turn.interrupted:
            warn(self, interrupt_notice(turn))
        return turn

    def totals(self) -> dict[str, tuple[int, int, float]]:
        """Per strategy: turns, tokens and seconds over the whole session."""
        totals: dict[str, tuple[int, int, float]] = {}
        for turn in self.turns:
            for run in turn.runs:
                turns, tokens, seconds = totals.get(run.strategy, (0, 0, 0.0))
                stats = run.stats
                totals[run.strategy] = (turns + 1, tokens + stats.new_tokens, seconds + stats.total_time)
        return totals

    def transcript(self) -> dict:
        settings = self.session.settings
        turns = []
        for turn in self.turns:
            results = [{"strategy": run.strategy, "text": self.session.decode(self.session.answer_ids(run)),
                        "new_tokens": run.stats.new_tokens, "tokens_per_second": run.stats.tokens_per_second,
                        "interrupted": run.interrupted} for run in turn.runs]
            history_from = turn.runs[0].strategy if turn.answer is not None else None
            turns.append({"user": turn.user, "history_from": history_from, "results": results})
        return {"target": self.info.target, "drafter": self.info.drafter, "dtype": self.info.dtype,
                "device": self.info.device, "processor": describe_processor(settings.processor),
                "system": settings.system, "turns": turns}

    def banner(self) -> Panel:
        info, settings = self.info, self.session.settings
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold")
        grid.add_column()
        grid.add_row("target", info.target)
        grid.add_row("drafter", (info.drafter or "none") + (f" · step {self.session.compile_status}"
                                                             if self.session.compile_status else ""))
        grid.add_row("dtype · device", f"{info.dtype} · {info.device}")
        grid.add_row("strategies", running(self))
        grid.add_row("sampling", f"{describe_processor(settings.processor)} · up to {settings.max_new_tokens} "
                                 f"new tokens · gamma {settings.strategy.gamma}")
        grid.add_row("chat", "template" + (f" · system: {settings.system}" if settings.system else "")
                     if self.session.uses_template else "raw completion (no template)")
        return Panel(grid, title="[bold]specchat[/] · speculative decoding", title_align="left",
                     subtitle="/help for commands · Ctrl-C stops a generation · Ctrl-D quits", subtitle_align="left",
                     border_style="cyan", expand=False)

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


def interrupt_notice(turn: Turn) -> str:
    first = turn.runs[0]
    if turn.answer is None:
        return "interrupted before the first token: the turn was dropped from the history"
    state = "partial answer" if first.interrupted else "answer"
    return f"interrupted: kept the {state} of {first.strategy} ({len(first.token_ids)} tokens) in the history"
