"""Slash-commands: a dispatch table of name -> (handler, usage, help, current value).

Every handler validates its argument and raises `UsageError` (or the engine's ValueError) on a bad one; `dispatch`
answers with one line and the usage, so no command can end the session except /quit.
"""

from __future__ import annotations

import difflib
import inspect
import json
import math
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from rich.markup import escape
from rich.table import Table

from chat.render import comparison_table, detail_table, turn_rows
from chat.session import ChatSession
from sampling.drafters.ngram import STORE_KINDS
from sampling.registry import NEEDS_DRAFTER, STRATEGIES
from utils.logits_processor import PROCESSORS, LogitsProcessor

if TYPE_CHECKING:
    from chat.app import ChatApp

MAX_BEAMS = 64


class UsageError(ValueError):
    """A command's argument is wrong; the message says what is expected."""


class Outcome(Enum):
    CONTINUE = "continue"
    QUIT = "quit"


@dataclass(frozen=True)
class Command:
    name: str
    handler: Callable[[ChatApp, str], Outcome | None]
    usage: str
    help: str
    value: Callable[[ChatApp], str] | None = None  # the current setting, shown by /help
    aliases: tuple[str, ...] = ()


# ---------------------------------------------------------------------------------------------
# Argument parsing


def parse_int(text: str, what: str, low: int, high: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"{what} must be an integer, got {text!r}") from None
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"from {low} to {high}"
        raise UsageError(f"{what} must be {bounds}, got {value}")
    return value


def parse_switch(text: str, current: bool) -> bool:
    """on/off (and friends); no argument flips the current value."""
    word = text.strip().lower()
    if not word:
        return not current
    if word in ("on", "yes", "true", "1"):
        return True
    if word in ("off", "no", "false", "0"):
        return False
    raise UsageError(f"expected on or off, got {text!r}")


def one_word(text: str) -> str:
    if len(text.split()) > 1:
        raise UsageError(f"expected one value, got {text!r}")
    return text.strip()


def on_off(flag: bool) -> str:
    return "on" if flag else "off"


# ---------------------------------------------------------------------------------------------
# Processors


def processor_name(processor: LogitsProcessor) -> str:
    return next((name for name, cls in PROCESSORS.items() if type(processor) is cls), type(processor).__name__)


def describe_processor(processor: LogitsProcessor) -> str:
    if processor.is_greedy:
        return processor_name(processor)
    return " ".join([processor_name(processor)] + [f"{k}={v}" for k, v in vars(processor).items()])


def _processor_params(cls: type[LogitsProcessor]) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self"]


SHORT_NAMES = {"temperature": "T", "top_k": "K", "top_p": "P", "min_p": "MINP"}


def processor_forms() -> str:
    """greedy | multinomial [T] | topk [T [K]] | ...: each processor with its values in order."""
    forms = []
    for name, cls in PROCESSORS.items():
        values = [SHORT_NAMES.get(p.name, p.name.upper()) for p in _processor_params(cls)]
        forms.append(" ".join([name] + ([f"[{' '.join(values)}]"] if values else [])))
    return " | ".join(forms)


def parse_processor(text: str) -> LogitsProcessor:
    """`NAME [VALUE ...] [key=value ...]`: values in the constructor's order, defaults for the rest."""
    words = text.split()
    name = words[0].lower()
    if name not in PROCESSORS:
        raise UsageError(f"unknown processor {words[0]!r}; choose from {', '.join(PROCESSORS)}")
    cls = PROCESSORS[name]
    params = {p.name: p for p in _processor_params(cls)}
    positional = [w for w in words[1:] if "=" not in w]
    if len(positional) > len(params):
        expected = ", ".join(params) or "no values"
        raise UsageError(f"{name} takes {expected}; got {len(positional)} values")
    kwargs = {p: _number(w, params[p]) for p, w in zip(params, positional)}
    for word in (w for w in words[1:] if "=" in w):
        key, _, value = word.partition("=")
        key = key.lower().replace("-", "_")
        if key not in params:
            raise UsageError(f"{name} has no parameter {key!r}; it takes {', '.join(params) or 'none'}")
        kwargs[key] = _number(value, params[key])
    return cls(**kwargs)


def _number(text: str, param: inspect.Parameter) -> float | int:
    if isinstance(param.default, int) and not isinstance(param.default, bool):
        return parse_int(text, param.name, 1)
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{param.name} must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise UsageError(f"{param.name} must be finite, got {text!r}")
    return value


# ---------------------------------------------------------------------------------------------
# Handlers


def _help(app: ChatApp, arg: str) -> None:
    if arg:
        command = find(app.commands, arg.lstrip("/"))
        app.console.print(f"{escape(command.usage)}  —  {command.help}")
        return
    table = Table(header_style="bold", pad_edge=False, box=None)
    table.add_column("command", style="cyan", no_wrap=True)
    table.add_column("what it does")
    table.add_column("now", style="green")
    for command in dict.fromkeys(app.commands.values()):  # each command once, aliases included
        table.add_row(escape(command.usage), command.help, escape(command.value(app)) if command.value else "")
    app.console.print(table)
    app.console.print("Type a message to chat; start it with // to send a line that begins with /. End a line with "
                      "\\ to continue on the next. Ctrl-C stops a generation (the first strategy's partial answer is "
                      "kept), Ctrl-D quits.", style="dim")


def _quit(app: ChatApp, arg: str) -> Outcome:
    return Outcome.QUIT


def _toggle_strategy(name: str) -> Callable[[ChatApp, str], None]:
    def toggle(app: ChatApp, arg: str) -> None:
        enabled = app.session.settings.strategies
        on = parse_switch(arg, name in enabled)
        if on and name in NEEDS_DRAFTER and app.session.drafter is None:
            raise UsageError(f"{name} needs a drafter model; restart with --drafter")
        if not on and enabled == (name,):
            raise UsageError("at least one strategy must stay enabled")
        if on:
            strategies = enabled if name in enabled else enabled + (name,)
        else:
            strategies = tuple(s for s in enabled if s != name)
        app.session.update(strategies=strategies)
        app.console.print(f"{name} {on_off(on)}; running: {running(app)}")

    return toggle


def running(app: ChatApp) -> str:
    strategies = app.session.settings.strategies
    if not app.compare:
        return f"{strategies[0]} only (compare off)"
    return f"{', '.join(strategies)} (history from {strategies[0]})"


def _strategies(app: ChatApp, arg: str) -> None:
    if arg:
        names = tuple(n.strip().lower() for n in arg.replace(" ", ",").split(",") if n.strip())
        bad = [n for n in names if n not in STRATEGIES]
        if bad:
            raise UsageError(f"unknown strategy {bad[0]!r}; choose from {', '.join(STRATEGIES)}")
        app.session.update(strategies=names)
    app.console.print(f"running: {running(app)}")


def _compare(app: ChatApp, arg: str) -> None:
    app.compare = parse_switch(arg, app.compare)
    app.console.print(f"compare {on_off(app.compare)}; running: {running(app)}")


def _gamma(app: ChatApp, arg: str) -> None:
    gamma = parse_int(one_word(arg), "gamma", 1)
    app.session.update_strategy(gamma=gamma)
    app.console.print(f"gamma (most tokens drafted per round) = {gamma}")


def _length(app: ChatApp, arg: str) -> None:
    n = parse_int(one_word(arg), "max new tokens", 1)
    room = app.session.context_length
    if n >= room:
        raise UsageError(f"max new tokens must leave room for a prompt in the context of {room} tokens")
    app.session.update(max_new_tokens=n)
    app.console.print(f"max new tokens = {n}")


def _processor(app: ChatApp, arg: str) -> None:
    if arg:
        app.session.update(processor=parse_processor(arg))
    app.console.print(f"processor: {describe_processor(app.session.settings.processor)}")


def _seed(app: ChatApp, arg: str) -> None:
    word = one_word(arg).lower()
    seed = None if word in ("random", "none") else parse_int(word, "seed", 0, 2**63 - 1)
    app.session.update(seed=seed)
    app.console.print(f"seed = {'random' if seed is None else seed}")


def _chat(app: ChatApp, arg: str) -> None:
    on = parse_switch(arg, app.session.settings.chat_template)
    if on and not app.session.has_template:
        raise UsageError("this tokenizer has no chat template; only raw completion is possible")
    app.session.update(chat_template=on)
    app.console.print("chat template on" if on else "chat template off: raw completion, each prompt stands alone")


def _system(app: ChatApp, arg: str) -> None:
    if arg.lower() in ("off", "none"):
        app.session.update(system=None)
    elif arg:
        app.session.update(system=arg)
    system = app.session.settings.system
    app.console.print(f"system prompt: {escape(system)}" if system else "no system prompt")


def _reset(app: ChatApp, arg: str) -> None:
    if arg:
        raise UsageError("takes no argument")
    app.session.reset()
    app.console.print("history cleared (and any n-gram store); /save still has the whole transcript")


def _history(app: ChatApp, arg: str) -> None:
    if arg:
        raise UsageError("takes no argument")
    session = app.session
    if session.settings.system:
        app.console.print(f"[bold magenta]system[/] {escape(session.settings.system)}")
    if not session.history:
        app.console.print("(no turns yet)" if session.uses_template else "(raw completion: no chat history)")
    for message in session.history:
        style = "bold cyan" if message.role == "user" else "bold green"
        app.console.print(f"[{style}]{message.role}[/] {escape(message.content)}")


def _debug(app: ChatApp, arg: str) -> None:
    app.debug = parse_switch(arg, app.debug)
    app.console.print(f"debug {on_off(app.debug)}")


def _ngram_store(app: ChatApp, arg: str) -> None:
    words = arg.split()
    if len(words) != 2:
        raise UsageError("expected a kind and a size")
    kind = words[0].lower()
    if kind not in STORE_KINDS:
        raise UsageError(f"store kind must be one of {', '.join(STORE_KINDS)}, got {words[0]!r}")
    n = parse_int(words[1], "n-gram size", 2, 16)
    app.session.update_strategy(ngram_kind=kind, ngram_n=n)
    app.console.print(f"n-gram store: {kind}, n = {n} (a fresh store)")


def _filler(app: ChatApp, arg: str) -> None:
    k = parse_int(one_word(arg), "filler top-k", 0, 64)
    app.session.update_strategy(ngram_filler_top_k=k)
    app.console.print(f"n-gram filler top-k = {k}" + (" (off)" if k == 0 else ""))


def _ngram_reset(app: ChatApp, arg: str) -> None:
    reset = parse_switch(arg, app.session.settings.strategy.ngram_reset_each_prompt)
    app.session.update_strategy(ngram_reset_each_prompt=reset)
    app.console.print("the n-gram store " + ("starts fresh each prompt" if reset else "persists across prompts"))


def _lookup_ngram(app: ChatApp, arg: str) -> None:
    words = arg.split()
    if len(words) not in (1, 2):
        raise UsageError("expected MAX [MIN]")
    high = parse_int(words[0], "max n-gram", 1, 16)
    low = parse_int(words[1], "min n-gram", 1, high) if len(words) == 2 else 1
    app.session.update_strategy(lookup_max_ngram=high, lookup_min_ngram=low)
    app.console.print(f"prompt lookup n-grams from {high} down to {low}")


def _alternatives(app: ChatApp, arg: str) -> None:
    n = parse_int(one_word(arg), "draft alternatives", 0, 8)
    app.session.update_strategy(draft_alternatives=n)
    app.console.print(f"draft alternatives = {n}" + (" (a chain)" if n == 0 else
                                                     f": the draft model's next {n} best tokens at each depth are "
                                                     "verified too (greedy only)"))


def _width(app: ChatApp, arg: str) -> None:
    n = parse_int(one_word(arg), "verify width", 2, 64)
    app.session.update_strategy(verify_width=n)
    app.console.print(f"verify width = {n}: a draft holds at most {n - 1} tokens with the draft model's alternatives "
                      "or prompt lookup's other copies (the chain itself is capped by gamma)")


def _cumulative(app: ChatApp, arg: str) -> None:
    text = one_word(arg)
    try:
        p = float(text)
    except ValueError:
        raise UsageError(f"the cumulative threshold must be a number, got {text!r}") from None
    if not 0 <= p < 1:
        raise UsageError(f"the cumulative threshold must be in [0, 1), got {text}")
    app.session.update_strategy(draft_cumulative=p)
    app.console.print(f"draft cumulative threshold = {p:g}" + (": the draft model always drafts gamma tokens" if p == 0
                      else ": the draft model stops once the product of its token probabilities falls below it"))


def _lookahead_params(app: ChatApp, arg: str) -> None:
    words = arg.split()
    if len(words) != 3:
        raise UsageError("expected W N G")
    window = parse_int(words[0], "window W", 1, 16)
    ngram = parse_int(words[1], "n-gram size N", 2, 8)
    candidates = parse_int(words[2], "candidates G", 1, 16)
    app.session.update_strategy(lookahead_window=window, lookahead_ngram=ngram, lookahead_candidates=candidates)
    app.console.print(f"lookahead: window W = {window}, n-gram size N = {ngram}, candidates G = {candidates} "
                      f"(up to {(window + candidates) * (ngram - 1)} tokens per forward)")


def _beams(app: ChatApp, arg: str) -> None:
    n = parse_int(one_word(arg), "number of beams", 1, MAX_BEAMS)
    app.session.update_strategy(num_beams=n)
    app.console.print(f"beams = {n}")


def _stats(app: ChatApp, arg: str) -> None:
    if arg:
        raise UsageError("takes no argument")
    if app.session.compile_status:
        app.console.print(f"drafter step: {app.session.compile_status}", markup=False)
    if not app.turns:
        app.console.print("no turns yet")
        return
    rows = turn_rows(app.turns[-1])
    app.console.print(comparison_table(rows, app.session.settings.processor.is_greedy, title="last turn"))
    app.console.print(detail_table(rows))
    totals = Table(title="session", title_justify="left", header_style="bold", pad_edge=False)
    for name, justify in (("strategy", "left"), ("turns", "right"), ("tokens", "right"), ("seconds", "right"),
                          ("tok/s", "right")):
        totals.add_column(name, justify=justify)
    for name, (turns, tokens, seconds) in app.totals().items():
        totals.add_row(name, str(turns), str(tokens), f"{seconds:.2f}", f"{tokens / seconds:.1f}" if seconds else "—")
    app.console.print(totals)


def _clear(app: ChatApp, arg: str) -> None:
    if arg:
        raise UsageError("takes no argument")
    app.console.clear()


def _save(app: ChatApp, arg: str) -> None:
    if not arg:
        raise UsageError("expected a file name (.json for JSON, anything else for markdown)")
    path = Path(arg).expanduser()
    transcript = app.transcript()
    text = json.dumps(transcript, indent=2, ensure_ascii=False) + "\n" if path.suffix == ".json" else \
        transcript_markdown(transcript)
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as error:
        raise UsageError(f"cannot write {arg}: {error.strerror or error}") from None
    app.console.print(f"saved {len(transcript['turns'])} turns to {escape(str(path))}")


def transcript_markdown(transcript: dict) -> str:
    lines = [f"# Chat with {transcript['target']}", "",
             f"drafter: {transcript['drafter'] or 'none'} · dtype: {transcript['dtype']} · "
             f"processor: {transcript['processor']}", ""]
    if transcript["system"]:
        lines += ["## System", "", transcript["system"], ""]
    for turn in transcript["turns"]:
        lines += ["## User", "", turn["user"], ""]
        for result in turn["results"]:
            kept = " (kept in history)" if result["strategy"] == turn["history_from"] else ""
            stats = (f"{result['new_tokens']} tokens, {result['tokens_per_second']:.1f} tok/s"
                     + (", interrupted" if result["interrupted"] else ""))
            lines += [f"### {result['strategy']}{kept}", "", result["text"], "", f"*{stats}*", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The table


def build_commands(strategies: tuple[str, ...] = STRATEGIES) -> dict[str, Command]:
    s = lambda app: app.session.settings  # noqa: E731 (the value columns below read better short)
    head = [
        Command("help", _help, "/help [COMMAND]", "this list, or one command's usage"),
        Command("quit", _quit, "/quit", "leave (also /exit, Ctrl-D)", aliases=("exit",)),
        Command("strategies", _strategies, "/strategies [A,B,...]",
                "set the enabled strategies in order (the first one's answer goes into the history)",
                lambda app: ", ".join(s(app).strategies)),
    ]
    toggles = [Command(name, _toggle_strategy(name), f"/{name} [on|off]",
                       f"toggle the {name} strategy" + (" (needs a drafter)" * (name in NEEDS_DRAFTER)),
                       lambda app, name=name: _strategy_state(app.session, name))
               for name in strategies]
    rest = [
        Command("compare", _compare, "/compare [on|off]",
                "on: every prompt runs all enabled strategies and shows the comparison table; off: only the first",
                lambda app: on_off(app.compare)),
        Command("gamma", _gamma, "/gamma N", "the most tokens drafted per round (speculative, auto, ngram, lookup)",
                lambda app: str(s(app).strategy.gamma)),
        Command("length", _length, "/length N", "max new tokens per answer",
                lambda app: str(s(app).max_new_tokens)),
        Command("processor", _processor, "/processor NAME [VALUES]",
                f"sampling: {processor_forms()}; values in order or as key=value (top_p=0.9), defaults for the rest",
                lambda app: describe_processor(s(app).processor)),
        Command("seed", _seed, "/seed N|random", "sampling seed (same seed, same output)",
                lambda app: "random" if s(app).seed is None else str(s(app).seed)),
        Command("chat", _chat, "/chat [on|off]", "chat template on, or raw completion of each prompt",
                lambda app: on_off(app.session.uses_template)),
        Command("system", _system, "/system [TEXT|off]", "set, show or remove the system prompt",
                lambda app: s(app).system or "none"),
        Command("reset", _reset, "/reset", "clear the conversation history (and the n-gram store)"),
        Command("history", _history, "/history", "show the conversation the model sees",
                lambda app: f"{len(app.session.history) // 2} turns"),
        Command("debug", _debug, "/debug [on|off]",
                "colour tokens: accepted drafts, rejected drafts (struck), the target's own",
                lambda app: on_off(app.debug)),
        Command("ngram-store", _ngram_store, f"/ngram-store {'|'.join(STORE_KINDS)} N",
                "n-gram store kind and size n (contexts of n-1 tokens)",
                lambda app: f"{s(app).strategy.ngram_kind} {s(app).strategy.ngram_n}"),
        Command("filler", _filler, "/filler K", "add the target's top-K predictions to the n-gram store (0: off)",
                lambda app: str(s(app).strategy.ngram_filler_top_k)),
        Command("ngram-reset", _ngram_reset, "/ngram-reset [on|off]",
                "on: a fresh n-gram store for each prompt; off: it persists",
                lambda app: on_off(s(app).strategy.ngram_reset_each_prompt)),
        Command("lookup-ngram", _lookup_ngram, "/lookup-ngram MAX [MIN]", "prompt lookup n-gram sizes",
                lambda app: f"{s(app).strategy.lookup_max_ngram} {s(app).strategy.lookup_min_ngram}"),
        Command("alternatives", _alternatives, "/alternatives N",
                "greedy: verify the draft model's next N best tokens at each depth too (0: a chain)",
                lambda app: str(s(app).strategy.draft_alternatives)),
        Command("width", _width, "/width W",
                "the most tokens one verify forward takes: alternatives and other copies fill up to it",
                lambda app: str(s(app).strategy.verify_width)),
        Command("cumulative", _cumulative, "/cumulative P",
                "the draft model stops once the product of its token probabilities falls below P (0: off)",
                lambda app: f"{s(app).strategy.draft_cumulative:g}"),
        Command("lookahead-params", _lookahead_params, "/lookahead-params W N G",
                "lookahead: Jacobi window W, n-gram size N, verified candidates G",
                lambda app: f"{s(app).strategy.lookahead_window} {s(app).strategy.lookahead_ngram} "
                            f"{s(app).strategy.lookahead_candidates}"),
        Command("beams", _beams, "/beams N", "beam search width",
                lambda app: str(s(app).strategy.num_beams)),
        Command("stats", _stats, "/stats", "the last turn in detail, and session totals"),
        Command("clear", _clear, "/clear", "clear the screen"),
        Command("save", _save, "/save FILE", "save the transcript (FILE.json: JSON, otherwise markdown)"),
    ]
    table: dict[str, Command] = {}
    for command in head + rest + toggles:  # a strategy named like a command keeps the command (/strategies too)
        for name in (command.name, *command.aliases):
            table.setdefault(name, command)
    order = {id(command): i for i, command in enumerate(head + toggles + rest)}  # /help: toggles after /strategies
    return dict(sorted(table.items(), key=lambda item: order[id(item[1])]))


def _strategy_state(session: ChatSession, name: str) -> str:
    if name in NEEDS_DRAFTER and session.drafter is None:
        return "unavailable (no drafter)"
    return on_off(name in session.settings.strategies)


def find(commands: dict[str, Command], name: str) -> Command:
    if name.lower() in commands:
        return commands[name.lower()]
    close = difflib.get_close_matches(name.lower(), list(commands), n=1, cutoff=0.5)
    hint = f"; did you mean /{close[0]}?" if close else "; /help lists the commands"
    raise UsageError(f"unknown command /{name}{hint}")


def dispatch(app: ChatApp, line: str) -> Outcome:
    """Run one slash-command line. Bad input gets one line (and the usage); nothing but /quit ends the session."""
    name, _, arg = line.strip().removeprefix("/").partition(" ")
    if not name:
        warn(app, "type a command after the slash; /help lists them")
        return Outcome.CONTINUE
    try:
        command = find(app.commands, name)
    except UsageError as error:
        warn(app, str(error))
        return Outcome.CONTINUE
    try:
        return command.handler(app, arg.strip()) or Outcome.CONTINUE
    except ValueError as error:  # UsageError, and the engine's own checks (processor parameters, settings)
        warn(app, f"/{command.name}: {error}  (usage: {command.usage})")
        return Outcome.CONTINUE


def warn(app: ChatApp, text: str) -> None:
    """One line, however narrow the terminal (the terminal wraps it, not rich)."""
    app.console.print(text, style="yellow", markup=False, soft_wrap=True)
