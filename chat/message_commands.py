"""The slash-commands that make or bring back messages: /regen (the last one again), /read (a file's text starts the
next one), /edit (the next one written in $EDITOR), /load (a chat saved with /save FILE.json, resumed).

Each checks everything before it changes anything: a missing, binary or damaged file gets one line and leaves the chat
as it was."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from chat.arguments import UsageError, plural
from chat.render import say, warn
from chat.transcript import ConversationError, read_conversation
from chat.undecodable import notice, replace_undecodable
from sampling.settings import NEEDS_DRAFTER, NEEDS_HEAD

if TYPE_CHECKING:
    from chat.commands import Context

READ_LIMIT = 256 * 1024  # bytes /read takes: far more text than any context here holds, far less than a binary blob
EDITORS = ("nano", "vi")  # where neither $VISUAL nor $EDITOR names one


@dataclass
class Pending:
    """Text that starts the next message (/read), and where each part came from."""

    parts: list[tuple[str, str]] = field(default_factory=list)  # (file name, text)

    def __bool__(self) -> bool:
        return bool(self.parts)

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.parts]

    def before(self, text: str) -> str:
        """The message: the held texts, then `text`, a blank line between each."""
        return "\n\n".join([part for _, part in self.parts] + ([text] if text else []))


def regen(ctx: Context, arg: str) -> None:
    if arg:
        raise UsageError("takes no argument")
    if ctx.last_message() is None:
        raise UsageError("nothing to regenerate yet: send a message first")
    ctx.regen()


def read(ctx: Context, arg: str) -> None:
    if not arg:
        if not ctx.pending:
            raise UsageError("expected a file name")
        say(ctx.console, f"held for your next message: {', '.join(ctx.pending.names)} (Ctrl-C at the prompt drops it)")
        return
    text, undecodable = read_text(arg)
    if undecodable:
        warn(ctx.console, notice(arg, undecodable))
    ctx.pending.parts.append((arg, text))
    say(ctx.console, f"read {arg} ({plural(len(text.splitlines()), 'line')}, {plural(len(text), 'character')}): "
                     "it starts your next message; type the rest, or press Enter to send it alone (Ctrl-C drops it)")


def read_text(name: str) -> tuple[str, int]:
    """The text of the file `name` and its count of bytes that were not UTF-8 (replaced); a UsageError that says why
    not where it is missing, a directory, too large or binary."""
    path = Path(name).expanduser()
    try:
        if path.is_dir():
            raise UsageError(f"{name} is a directory; give a text file")
        size = path.stat().st_size
        if size > READ_LIMIT:
            raise UsageError(f"{name} has {size / 1024:.0f} kB; /read takes text files up to {READ_LIMIT // 1024} kB")
        data = path.read_bytes()
    except FileNotFoundError:
        raise UsageError(f"no file {name}") from None
    except OSError as error:
        raise UsageError(f"cannot read {name}: {error.strerror or error}") from None
    text, undecodable = replace_undecodable(data.decode("utf-8", errors="surrogateescape"))
    if b"\0" in data or undecodable > len(data) // 20:
        raise UsageError(f"{name} is not a text file (binary, or not UTF-8)")
    if not text.strip():
        raise UsageError(f"{name} is empty")
    return text, undecodable


def edit(ctx: Context, arg: str) -> None:
    if arg:
        raise UsageError("takes no argument")
    command = editor_command()
    with tempfile.TemporaryDirectory(prefix="specchat-") as folder:
        path = Path(folder) / "message.md"
        path.write_text("", encoding="utf-8")
        try:
            status = subprocess.run([*command, str(path)], check=False).returncode
        except OSError as error:
            raise UsageError(f"cannot run the editor {command[0]!r} ({error.strerror or error}); set $EDITOR to "
                             "one that is installed") from None
        text, undecodable = replace_undecodable(path.read_bytes().decode("utf-8", errors="surrogateescape"))
    if undecodable:
        warn(ctx.console, notice("the message", undecodable))
    text = text.strip("\n")
    if status != 0:
        if text.strip():
            ctx.pending.parts.append(("the editor", text))
            raise UsageError(f"the editor exited with status {status}: its text is held for your next message "
                             "(Enter sends it, Ctrl-C drops it)")
        raise UsageError(f"the editor exited with status {status}; nothing sent")
    if not text.strip():
        say(ctx.console, "nothing written: nothing sent", style="dim")
        return
    say(ctx.console, text)
    ctx.send(text)


def editor_command() -> list[str]:
    """$VISUAL or $EDITOR (words, as a shell would split them), else the first of `EDITORS` installed."""
    for variable in ("VISUAL", "EDITOR"):
        words = shlex.split(os.environ.get(variable, ""))
        if words:
            return words
    found = next((shutil.which(name) for name in EDITORS if shutil.which(name)), None)
    if found is None:
        raise UsageError("no editor found; set $EDITOR")
    return [found]


def load(ctx: Context, arg: str) -> None:
    if not arg:
        raise UsageError("expected a file name (a chat saved with /save FILE.json)")
    try:
        saved = read_conversation(Path(arg).expanduser())
    except FileNotFoundError:
        raise UsageError(f"no file {arg}") from None
    except OSError as error:
        raise UsageError(f"cannot read {arg}: {error.strerror or error}") from None
    except ConversationError as error:
        raise UsageError(f"{arg}: {error}; nothing changed") from None
    session = ctx.session
    runnable = tuple(s for s in saved.settings.strategies if not (s in NEEDS_DRAFTER and session.drafter is None)
                     and not (s in NEEDS_HEAD and s not in session.heads))
    left = [s for s in saved.settings.strategies if s not in runnable]
    try:
        session.load(replace(saved.settings, strategies=runnable or session.settings.strategies), saved.history)
    except ValueError as error:
        raise UsageError(f"{arg}: {error}; nothing changed") from None
    ctx.compare, ctx.earlier, ctx.turns = saved.compare, saved.turns, []
    say(ctx.console, f"resumed {arg}: {plural(len(saved.history) // 2, 'exchange')} in the history, "
                     f"running {', '.join(session.settings.strategies)}")
    if left:
        warn(ctx.console, f"left out {', '.join(left)}: this chat has no drafter or head for "
                          f"{'them' if len(left) > 1 else 'it'}")
    if saved.target and saved.target != ctx.info.target:
        say(ctx.console, f"saved with {saved.target}; this chat runs {ctx.info.target} (the history is text, so it "
                         "goes on here)", style="dim")
