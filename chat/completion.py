"""Tab completion for the line editor: command names after a slash, then each command's arguments as its table
entry describes them (`Command.completes`): file paths, strategy names, command names or a set of words."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prompt_toolkit.completion import CompleteEvent, Completer, Completion, PathCompleter
from prompt_toolkit.document import Document

from chat.arguments import COMMAND, FILE, STRATEGY_LIST
from sampling.settings import STRATEGIES


class CommandCompleter(Completer):
    """`commands`: a callable giving the dispatch table (name -> Command), read at each Tab."""

    def __init__(self, commands: Callable[[], dict]):
        self.commands = commands
        self.paths = PathCompleter(expanduser=True)

    def get_completions(self, document: Document, complete_event: CompleteEvent) -> Iterator[Completion]:
        text = document.text_before_cursor
        if not text.startswith("/") or text.startswith("//") or "\n" in text:
            return
        name, space, arguments = text[1:].partition(" ")
        commands = self.commands()
        if not space:
            yield from _words(name, commands, prefix="/")
            return
        command = commands.get(name.lower())
        if command is None or not command.completes:
            return
        words = arguments.split(" ")
        kind = command.completes[min(len(words), len(command.completes)) - 1]
        word = words[-1]
        if kind == FILE:
            path = " ".join(words[len(command.completes) - 1:]) if len(words) >= len(command.completes) else word
            yield from self.paths.get_completions(Document(path, len(path)), complete_event)
        elif kind == COMMAND:
            yield from _words(word.lstrip("/"), commands)
        elif kind == STRATEGY_LIST:
            yield from _words(word.rpartition(",")[2], STRATEGIES)
        else:
            yield from _words(word, kind)


def _words(start: str, words: Iterable[str], prefix: str = "") -> Iterator[Completion]:
    for word in words:
        if word.startswith(start.lower()):
            yield Completion(prefix + word, start_position=-len(start) - len(prefix))
