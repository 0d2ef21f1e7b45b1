"""The flags infer.py and bench.py share: the model choice and the decoding settings.

`add_model_flags` and `add_decoding_flags` put them on a parser; `model_choice` and `decoding` build what they
describe. Nothing here checks a bound: the settings dataclasses do, and `decoding` words their error with the flag's
name (`FlagError`). Importable without torch, so that bad flags are refused, and --help answers, at once.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from models.presets import QUANTIZE_CHOICES, ModelLoadError, check_device_name, check_dtype_name, check_preset_name
from sampling.base import DecodeConfig
from sampling.settings import CALIBRATED, StrategySettings
from utils.checks import SettingError, integer
from utils.logits_processor import make_processor

FLAG_OF_SETTING = {
    "gamma": "--gamma", "draft_alternatives": "--alternatives", "verify_width": "--verify-width",
    "draft_cumulative": "--draft-cumulative", "lookahead_window": "--lookahead W", "lookahead_ngram": "--lookahead N",
    "lookahead_candidates": "--lookahead G", "num_beams": "--num-beams", "temperature": "--temperature",
    "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p", "max_new_tokens": "--max-new-tokens",
    "seed": "--seed", "head_branch": "--head-branch",
}


# the calibrated settings' argparse names: given on the command line, calibration leaves them be
CALIBRATED_FLAGS = {name: FLAG_OF_SETTING[name].removeprefix("--").replace("-", "_") for name in CALIBRATED}


class FlagError(Exception):
    """A flag's value is wrong; the message is one line for the user and names the flag."""


def add_model_flags(group: argparse._ActionsContainer) -> None:
    group.add_argument("--preset", default="auto",
                       help="model pair: auto (llama-3.2 with CUDA, else embedded), embedded, llama-3.2")
    group.add_argument("--target", "--model", "-m", metavar="SPEC",
                       help="target model: an embedded name, a saved directory, a .gguf file or a Hub id "
                            "(replaces the preset; then the drafter is --drafter or none)")
    group.add_argument("--drafter", "--model-draft", "-md", "--assistant-model", metavar="SPEC",
                       help="drafter model, same kinds of SPEC (the same tokenizer as the target); 'none' for none")
    group.add_argument("--device", metavar="DEVICE", help="auto, cpu, cuda, cuda:N or mps (default: the preset's)")
    group.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16 or float64")
    low_bit = ("int4 needs bfloat16; q4k: a GGUF's own Q4_K weights on a CPU, the rest float32; auto: int4 on a bf16 "
               "CPU, int8 on CUDA (default: the preset's)")
    group.add_argument("--target-quantize", choices=QUANTIZE_CHOICES, help=f"target weights; {low_bit}")
    group.add_argument("--drafter-quantize", choices=QUANTIZE_CHOICES, help=f"drafter weights; {low_bit}")
    group.add_argument("--head", action="append", metavar="DIR",
                       help="a trained draft head for the eagle or medusa strategy (train_head.py makes one; "
                            "repeat for both kinds); default: the heads the project ships for the target; "
                            "'none' for none")
    group.add_argument("--trust-remote-code", action="store_true", help="allow models that ship their own code")
    group.add_argument("--verify", action="store_true",
                       help="check the sha256 of every file of a converted model (sizes are checked on every load)")
    group.add_argument("--cache-dir", type=Path, metavar="DIR",
                       help="where converted embedded models (and the chat's input history) are kept "
                            "(default $XDG_CACHE_HOME/specchat, else ~/.cache/specchat)")


def add_decoding_flags(group: argparse._ActionsContainer, max_new_tokens: int | None, seed: int | None,
                       max_new_tokens_help: str = "max new tokens per answer") -> None:
    """`max_new_tokens` and `seed`: the command line's defaults (None: its own rule, or a random seed)."""
    s = StrategySettings
    calibrated = "calibrated for this machine (without calibration {})"
    group.add_argument("--gamma", "--draft-max", "--num-assistant-tokens", type=int, metavar="N",
                       help="the most tokens drafted per round; default: " + calibrated.format(s.gamma))
    group.add_argument("--max-new-tokens", "-n", "--n-predict", type=int, default=max_new_tokens, metavar="N",
                       help=max_new_tokens_help)
    group.add_argument("--temperature", "--temp", type=float, default=0.0, metavar="T", help="0 = greedy")
    group.add_argument("--top-k", type=int, metavar="K", help="top-k sampling (with --temperature > 0)")
    group.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling (with --temperature > 0)")
    group.add_argument("--min-p", type=float, metavar="P",
                       help="min-p sampling (with --temperature > 0; replaces --top-k and --top-p)")
    group.add_argument("--seed", "-s", type=int, default=seed, metavar="N",
                       help="sampling seed" + (" (default: random)" if seed is None else ""))
    group.add_argument("--num-beams", type=int, default=s.num_beams, metavar="N",
                       help="beam width for the beam strategy")
    group.add_argument("--alternatives", type=int, metavar="N",
                       help="greedy: also verify the draft model's next N best tokens at each depth (0: a chain); "
                            "default: " + calibrated.format(s.draft_alternatives))
    group.add_argument("--verify-width", type=int, metavar="W",
                       help="the most tokens one verify forward takes: the draft model's alternatives and prompt "
                            "lookup's other copies fill up to it, the least likely dropped first; default: "
                            + calibrated.format(s.verify_width))
    group.add_argument("--draft-cumulative", type=float, metavar="P",
                       help="the draft model stops once the product of its probabilities of its tokens (its "
                            "estimate that the whole draft is accepted) falls below P; 0: always --gamma tokens; "
                            "default: " + calibrated.format(s.draft_cumulative))
    group.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=True,
                       help="time this machine's forwards once (seconds; kept in the cache dir) and choose gamma, "
                            "the verify width, the alternatives and the cumulative stop from them; --no-calibrate "
                            "keeps the built-in defaults")
    group.add_argument("--head-branch", type=int, default=s.head_branch, metavar="N",
                       help="eagle and medusa: each draft node's likeliest children kept in the tree (1: a chain)")
    group.add_argument("--typical", action="store_true",
                       help="sampling with eagle or medusa: Medusa's typical acceptance (threshold 0.09, alpha 0.3). "
                            "NOT lossless: the answer no longer follows the target's distribution")
    group.add_argument("--lookahead", type=int, nargs=3, metavar=("W", "N", "G"),
                       default=(s.lookahead_window, s.lookahead_ngram, s.lookahead_candidates),
                       help="lookahead window W, n-gram size N, verified candidates G")


@dataclass(frozen=True)
class ModelChoice:
    target: str
    drafter: str | None
    device: str
    target_quantize: str
    drafter_quantize: str
    preset: str | None  # None: --target replaced the preset


def check_model_names(args: argparse.Namespace) -> None:
    """--preset, --dtype and --device by name, before anything imports torch (loading them takes seconds)."""
    try:
        check_preset_name(args.preset)
        check_dtype_name(args.dtype)
        if args.device is not None:
            check_device_name(args.device)
    except ModelLoadError as error:
        raise FlagError(str(error)) from None


def model_choice(args: argparse.Namespace, resolve_preset) -> ModelChoice:
    """The preset, with --target/--drafter/--device/--*-quantize overriding it."""
    if args.target:
        target, drafter, device, target_q, drafter_q = args.target, args.drafter, "auto", "none", "none"
        preset = None
    else:
        resolved = resolve_preset(args.preset)
        target, drafter, device = resolved.target, args.drafter or resolved.drafter, resolved.device
        target_q, drafter_q, preset = resolved.target_quantize, resolved.drafter_quantize, resolved.name
    if drafter is not None and drafter.lower() == "none":
        drafter = None
    return ModelChoice(target, drafter, args.device or device, args.target_quantize or target_q,
                       args.drafter_quantize or drafter_q, preset)


@dataclass(frozen=True)
class Decoding:
    strategy: StrategySettings
    config: DecodeConfig  # no end ids yet: they come with the tokenizer
    ignored: str | None  # the sampling flags given that the processor does not use, as a warning
    explicit: frozenset[str]  # the calibrated settings (CALIBRATED) given as flags: calibration leaves them be


def decoding(args: argparse.Namespace) -> Decoding:
    """The settings the decoding flags describe; a `FlagError` naming the flag where one is out of bounds."""
    window, ngram, candidates = args.lookahead
    try:
        # An answer of no tokens is no answer: both command lines ask for one at least (DecodeConfig allows 0).
        integer("max_new_tokens", args.max_new_tokens, 1)
        given = {name: getattr(args, flag) for name, flag in CALIBRATED_FLAGS.items()
                 if getattr(args, flag) is not None}
        strategy = StrategySettings(num_beams=args.num_beams, lookahead_window=window, lookahead_ngram=ngram,
                                    lookahead_candidates=candidates, head_branch=args.head_branch,
                                    typical=args.typical, **given)
        processor = make_processor(args.temperature, args.top_k, args.top_p, args.min_p)
        config = DecodeConfig(args.max_new_tokens, processor, seed=args.seed)
    except SettingError as error:
        flag = FLAG_OF_SETTING.get(error.setting, error.setting)
        raise FlagError(f"{flag} {error.requirement}, got {error.value}") from None
    return Decoding(strategy, config, ignored_sampling_flags(args), frozenset(given))


def ignored_sampling_flags(args: argparse.Namespace) -> str | None:
    given = [flag for flag, value in (("--top-k", args.top_k), ("--top-p", args.top_p), ("--min-p", args.min_p))
             if value is not None]
    if given and args.temperature == 0:
        return f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} ignored: --temperature 0 is greedy"
    if args.min_p is not None and len(given) > 1:
        filters = [flag for flag in given if flag != "--min-p"]
        return f"{', '.join(filters)} {'is' if len(filters) == 1 else 'are'} ignored: --min-p replaces them"
    return None
