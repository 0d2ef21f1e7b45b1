"""Chat with a target LLM and a smaller drafter, comparing decoding strategies live; or run one prompt for a script.

    python infer.py                                  # the REPL on the default preset
    python infer.py --target DIR --drafter DIR       # your own pair (saved dirs, .gguf files, embedded names, Hub ids)
    python infer.py -p "Hello" --json                # one prompt, one JSON object on stdout
    python infer.py --serve --port 8080              # an OpenAI-compatible server (/v1/chat/completions)

Exit codes: 0 done, 1 the models could not be loaded, 2 bad flags or input, 130 interrupted.
"""

# ruff: noqa: E402 (the entry point comes before the imports that take time, so that it handles a Ctrl-C in them)
from __future__ import annotations

import sys

USAGE_EXIT, LOAD_EXIT, INTERRUPTED_EXIT = 2, 1, 130

if __name__ == "__main__":  # before the imports below: a Ctrl-C while they load ends it in one line too
    from app.startup import guarded_main

    guarded_main("infer")

import argparse
import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from app.flags import (
    Decoding,
    FlagError,
    add_decoding_flags,
    add_model_flags,
    check_model_names,
    decoding,
    hold_torch_to,
    model_choice,
)
from chat.undecodable import notice, replace_undecodable
from models.presets import default_cache_dir
from sampling.settings import NEEDS_DRAFTER, NEEDS_HEAD, STRATEGIES
from serve.cli import add_server_flags, check_server_flags

DEFAULT_STRATEGIES = ("auto", "speculative", "autoregressive")  # eagle and medusa: /eagle, /medusa, --strategy
DEFAULT_MAX_NEW_TOKENS = 256


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only where there is one worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class InputError(Exception):
    """A flag or an input file is wrong; the message is one line for the user."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="infer.py", description=__doc__.split("\n\n")[0],
        epilog="In the REPL, /help lists the commands that change these settings while chatting.",
        formatter_class=HelpFormatter)
    models = p.add_argument_group("models")
    add_model_flags(models)
    models.add_argument("--compile", action=argparse.BooleanOptionalAction,
                        help="compile the drafter's short forwards, then the target's forward where its "
                             "linears are the project's CPU kernels (torch.compile; a minute or more, in the "
                             "background, held while a turn decodes; the target switches at the next turn). "
                             "Default: on in the chat on a CPU, off for one prompt (-p)")
    decoding_flags = p.add_argument_group("decoding")
    decoding_flags.add_argument("--strategy", "--strategies", metavar="LIST",
                                help=f"comma-separated strategies to run, in order; the first one's answer goes into "
                                     f"the chat history (default: {','.join(DEFAULT_STRATEGIES)}, without the drafter "
                                     f"ones when there is no drafter). Choices: {', '.join(STRATEGIES)}")
    add_decoding_flags(decoding_flags, max_new_tokens=DEFAULT_MAX_NEW_TOKENS, seed=None)
    decoding_flags.add_argument("--ignore-eos", action="store_true", help="keep generating past end tokens")
    chat = p.add_argument_group("chat")
    chat.add_argument("--system", "--system-prompt", "-sys", metavar="TEXT", help="system prompt")
    chat.add_argument("--no-chat", action="store_true", help="raw completion: no chat template, no history")
    chat.add_argument("--debug", action="store_true", help="start with /debug on (tokens coloured by origin)")
    chat.add_argument("--no-compare", action="store_true", help="start with /compare off (only the first strategy)")
    oneshot = p.add_argument_group("one-shot (no REPL)")
    source = oneshot.add_mutually_exclusive_group()
    source.add_argument("--prompt", "-p", metavar="TEXT", help="run this prompt and exit")
    source.add_argument("--prompt-file", "--file", "-f", type=Path, metavar="PATH",
                        help="run this file's text and exit")
    oneshot.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout "
                                                              "(everything else goes to stderr)")
    serve = p.add_argument_group("serving engines")
    serve.add_argument("--export", nargs="+", metavar=("ENGINE", "FILE"),
                       help="print the command that serves the target with its drafter, head or lookup settings "
                            "(the first drafting --strategy) and --gamma on vllm, sglang or llamacpp, and exit; with "
                            "FILE also write it there as a script (the chat's /export takes the calibrated settings)")
    add_server_flags(p)
    p.add_argument("--verbose", "-v", action="store_true", help="library warnings and tracebacks")
    return p


def parse_strategies(text: str | None, has_drafter: bool, heads: frozenset[str] | None = None) -> tuple[str, ...]:
    """--strategy as a tuple; by default the drafter strategies are left out when there is no drafter, and the head
    strategies are added for the heads loaded (`heads`: their kinds; None: not loaded yet, nothing checked)."""
    explicit = text is not None
    names = tuple(name.strip().lower() for name in (text if explicit else ",".join(DEFAULT_STRATEGIES)).split(",")
                  if name.strip())
    if not names:
        raise InputError("--strategy needs at least one strategy")
    for name in names:
        if name not in STRATEGIES:
            raise InputError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
    if len(set(names)) != len(names):
        raise InputError("--strategy lists a strategy twice")
    if not explicit:
        names = tuple(name for name in names if name not in NEEDS_HEAD or name in (heads or ()))
    elif heads is not None:
        missing = [name for name in names if name in NEEDS_HEAD and name not in heads]
        if missing:
            raise InputError(f"strategy {missing[0]!r} needs a trained {missing[0]} head; pass --head DIR "
                             f"(train_head.py --kind {missing[0]} makes one)")
    if has_drafter:
        return names
    if explicit and any(name in NEEDS_DRAFTER for name in names):
        needy = next(name for name in names if name in NEEDS_DRAFTER)
        raise InputError(f"strategy {needy!r} needs a drafter; pass --drafter SPEC or drop it from --strategy")
    return tuple(name for name in names if name not in NEEDS_DRAFTER) or ("autoregressive",)


def check_flags(args: argparse.Namespace) -> Decoding:
    """What can be checked before loading anything (loading takes seconds to minutes), without importing torch."""
    if args.json and args.prompt is None and args.prompt_file is None:
        raise InputError("--json needs --prompt or --prompt-file")
    if args.export is not None:
        check_export(args.export)
    if (problem := check_server_flags(args)) is not None:
        raise InputError(problem)
    parse_strategies(args.strategy, has_drafter=True)
    try:
        check_model_names(args)
        return decoding(args)
    except FlagError as error:
        raise InputError(str(error)) from None


def check_export(words: list[str]) -> None:
    """--export ENGINE [FILE]: the engine by name, and a FILE that can be written new (before anything loads)."""
    from app.export import ENGINES, printable

    if words[0].lower() not in ENGINES or len(words) > 2:
        raise InputError(f"--export takes an engine ({', '.join(ENGINES)}) and, to write it, a file; got "
                         f"{printable(' '.join(words))!r}")
    if len(words) == 1:
        return
    path, name = Path(words[1]), printable(words[1])
    if os.path.lexists(path):  # a dangling symlink too: the script is never written through one
        raise InputError(f"--export: {name} exists; give a new file name")
    folder = path.parent
    existing = next(p for p in (folder, *folder.parents) if p.exists() or p == p.parent)
    if not existing.is_dir():
        raise InputError(f"--export: {name} lies under the file {printable(str(existing))}; give a path in a folder")
    if existing != folder:
        raise InputError(f"--export: the folder {printable(str(folder))} does not exist; make it or give another path")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"--export: the folder {printable(str(folder))} is not writable; give a folder you can "
                         "write to")


def run_export(args: argparse.Namespace, chosen: Decoding, choice) -> int:
    """--export: the serving command for the chosen pair, read from the models' files (no weights are loaded)."""
    from transformers import AutoConfig

    from app.export import drafting_strategy, export, printable, serving
    from chat.transcript import write_file
    from models.loading import model_files
    from sampling.heads.layouts import head_kind
    from sampling.heads.networks import shipped_heads
    from utils.errors import ModelLoadError, one_line

    strategies = parse_strategies(args.strategy, choice.drafter is not None, frozenset(("eagle", "medusa")))
    files = model_files(choice.target, args.cache_dir, progress=False)
    heads = ([] if any(h.strip().lower() == "none" for h in args.head) else [Path(h) for h in args.head]) \
        if args.head else shipped_heads(files.name)
    eagle = next((str(h) for h in heads if head_kind(h) == "eagle"), None)
    same_vocab = same_vocabulary(choice, args.cache_dir, progress=False)
    try:
        served = serving(args.export[0].lower(), choice.target, choice.drafter, eagle,
                         AutoConfig.from_pretrained(files.folder), args.cache_dir, same_vocab=same_vocab)
    except (OSError, ValueError) as error:  # a Hub id whose config is not at hand offline, a damaged config
        raise ModelLoadError(f"--export: cannot read the models' configs ({one_line(error)})") from None
    result = export(args.export[0].lower(), served, strategies, chosen.strategy)
    if drafting_strategy(strategies) and "gamma" not in chosen.explicit:
        result.notes.append(f"gamma {chosen.strategy.gamma}: the built-in default (give --gamma, or use /export in "
                            "the chat for the one calibrated on this machine)")
    name = printable(args.export[1]) if len(args.export) == 2 else None
    if name is not None:  # first: a file that cannot be written leaves one line, not a command and an error
        try:
            write_file(Path(args.export[1]), result.script())
            Path(args.export[1]).chmod(0o755)
        except FileExistsError:
            raise InputError(f"--export: {name} exists; give a new file name") from None
        except OSError as error:  # what check_export could not foresee (a file system that refuses it)
            raise InputError(f"--export: cannot write {name}: {error.strerror or error}") from None
    print(result.command)
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    if name is not None:
        print(f"wrote {name}", file=sys.stderr)
    return 0


def check_drafter_strategy(args: argparse.Namespace, choice) -> None:
    """--strategy drafter runs the drafter on the target's tokens: refused before the models load (a minute or more)
    where the drafter has another tokenizer, read from its files in a second."""
    if choice.drafter is None or args.strategy is None or "drafter" not in parse_strategies(args.strategy, True):
        return
    if not same_vocabulary(choice, args.cache_dir, progress=not args.json):
        raise InputError("strategy 'drafter' runs the drafter on the target's tokens, and this drafter has another "
                         "tokenizer; drop it from --strategy or pass a --drafter with the target's tokenizer")


def same_vocabulary(choice, cache_dir: Path | None, progress: bool) -> bool:
    """Whether the chosen drafter (if any) has the target's token -> id mapping, read from the tokenizers' files
    (no weights are loaded); ModelLoadError (one line) where they cannot be read."""
    if choice.drafter is None:
        return True
    from transformers import AutoTokenizer

    from models.loading import model_files
    from models.vocab import vocab_notice
    from utils.errors import ModelLoadError, one_line

    folders = [model_files(spec, cache_dir, progress=progress).folder for spec in (choice.target, choice.drafter)]
    try:
        target, drafter = (AutoTokenizer.from_pretrained(folder) for folder in folders)
    except (OSError, ValueError) as error:  # a Hub id not at hand offline, a damaged tokenizer file
        raise ModelLoadError(f"cannot read the models' tokenizers ({one_line(error)})") from None
    return vocab_notice(target, drafter) is None


def history_file(cache_dir: Path | None) -> Path:
    """The REPL's input history, beside the converted models (--cache-dir, else $XDG_CACHE_HOME/specchat)."""
    return (cache_dir or default_cache_dir()) / "history"


def read_prompt(args: argparse.Namespace) -> str | None:
    if args.prompt_file is None:
        return args.prompt
    try:
        return args.prompt_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or error
        raise InputError(f"cannot read --prompt-file {args.prompt_file}: {reason}") from None


def replace_undecodable_flag(text: str | None, flag: str, errors: Console) -> str | None:
    """A flag's text with the bytes that are not UTF-8 replaced (the command line hands them over undecoded), said."""
    if text is None:
        return None
    text, undecodable = replace_undecodable(text)
    if undecodable:
        errors.print(f"infer.py: warning: {notice(flag, undecodable)}", style="yellow", markup=False, soft_wrap=True)
    return text


def make_settings(args: argparse.Namespace, chosen: Decoding, strategies: tuple[str, ...], strategy):
    """The chat's settings: the flags', with `strategy` (the engine's, calibrated) for the drafting ones."""
    from chat.session import ChatSettings

    config = chosen.config
    try:
        return ChatSettings(strategies=strategies, strategy=strategy, processor=config.processor,
                            max_new_tokens=config.max_new_tokens, seed=config.seed, chat_template=not args.no_chat,
                            system=args.system, ignore_eos=args.ignore_eos)
    except ValueError as error:
        raise InputError(str(error)) from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    hold_torch_to(args.kernels)  # before torch loads (and its inductor cache is chosen)
    one_shot = args.prompt is not None or args.prompt_file is not None
    # --json: stdout carries the JSON object only; the console, progress and stray prints go to stderr.
    console = Console(stderr=args.json, highlight=False)
    errors = Console(stderr=True, highlight=False)
    json_out = sys.stdout if args.json else None  # the real stdout, before it is redirected
    try:
        chosen = check_flags(args)
        if chosen.ignored:
            errors.print(f"infer.py: warning: {chosen.ignored}", style="yellow", markup=False, soft_wrap=True)
        prompt = read_prompt(args)
        prompt = replace_undecodable_flag(prompt, "--prompt", errors)
        args.system = replace_undecodable_flag(args.system, "--system", errors)
        if prompt is not None and not prompt.strip():
            raise InputError("the prompt is empty")
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
            return run(args, chosen, console, errors, prompt, one_shot, json_out)
    except InputError as error:
        errors.print(f"infer.py: error: {error}", style="red", markup=False, soft_wrap=True)
        return USAGE_EXIT
    except KeyboardInterrupt:
        errors.print("interrupted", style="yellow")
        return INTERRUPTED_EXIT


def run(args: argparse.Namespace, chosen: Decoding, console: Console, errors: Console, prompt: str | None,
        one_shot: bool, json_out) -> int:
    if not args.verbose:
        quiet_libraries()
    from app.engine import Engine
    from app.startup import load_options
    from chat.oneshot import run_oneshot
    from chat.repl import ChatRepl
    from chat.session import ChatSession
    from models.presets import resolve_preset
    from utils.errors import ModelLoadError

    try:
        choice = model_choice(args, resolve_preset)
        parse_strategies(args.strategy, choice.drafter is not None)
        check_drafter_strategy(args, choice)
        if args.export is not None:
            return run_export(args, chosen, choice)
        if not one_shot:
            errors.print(f"loading {choice.target}" + (f" + {choice.drafter}" if choice.drafter else "") + " …",
                          style="dim", markup=False)
        # one prompt compiles only when asked (and waits for it): a compile takes longer than the prompt
        engine = Engine.load(**load_options(args, choice), progress=not args.json, calibrate=args.calibrate,
                             settings=chosen.strategy, keep=chosen.explicit, report=ConsoleReport(errors, args.json),
                             compile=args.compile if args.compile is not None or not one_shot else False,
                             background=not one_shot,
                             yardstick=None if one_shot or args.serve or args.no_compare
                             else llamacpp_runner(args.cache_dir))
        strategies = parse_strategies(args.strategy, choice.drafter is not None, frozenset(engine.heads))
    except ModelLoadError as error:
        if args.verbose:
            raise
        errors.print(f"infer.py: error: {error}", style="red", markup=False, soft_wrap=True)
        return LOAD_EXIT
    if args.serve:
        from serve.cli import serve_engine

        return serve_engine(engine, args, strategies[0], errors)
    settings = make_settings(args, chosen, strategies, engine.settings)
    if settings.chat_template and not engine.tokenizer.chat_template:
        errors.print("the target's tokenizer has no chat template: raw completion", style="yellow")
    session = ChatSession(engine, settings)
    if one_shot:
        try:
            return run_oneshot(session, engine.info, prompt, console, json_out)
        except ValueError as error:  # the prompt does not fit the context
            raise InputError(str(error)) from None
    app = ChatRepl(session, console, engine.info, history_file(args.cache_dir), compare=not args.no_compare,
                   debug=args.debug)
    return app.run()


def llamacpp_runner(cache_dir: Path | None):
    """What times llama.cpp's plain speed on the target's GGUF here (`app.yardstick`), handed to the engine's start;
    it finds none where llama.cpp is not built or the target has no embedded GGUF."""
    from app.yardstick import PROMPT
    from benchmarks.llamacpp import plain_run

    return lambda pair: plain_run(pair, cache_dir or default_cache_dir(), PROMPT)


@dataclass(frozen=True)
class ConsoleReport:
    """The start's lines on stderr (`app.startup.Report`): what went wrong always, what was found out now unless
    `quiet` (--json), not what was kept from an earlier run."""

    errors: Console
    quiet: bool

    def status(self, text: str):
        return contextlib.nullcontext() if self.quiet else self.errors.status(text)

    def say(self, text: str, kind) -> None:
        from app.startup import Said

        if kind is Said.PROBLEM:
            self.errors.print(text, style="yellow", markup=False, soft_wrap=True)
        elif kind is Said.NEWS and not self.quiet:
            self.errors.print(text, style="dim", markup=False, soft_wrap=True)


def quiet_libraries() -> None:
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=UserWarning)
