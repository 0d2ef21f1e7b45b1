"""Chat with a target LLM and a smaller drafter, comparing decoding strategies live; or run one prompt for a script.

    python infer.py                                  # the REPL on the default preset
    python infer.py --target DIR --drafter DIR       # your own pair (saved dirs, .gguf files, embedded names, Hub ids)
    python infer.py -p "Hello" --json                # one prompt, one JSON object on stdout

Exit codes: 0 done, 1 the models could not be loaded, 2 bad flags or input, 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from sampling.settings import NEEDS_DRAFTER, STRATEGIES, StrategySettings
from utils.presets import QUANTIZE_CHOICES as QUANTIZE


DEFAULT_STRATEGIES = ("auto", "speculative", "autoregressive")
HISTORY_FILE = Path("~/.cache/specchat/history").expanduser()
USAGE_EXIT, LOAD_EXIT, INTERRUPTED_EXIT = 2, 1, 130


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
    models.add_argument("--preset", default="auto",
                        help="model pair: auto (llama-3.2 with CUDA, else embedded), embedded, llama-3.2")
    models.add_argument("--target", "--model", "-m", metavar="SPEC",
                        help="target model: an embedded name, a saved directory, a .gguf file or a Hub id "
                             "(replaces the preset; then the drafter is --drafter or none)")
    models.add_argument("--drafter", "--model-draft", "-md", "--assistant-model", metavar="SPEC",
                        help="drafter model, same kinds of SPEC; 'none' for no drafter")
    models.add_argument("--device", metavar="DEVICE", help="auto, cpu, cuda, cuda:N or mps (default: the preset's)")
    models.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16 or float64")
    low_bit = "int4 needs bfloat16; auto: int4 on a bf16 CPU, int8 on CUDA (default: the preset's)"
    models.add_argument("--target-quantize", choices=QUANTIZE, help=f"target weights; {low_bit}")
    models.add_argument("--drafter-quantize", choices=QUANTIZE, help=f"drafter weights; {low_bit}")
    models.add_argument("--compile", action=argparse.BooleanOptionalAction,
                        help="compile the drafter's one-token forward (torch.compile; tens of seconds, in the "
                             "background while the chat waits for the first prompt, which waits for it if sent "
                             "earlier). Default: on in the chat when the drafter runs on a CPU, off for one prompt (-p)")
    models.add_argument("--trust-remote-code", action="store_true", help="allow models that ship their own code")
    models.add_argument("--cache-dir", type=Path, metavar="DIR", help="where converted embedded models are kept "
                                                       "(default ~/.cache/specchat)")
    decoding = p.add_argument_group("decoding")
    decoding.add_argument("--strategy", "--strategies", metavar="LIST",
                          help=f"comma-separated strategies to run, in order; the first one's answer goes into the "
                               f"chat history (default: {','.join(DEFAULT_STRATEGIES)}, without the drafter ones "
                               f"when there is no drafter). Choices: {', '.join(STRATEGIES)}")
    decoding.add_argument("--gamma", "--draft-max", "--num-assistant-tokens", type=int,
                          default=StrategySettings.gamma, metavar="N",
                          help="the most tokens drafted per round")
    decoding.add_argument("--max-new-tokens", "-n", "--n-predict", type=int, default=256, metavar="N",
                          help="max new tokens per answer")
    decoding.add_argument("--temperature", "--temp", type=float, default=0.0, metavar="T", help="0 = greedy")
    decoding.add_argument("--top-k", type=int, metavar="K", help="top-k sampling (with --temperature > 0)")
    decoding.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling (with --temperature > 0)")
    decoding.add_argument("--min-p", type=float, metavar="P", help="min-p sampling (with --temperature > 0)")
    decoding.add_argument("--seed", "-s", type=int, metavar="N", help="sampling seed (default: random)")
    decoding.add_argument("--num-beams", type=int, default=4, metavar="N", help="beam width for the beam strategy")
    decoding.add_argument("--alternatives", type=int, default=StrategySettings.draft_alternatives, metavar="N",
                          help="greedy: also verify the draft model's next N best tokens at each depth")
    decoding.add_argument("--verify-width", type=int, default=StrategySettings.verify_width, metavar="W",
                          help="the most tokens one verify forward takes: the draft model's alternatives and prompt "
                               "lookup's other copies fill up to it, the least likely dropped first")
    decoding.add_argument("--draft-cumulative", type=float, default=StrategySettings.draft_cumulative, metavar="P",
                          help="the draft model stops once the product of its probabilities of its tokens (its "
                               "estimate that the whole draft is accepted) falls below P; 0: always --gamma tokens")
    decoding.add_argument("--lookahead", type=int, nargs=3, metavar=("W", "N", "G"),
                          default=(StrategySettings.lookahead_window, StrategySettings.lookahead_ngram,
                                   StrategySettings.lookahead_candidates),
                          help="lookahead window W, n-gram size N, verified candidates G")
    decoding.add_argument("--ignore-eos", action="store_true", help="keep generating past end tokens")
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
    p.add_argument("--verbose", "-v", action="store_true", help="library warnings and tracebacks")
    return p


@dataclass(frozen=True)
class ModelChoice:
    target: str
    drafter: str | None
    device: str
    target_quantize: str
    drafter_quantize: str


def choose_models(args: argparse.Namespace, resolve_preset) -> ModelChoice:
    """The preset, with --target/--drafter/--device/--*-quantize overriding it."""
    if args.target:
        target, drafter, device, target_q, drafter_q = args.target, args.drafter, "auto", "none", "none"
    else:
        preset = resolve_preset(args.preset)
        target, drafter, device = preset.target, args.drafter or preset.drafter, preset.device
        target_q, drafter_q = preset.target_quantize, preset.drafter_quantize
    if drafter is not None and drafter.lower() == "none":
        drafter = None
    return ModelChoice(target, drafter, args.device or device, args.target_quantize or target_q,
                       args.drafter_quantize or drafter_q)


def parse_strategies(text: str | None, has_drafter: bool) -> tuple[str, ...]:
    """--strategy as a tuple; by default the drafter strategies are left out when there is no drafter."""
    explicit = text is not None
    names = tuple(name.strip().lower() for name in (text or ",".join(DEFAULT_STRATEGIES)).split(",") if name.strip())
    if not names:
        raise InputError("--strategy needs at least one strategy")
    for name in names:
        if name not in STRATEGIES:
            raise InputError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
    if len(set(names)) != len(names):
        raise InputError("--strategy lists a strategy twice")
    if has_drafter:
        return names
    if explicit and any(name in NEEDS_DRAFTER for name in names):
        needy = next(name for name in names if name in NEEDS_DRAFTER)
        raise InputError(f"strategy {needy!r} needs a drafter; pass --drafter SPEC or drop it from --strategy")
    return tuple(name for name in names if name not in NEEDS_DRAFTER) or ("autoregressive",)


def check_flags(args: argparse.Namespace) -> None:
    """What can be checked before loading anything (loading takes seconds to minutes)."""
    if args.gamma < 1:
        raise InputError(f"--gamma must be >= 1, got {args.gamma}")
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.num_beams < 1:
        raise InputError(f"--num-beams must be >= 1, got {args.num_beams}")
    if args.temperature < 0:
        raise InputError(f"--temperature must be >= 0, got {args.temperature}")
    if args.alternatives < 0:
        raise InputError(f"--alternatives must be >= 0, got {args.alternatives}")
    if args.verify_width < 2:
        raise InputError(f"--verify-width must be >= 2 (the last token and one draft), got {args.verify_width}")
    if not 0 <= args.draft_cumulative < 1:
        raise InputError(f"--draft-cumulative must be in [0, 1), got {args.draft_cumulative}")
    window, ngram, candidates = args.lookahead
    if window < 1 or ngram < 2 or candidates < 1:
        raise InputError(f"--lookahead W N G needs W >= 1, N >= 2, G >= 1, got {window} {ngram} {candidates}")
    if args.json and args.prompt is None and args.prompt_file is None:
        raise InputError("--json needs --prompt or --prompt-file")
    make_settings(args, parse_strategies(args.strategy, has_drafter=True))  # strategy names, processor parameters


def read_prompt(args: argparse.Namespace) -> str | None:
    if args.prompt_file is None:
        return args.prompt
    try:
        return args.prompt_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(f"cannot read --prompt-file {args.prompt_file}: {getattr(error, 'strerror', None) or error}")


def make_settings(args: argparse.Namespace, strategies: tuple[str, ...]):
    from chat.session import ChatSettings
    from utils.logits_processor import make_processor

    try:
        processor = make_processor(args.temperature, args.top_k, args.top_p, args.min_p)
        return ChatSettings(strategies=strategies,
                            strategy=StrategySettings(gamma=args.gamma, num_beams=args.num_beams,
                                                      draft_alternatives=args.alternatives,
                                                      verify_width=args.verify_width,
                                                      draft_cumulative=args.draft_cumulative,
                                                      lookahead_window=args.lookahead[0],
                                                      lookahead_ngram=args.lookahead[1],
                                                      lookahead_candidates=args.lookahead[2]),
                            processor=processor, max_new_tokens=args.max_new_tokens, seed=args.seed,
                            chat_template=not args.no_chat, system=args.system, ignore_eos=args.ignore_eos)
    except ValueError as error:
        raise InputError(str(error)) from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    one_shot = args.prompt is not None or args.prompt_file is not None
    # --json: stdout carries the JSON object only; the console, progress and stray prints go to stderr.
    console = Console(stderr=args.json, highlight=False)
    errors = Console(stderr=True, highlight=False)
    json_out = sys.stdout if args.json else None  # the real stdout, before it is redirected
    try:
        check_flags(args)
        prompt = read_prompt(args)
        if prompt is not None and not prompt.strip():
            raise InputError("the prompt is empty")
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
            return run(args, console, errors, prompt, one_shot, json_out)
    except InputError as error:
        errors.print(f"infer.py: error: {error}", style="red", markup=False, soft_wrap=True)
        return USAGE_EXIT
    except KeyboardInterrupt:
        errors.print("interrupted", style="yellow")
        return INTERRUPTED_EXIT


def run(args: argparse.Namespace, console: Console, errors: Console, prompt: str | None, one_shot: bool,
        json_out) -> int:
    if not args.verbose:
        quiet_libraries()
    from chat.app import ChatApp
    from chat.oneshot import run_oneshot
    from chat.session import ChatSession, ModelInfo
    from utils.loading import load_pair
    from utils.presets import ModelLoadError, resolve_preset

    try:
        choice = choose_models(args, resolve_preset)
        strategies = parse_strategies(args.strategy, choice.drafter is not None)
        if not one_shot:
            errors.print(f"loading {choice.target}" + (f" + {choice.drafter}" if choice.drafter else "") + " …",
                          style="dim", markup=False)
        pair = load_pair(choice.target, choice.drafter, device=choice.device, dtype=args.dtype,
                         target_quantize=choice.target_quantize, drafter_quantize=choice.drafter_quantize,
                         trust_remote_code=args.trust_remote_code, cache_dir=args.cache_dir,
                         progress=not args.json)
    except ModelLoadError as error:
        if args.verbose:
            raise
        errors.print(f"infer.py: error: {error}", style="red", markup=False, soft_wrap=True)
        return LOAD_EXIT
    settings = make_settings(args, strategies)
    if settings.chat_template and not pair.target.tokenizer.chat_template:
        errors.print("the target's tokenizer has no chat template: raw completion", style="yellow")
    parameter = next(pair.target.model.parameters())
    info = ModelInfo(target=pair.target.label, drafter=pair.drafter.label if pair.drafter else None,
                     dtype=str(parameter.dtype).removeprefix("torch."), device=str(parameter.device))
    session = ChatSession(pair.target.tokenizer, pair.target.model, pair.drafter.model if pair.drafter else None,
                          pair.end_ids, settings, drafter_prefill_model=pair.drafter.dense if pair.drafter else None)
    session.warm_up()
    compile_drafter = args.compile if args.compile is not None else not one_shot and parameter.device.type == "cpu"
    if compile_drafter and pair.drafter is not None:
        session.compile_drafter()
        if one_shot:  # one prompt: wait for the graph, or it would not be used
            session.wait_for_compile()
    if one_shot:
        try:
            return run_oneshot(session, info, prompt, console, json_out)
        except ValueError as error:  # the prompt does not fit the context
            raise InputError(str(error)) from None
    app = ChatApp(session, console, info, HISTORY_FILE, compare=not args.no_compare, debug=args.debug)
    return app.run()


def quiet_libraries() -> None:
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=UserWarning)


if __name__ == "__main__":
    sys.exit(main())
