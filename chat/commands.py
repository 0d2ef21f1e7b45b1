"""Slash-commands: a dispatch table of name -> (handler, usage, help, current value); the settings' commands are
derived from their descriptions (`app.settings`).

Every handler validates its argument and raises `UsageError` (or the engine's ValueError) on a bad one; `dispatch`
answers with one line and the usage, so no command can end the session except /quit. Handlers see a `Context`
(the session, the console, the turns so far and the REPL's switches), not the REPL itself.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Protocol

from rich.console import Console
from rich.table import Table
from rich.text import Text

from app.export import ENGINES, export, serving
from app.settings import SETTINGS, on_off, word_of
from chat import message_commands, setting_commands
from chat.arguments import COMMAND, FILE, STRATEGY_LIST, UsageError, parse_switch, plural
from chat.render import (
    BASELINE,
    acceptance_histogram,
    comparison_table,
    detail_table,
    running,
    say,
    slower_reason,
    totals_table,
    turn_rows,
    warn,
)
from chat.session import ChatSession, ModelInfo
from chat.transcript import transcript, transcript_markdown, write_file
from chat.turn import Turn
from sampling.settings import NEEDS_DRAFTER, NEEDS_HEAD, STRATEGIES
from utils.checks import SettingError
from utils.errors import ModelLoadError
from utils.logits_processor import PROCESSORS

FORCE = "--force"  # /save FILE --force: replace an existing file
SWITCH = ("on", "off")


class Outcome(Enum):
    CONTINUE = "continue"
    QUIT = "quit"


class Context(Protocol):
    """What a command may read and change: the session and the REPL's own state (the REPL is one)."""

    session: ChatSession
    console: Console
    info: ModelInfo
    turns: list[Turn]  # everything asked this session, for /stats and /save
    commands: dict[str, Command]
    compare: bool
    debug: bool
    pending: message_commands.Pending  # text /read holds for the next message
    earlier: list[dict]  # the turns of a conversation resumed with /load, as its file has them

    def send(self, text: str) -> Turn | None: ...

    def regen(self) -> Turn | None: ...

    def last_message(self) -> str | None: ...


@dataclass(frozen=True)
class Command:
    name: str
    handler: Callable[[Context, str], Outcome | None]
    usage: str
    help: str
    value: Callable[[Context], str] | None = None  # the current setting, shown by /help
    aliases: tuple[str, ...] = ()
    completes: tuple[str | tuple[str, ...], ...] = ()  # what Tab offers for each argument: FILE, COMMAND, ... or words


# ---------------------------------------------------------------------------------------------
# Handlers


def _help(ctx: Context, arg: str) -> None:
    if arg:
        command = find(ctx.commands, arg.lstrip("/"))
        say(ctx.console, f"{command.usage}  —  {command.help}")
        return
    table = Table(header_style="bold", pad_edge=False, box=None)
    table.add_column("command", style="cyan", no_wrap=True)
    table.add_column("what it does")
    table.add_column("now", style="green")
    for command in dict.fromkeys(ctx.commands.values()):  # each command once, aliases included
        table.add_row(Text(command.usage), Text(command.help), Text(command.value(ctx) if command.value else ""))
    ctx.console.print(table)
    ctx.console.print("Type a message to chat; Enter sends it, Alt+Enter (or Esc then Enter) adds a line, a paste is "
                      "one message. \"\"\" opens and closes a block of lines; a line ending in \\ goes on on the next; "
                      "start a message with // to send one that begins with /. Tab completes commands, strategy names "
                      "and file paths. Ctrl-C stops a generation (the first strategy's partial answer is kept), Ctrl-D "
                      "quits.", style="dim")


def _quit(ctx: Context, arg: str) -> Outcome:
    return Outcome.QUIT


def _toggle_strategy(name: str) -> Callable[[Context, str], None]:
    def toggle(ctx: Context, arg: str) -> None:
        enabled = ctx.session.settings.strategies
        on = parse_switch(arg, name in enabled)
        if on and name in NEEDS_DRAFTER and ctx.session.drafter is None:
            raise UsageError(f"{name} needs a drafter model; restart with --drafter")
        if on and name in NEEDS_HEAD and name not in ctx.session.heads:
            raise UsageError(f"{name} needs a trained {name} head; restart with --head DIR (train_head.py makes one)")
        if not on and enabled == (name,):
            raise UsageError("at least one strategy must stay enabled")
        if on:
            strategies = enabled if name in enabled else enabled + (name,)
        else:
            strategies = tuple(s for s in enabled if s != name)
        ctx.session.update(strategies=strategies)
        ctx.console.print(f"{name} {on_off(on)}; running: {_running(ctx)}")

    return toggle


def _running(ctx: Context) -> str:
    return running(ctx.session.settings.strategies, ctx.compare)


def _strategies(ctx: Context, arg: str) -> None:
    if arg:
        names = tuple(n.lower() for n in arg.replace(",", " ").split())
        bad = [n for n in names if n not in STRATEGIES]
        if bad:
            raise UsageError(f"unknown strategy {bad[0]!r}; choose from {', '.join(STRATEGIES)}")
        ctx.session.update(strategies=names)
    ctx.console.print(f"running: {_running(ctx)}")


def _compare(ctx: Context, arg: str) -> None:
    ctx.compare = parse_switch(arg, ctx.compare)
    ctx.console.print(f"compare {on_off(ctx.compare)}; running: {_running(ctx)}")


def _chat(ctx: Context, arg: str) -> None:
    on = parse_switch(arg, ctx.session.settings.chat_template)
    if on and not ctx.session.has_template:
        raise UsageError("this tokenizer has no chat template; only raw completion is possible")
    ctx.session.update(chat_template=on)
    ctx.console.print("chat template on" if on else "chat template off: raw completion, each prompt stands alone")


def _system(ctx: Context, arg: str) -> None:
    if arg.lower() in ("off", "none"):
        ctx.session.update(system=None)
    elif arg:
        ctx.session.update(system=arg)
    system = ctx.session.settings.system
    say(ctx.console, f"system prompt: {system}" if system else "no system prompt")


def _reset(ctx: Context, arg: str) -> None:
    if arg:
        raise UsageError("takes no argument")
    ctx.session.reset()
    ctx.console.print("history cleared (and any n-gram store); /save still has the whole transcript")


def _history(ctx: Context, arg: str) -> None:
    if arg:
        raise UsageError("takes no argument")
    session = ctx.session
    if session.settings.system:
        ctx.console.print(Text.assemble(("system", "bold magenta"), " ", session.settings.system))
    if not session.history:
        ctx.console.print("(no turns yet)" if session.uses_template else "(raw completion: no chat history)")
    for message in session.history:
        style = "bold cyan" if message.role == "user" else "bold green"
        ctx.console.print(Text.assemble((message.role, style), " ", message.content))


def _debug(ctx: Context, arg: str) -> None:
    ctx.debug = parse_switch(arg, ctx.debug)
    ctx.console.print(f"debug {on_off(ctx.debug)}")


def _stats(ctx: Context, arg: str) -> None:
    if arg:
        raise UsageError("takes no argument")
    if ctx.session.compile_status:
        say(ctx.console, f"drafter step: {ctx.session.compile_status}")
    if ctx.session.target_compile_status:
        use = " (in use)" if ctx.session.target.whole_model is not None else ""
        say(ctx.console, f"target forward: {ctx.session.target_compile_status}{use}")
    invariance = ctx.session.invariance
    if invariance:
        say(ctx.console, f"greedy identity: {invariance.summary}")
        for reason in invariance.reasons:
            say(ctx.console, f"  {reason}")
    tuning = ctx.session.tuning
    if tuning:
        say(ctx.console, f"drafting, calibrated for this machine (timed {tuning.calibration.date}): "
                         f"{tuning.summary(ctx.session.settings.strategy)}")
        for reason in tuning.choice.reasons:
            say(ctx.console, f"  {reason}")
    if not ctx.turns:
        ctx.console.print("no turns yet")
        return
    rows = turn_rows(ctx.turns[-1])
    ctx.console.print(comparison_table(rows, ctx.session.settings.processor.is_greedy, title="last turn"))
    ctx.console.print(detail_table(rows))
    histogram = acceptance_histogram(rows)
    if histogram is not None:
        ctx.console.print(histogram, end="")
    baseline = next((row for row in rows if row.strategy == BASELINE), None)
    for row in rows:
        reason = slower_reason(row, baseline)
        if reason:
            say(ctx.console, reason)
    ctx.console.print(totals_table(ctx.turns))


def _calibrate(ctx: Context, arg: str) -> None:
    if arg:
        raise UsageError("takes no argument")
    session = ctx.session
    if session.records is None:
        raise UsageError("this session was started with --no-calibrate, so it has nothing to time against")
    with ctx.console.status("probing and timing this machine's forwards …"):
        tuning = session.calibrate(again=True)
    say(ctx.console, f"calibrated in {tuning.calibration.seconds:.0f} s: {tuning.summary(session.settings.strategy)}")
    for reason in tuning.choice.reasons:
        say(ctx.console, f"  {reason}")


def _clear(ctx: Context, arg: str) -> None:
    if arg:
        raise UsageError("takes no argument")
    ctx.console.clear()


def _save(ctx: Context, arg: str) -> None:
    name, force = _save_arguments(arg)
    path = Path(name).expanduser()
    if path.is_dir():
        raise UsageError(f"{name} is a directory; give a file name")
    record = transcript(ctx.session, ctx.info, ctx.turns, ctx.compare, ctx.earlier)
    text = json.dumps(record, indent=2, ensure_ascii=False) + "\n" if path.suffix == ".json" else \
        transcript_markdown(record)
    try:
        write_file(path, text, replace=force)
    except FileExistsError:
        raise UsageError(f"{name} exists; /save {name} --force replaces it") from None
    except OSError as error:
        raise UsageError(f"cannot write {name}: {error.strerror or error}") from None
    say(ctx.console, f"saved {plural(len(record['turns']), 'turn')} to {path}")


def _export(ctx: Context, arg: str) -> None:
    engine, _, rest = arg.partition(" ")
    if engine.lower() not in ENGINES:
        raise UsageError(f"expected an engine: {', '.join(ENGINES)}")
    info, session = ctx.info, ctx.session
    if not info.target_spec:
        raise UsageError("this session was not told which files its models were loaded from")
    head = session.heads.get("eagle")
    try:
        with ctx.console.status("finding the models' files …"):
            served = serving(engine.lower(), info.target_spec, info.drafter_spec,
                             head.info.get("path") if head else None, session.target.model.config, info.cache_dir,
                             same_vocab=session.tokenizers is None)
    except (ModelLoadError, OSError) as error:
        raise UsageError(f"cannot find the models' files: {error}") from None
    result = export(engine.lower(), served, session.settings.strategies, session.settings.strategy)
    ctx.console.print(Text(result.command), soft_wrap=True)
    for note in result.notes:
        say(ctx.console, note, style="dim", soft_wrap=True)
    if rest.strip():
        name, force = _save_arguments(rest)
        path = Path(name).expanduser()
        try:
            write_file(path, result.script(), replace=force)
            path.chmod(0o755)
        except FileExistsError:
            raise UsageError(f"{name} exists; /export {engine} {name} --force replaces it") from None
        except OSError as error:
            raise UsageError(f"cannot write {name}: {error.strerror or error}") from None
        say(ctx.console, f"wrote {path}")


def _save_arguments(arg: str) -> tuple[str, bool]:
    """FILE [--force] (or --force FILE); the name keeps its inner spaces."""
    words = arg.split()
    force = bool(words) and FORCE in (words[0], words[-1])
    if force:
        arg = arg.strip().removesuffix(FORCE) if words[-1] == FORCE else arg.strip().removeprefix(FORCE)
    name = arg.strip()
    if not name:
        raise UsageError("expected a file name (.json for JSON, anything else for markdown)")
    return name, force


# ---------------------------------------------------------------------------------------------
# The table


def build_commands(strategies: tuple[str, ...] = STRATEGIES) -> dict[str, Command]:
    s = lambda ctx: ctx.session.settings  # noqa: E731 (the value columns below read better short)
    head = [
        Command("help", _help, "/help [COMMAND]", "this list, or one command's usage", completes=(COMMAND,)),
        Command("quit", _quit, "/quit", "leave (also /exit, Ctrl-D)", aliases=("exit",)),
        Command("strategies", _strategies, "/strategies [A,B,...]",
                "set the enabled strategies in order (the first one's answer goes into the history)",
                lambda ctx: ", ".join(s(ctx).strategies), completes=(STRATEGY_LIST,)),
    ]
    toggles = [Command(name, _toggle_strategy(name), f"/{name} [on|off]",
                       f"toggle the {name} strategy" + (" (needs a drafter)" * (name in NEEDS_DRAFTER))
                       + (f" (needs a trained {name} head)" * (name in NEEDS_HEAD)),
                       lambda ctx, name=name: _strategy_state(ctx.session, name), completes=(SWITCH,))
               for name in strategies]
    rest = [
        Command("compare", _compare, "/compare [on|off]",
                "on: every prompt runs all enabled strategies and shows the comparison table; off: only the first",
                lambda ctx: on_off(ctx.compare), completes=(SWITCH,)),
        Command("chat", _chat, "/chat [on|off]", "chat template on, or raw completion of each prompt",
                lambda ctx: on_off(ctx.session.uses_template), completes=(SWITCH,)),
        Command("system", _system, "/system [TEXT|off]", "set, show or remove the system prompt",
                lambda ctx: s(ctx).system or "none"),
        Command("reset", _reset, "/reset", "clear the conversation history (and the n-gram store)"),
        Command("history", _history, "/history", "show the conversation the model sees",
                lambda ctx: plural(len(ctx.session.history) // 2, "turn")),
        Command("debug", _debug, "/debug [on|off]",
                "colour tokens: accepted drafts, rejected drafts (struck), the target's own",
                lambda ctx: on_off(ctx.debug), completes=(SWITCH,)),
        Command("stats", _stats, "/stats", "the last turn in detail, and session totals"),
        Command("calibrate", _calibrate, "/calibrate",
                "time this machine's forwards again and choose gamma, the verify width, the alternatives and the "
                "cumulative stop from them (settings given as flags stay)"),
        Command("clear", _clear, "/clear", "clear the screen"),
        Command("regen", message_commands.regen, "/regen",
                "run the last message again with the current strategies and settings; its answer replaces the last"),
        Command("read", message_commands.read, "/read FILE",
                f"a text file (up to {message_commands.READ_LIMIT // 1024} kB) starts your next message",
                lambda ctx: ", ".join(ctx.pending.names), completes=(FILE,)),
        Command("edit", message_commands.edit, "/edit", "write your next message in $EDITOR (sent when you save and "
                                                        "quit it)"),
        Command("save", _save, f"/save FILE [{FORCE}]",
                f"save the transcript (FILE.json: JSON, otherwise markdown); {FORCE} replaces an existing file",
                completes=(FILE,)),
        Command("load", message_commands.load, "/load FILE",
                "resume a chat saved with /save FILE.json: its history, system prompt, settings and strategies",
                completes=(FILE,)),
        Command("export", _export, f"/export {'|'.join(ENGINES)} [FILE [{FORCE}]]",
                "the command that serves this target with its drafter, head or lookup settings and gamma on a serving "
                "engine (FILE: written as a script)", completes=(tuple(ENGINES), FILE)),
    ]
    settings = [Command(setting.command, setting_commands.handler(setting), setting.usage, setting.help,
                        setting_commands.shown(setting), completes=_setting_words(setting))
                for setting in SETTINGS if setting.command]
    rest = rest[:1] + settings + rest[1:]  # after /compare
    table: dict[str, Command] = {}
    for command in head + rest + toggles:  # a strategy named like a command keeps the command (/strategies too)
        for name in (command.name, *command.aliases):
            table.setdefault(name, command)
    order = {id(command): i for i, command in enumerate(head + toggles + rest)}  # /help: toggles after /strategies
    return dict(sorted(table.items(), key=lambda item: order[id(item[1])]))


def _setting_words(setting) -> tuple[tuple[str, ...], ...]:
    """What Tab offers for a setting's values: on and off for a switch, the processors' names for /processor."""
    if setting.name == "processor":
        return (tuple(PROCESSORS),)
    return tuple(SWITCH if value.type is bool else () for value in setting.values)


def _strategy_state(session: ChatSession, name: str) -> str:
    if name in NEEDS_DRAFTER and session.drafter is None:
        return "unavailable (no drafter)"
    if name in NEEDS_HEAD and name not in session.heads:
        return f"unavailable (no {name} head)"
    return on_off(name in session.settings.strategies)


def find(commands: dict[str, Command], name: str) -> Command:
    if name.lower() in commands:
        return commands[name.lower()]
    close = difflib.get_close_matches(name.lower(), list(commands), n=1, cutoff=0.5)
    hint = f"; did you mean /{close[0]}?" if close else "; /help lists the commands"
    raise UsageError(f"unknown command /{name}{hint}")


def dispatch(ctx: Context, line: str) -> Outcome:
    """Run one slash-command line. Bad input gets one line (and the usage); nothing but /quit ends the session."""
    rest = line.strip().removeprefix("/")
    words = rest.split(maxsplit=1) if rest[:1].strip() else []  # str.split: any whitespace, tabs and NBSP too
    if not words:
        warn(ctx.console, "type a command after the slash; /help lists them")
        return Outcome.CONTINUE
    name, arg = words[0], words[1] if len(words) > 1 else ""
    try:
        command = find(ctx.commands, name)
    except UsageError as error:
        warn(ctx.console, str(error))
        return Outcome.CONTINUE
    try:
        return command.handler(ctx, arg.strip()) or Outcome.CONTINUE
    except SettingError as error:  # a setting's own bounds, in this command's words
        message = f"{word_of(error.setting)} {error.requirement}, got {error.value!r}"
    except ValueError as error:  # UsageError, and the engine's other checks
        message = str(error)
    warn(ctx.console, f"/{command.name}: {message}  (usage: {command.usage})")
    return Outcome.CONTINUE

