"""The flags infer.py and bench.py share: the model choice and the decoding settings.

`add_model_flags` and `add_decoding_flags` put them on a parser (the decoding flags derived from the settings'
descriptions, `app.settings`); `model_choice` and `decoding` build what they describe. Nothing here checks a bound:
the settings dataclasses do, and `decoding` words their error with the flag's name (`FlagError`). Importable without
torch, so that bad flags are refused, and --help answers, at once.
"""

from __future__ import annotations

import argparse
import getpass
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.settings import SETTINGS, Setting, flag_of
from models.placement import DEVICE_MAP_NAMES, Placement, check_device_map_name, parse_max_memory
from models.presets import QUANTIZE_CHOICES, check_device_name, check_dtype_name, check_preset_name
from sampling.base import DecodeConfig
from sampling.settings import CALIBRATED, StrategySettings
from utils.checks import SettingError, integer
from utils.errors import ModelLoadError
from utils.logits_processor import make_processor
from utils.paths import output_dir_problem

KERNEL_SETS = ("amx-int8", "avx512-tiles", "avx512-vnni", "avx2")  # csrc/ops.cpp's names, best first
# What torch and oneDNN are held to where --kernels names a set below the CPU's best: their own kernels then match it.
TORCH_ISA = {"avx512-tiles": ("avx512", "AVX512_CORE_BF16"), "avx512-vnni": ("avx512", "AVX512_CORE_BF16"),
             "avx2": ("avx2", "AVX2")}


def hold_torch_to(kernel_set: str | None) -> None:
    """Before torch loads: its CPU kernels and oneDNN's held to `kernel_set`'s instructions (--kernels), where the
    environment does not already say. Torch held to a capability compiles into an inductor cache of its own: the
    shared one serves code vectorized for another instruction set, which then computes wrong values."""
    if kernel_set in TORCH_ISA:
        aten, onednn = TORCH_ISA[kernel_set]
        os.environ.setdefault("ATEN_CPU_CAPABILITY", aten)
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", onednn)
    capability = os.environ.get("ATEN_CPU_CAPABILITY", "")
    if capability.isalnum():
        user = "".join(c if c.isalnum() else "_" for c in getpass.getuser())
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                              os.path.join(tempfile.gettempdir(), f"torchinductor_{user}_{capability}"))


class FlagError(Exception):
    """A flag's value is wrong; the message is one line for the user and names the flag."""


def add_model_flags(group: argparse._ActionsContainer) -> None:
    group.add_argument("--preset", default="auto",
                       help="model pair: auto (llama-3.2 with CUDA, else embedded), embedded, llama-3.2")
    group.add_argument("--target", "--model", "-m", metavar="SPEC",
                       help="target model: an embedded name, a saved directory, a .gguf file or a Hub id "
                            "(replaces the preset; then the drafter is --drafter or none)")
    group.add_argument("--drafter", "--model-draft", "-md", "--assistant-model", metavar="SPEC",
                       help="drafter model, same kinds of SPEC; one with another tokenizer than the target's "
                            "drafts text, re-tokenized for the target; 'none' for none")
    group.add_argument("--device", metavar="DEVICE", help="auto, cpu, cuda, cuda:N or mps (default: the preset's)")
    group.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16 or float64")
    low_bit = ("gguf: the GGUF file's own blocks on the project's CPU kernels, the rest float32 (dense weights, with "
               "one line, where they cannot run); q8_0: dense weights quantized to Q8_0 blocks at load, on the same "
               "kernels; int4 needs bfloat16; q4k: a GGUF's own Q4_K weights on the int4 kernel; auto: gguf for a "
               "GGUF-backed model where the kernels run, else on a CPU q8_0 or int4 as timed on this machine, int8 "
               "on CUDA (default: the preset's)")
    group.add_argument("--target-quantize", choices=QUANTIZE_CHOICES, help=f"target weights; {low_bit}")
    group.add_argument("--drafter-quantize", choices=QUANTIZE_CHOICES, help=f"drafter weights; {low_bit}")
    placed = ("accelerate's big-model inference: auto fills the GPUs in order, then the CPU, then disk; balanced "
              "spreads the layers evenly over the GPUs; a device name puts the whole model there. Dense weights only "
              "(the preset's low-bit formats give way to them)")
    group.add_argument("--device-map", metavar="MAP",
                       help=f"where the target's layers go: {DEVICE_MAP_NAMES}; {placed}")
    group.add_argument("--max-memory", metavar="DEV=SIZE,...",
                       help="with --device-map auto or balanced: the most each device holds of the target "
                            "(0=20GiB,cpu=40GiB; accelerate's max_memory: only the devices named hold weights)")
    group.add_argument("--drafter-device-map", metavar="MAP",
                       help="where the drafter's layers go, as --device-map (it may run on another device than the "
                            "target: only tokens cross)")
    group.add_argument("--drafter-max-memory", metavar="DEV=SIZE,...", help="as --max-memory, for the drafter")
    group.add_argument("--offload-dir", type=Path, metavar="DIR",
                       help="where weights that fit on no device are kept (disk offload; read back layer by layer)")
    group.add_argument("--head", action="append", metavar="DIR",
                       help="a trained draft head for the eagle or medusa strategy (train_head.py makes one; "
                            "repeat for both kinds); default: the heads the project ships for the target; "
                            "'none' for none")
    group.add_argument("--draft-vocabulary", type=draft_vocabulary_size, metavar="K",
                       help="the draft model drafts from the target's K most frequent tokens (its output layer read "
                            "for those rows only; counted on the answers the project ships for the target); 0: its "
                            "whole vocabulary (default: the size the calibration finds pays on this machine, or 0)")
    group.add_argument("--trust-remote-code", action="store_true", help="allow models that ship their own code")
    group.add_argument("--verify", action="store_true",
                       help="check the sha256 of every file of a converted model (sizes are checked on every load)")
    group.add_argument("--kernels", choices=KERNEL_SETS, metavar="SET",
                       help="the instruction set the project's CPU kernels run: "
                            f"{', '.join(KERNEL_SETS)} (default: the best this CPU runs). A lesser one runs as on "
                            "a CPU that has only it: torch's own kernels follow (ATEN_CPU_CAPABILITY and "
                            "ONEDNN_MAX_CPU_ISA, unless set), and with avx2 the benchmark's llama.cpp runs its AVX2 "
                            "build (./setup.sh --llamacpp avx2)")
    group.add_argument("--cache-dir", type=Path, metavar="DIR",
                       help="where converted embedded models (and the chat's input history) are kept "
                            "(default $XDG_CACHE_HOME/specchat, else ~/.cache/specchat)")


def add_decoding_flags(group: argparse._ActionsContainer, max_new_tokens: int | None, seed: int | None,
                       max_new_tokens_default: str = "") -> None:
    """Each setting's flag (`app.settings.SETTINGS`), and --calibrate. `max_new_tokens` and `seed`: the command
    line's defaults (None: its own rule, said in `max_new_tokens_default`, or a random seed)."""
    scripts = {"max_new_tokens": (max_new_tokens, max_new_tokens_default),
               "seed": (seed, "default: random" if seed is None else ""), "temperature": (0.0, "")}
    for setting in SETTINGS:
        if setting.flags:
            add_flag(group, setting, *scripts.get(setting.name, (None, "")))
    group.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=True,
                       help="time this machine's forwards once (seconds; kept in the cache dir) and choose gamma, "
                            "the verify width, the alternatives and the cumulative stop from them; --no-calibrate "
                            "keeps the built-in defaults")


def add_flag(group: argparse._ActionsContainer, setting: Setting, default: Any, note: str) -> None:
    """`setting`'s flag: its type and help; the default a strategy setting's dataclass gives it, but none where
    calibration chooses it."""
    values = setting.values
    if values[0].type is bool:  # --flag / --no-flag; neither: the dataclass's default
        group.add_argument(*setting.flags, action=argparse.BooleanOptionalAction, default=None, help=setting.help)
        return
    if setting.of == "strategy":
        builtin = tuple(getattr(StrategySettings, value.field) for value in values)
        default = None if setting.calibrated else builtin if len(values) > 1 else builtin[0]
        if setting.calibrated:
            note = f"default: calibrated for this machine (without calibration {builtin[0]})"
    shape = {"nargs": len(values), "metavar": tuple(v.metavar for v in values)} if len(values) > 1 else \
        {"metavar": values[0].metavar}
    group.add_argument(*setting.flags, type=values[0].type, default=default,
                       help=setting.help + (f"; {note}" if note else ""), **shape)


@dataclass(frozen=True)
class ModelChoice:
    target: str
    drafter: str | None
    device: str
    target_quantize: str
    drafter_quantize: str
    preset: str | None  # None: --target replaced the preset
    target_placement: Placement | None = None  # --device-map and friends; None: on `device`
    drafter_placement: Placement | None = None


def draft_vocabulary_size(text: str) -> int:
    """--draft-vocabulary's K: a whole number, 0 or more."""
    try:
        size = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of tokens (0: the whole vocabulary), not {text!r}") from None
    if size < 0:
        raise argparse.ArgumentTypeError(f"a number of tokens, 0 or more (0: the whole vocabulary), not {size}")
    return size


def check_model_names(args: argparse.Namespace) -> None:
    """--preset, --dtype and --device by name, before anything imports torch (loading them takes seconds)."""
    try:
        check_preset_name(args.preset)
        check_dtype_name(args.dtype)
        if args.device is not None:
            check_device_name(args.device)
        placements(args)
    except ModelLoadError as error:
        raise FlagError(str(error)) from None


def placements(args: argparse.Namespace) -> tuple[Placement | None, Placement | None]:
    """The target's and the drafter's placement from --device-map, --max-memory, --offload-dir and the drafter's;
    ModelLoadError (one line, naming the flag) for a wrong one."""
    def one(map_flag: str, memory_flag: str) -> Placement | None:
        device_map, memory = getattr(args, _dest(map_flag)), getattr(args, _dest(memory_flag))
        if device_map is None:
            if memory is not None:
                raise ModelLoadError(f"{memory_flag} needs {map_flag} auto or balanced")
            return None
        placement = Placement(check_device_map_name(device_map, map_flag),
                              parse_max_memory(memory, memory_flag) if memory is not None else {}, args.offload_dir)
        if memory is not None and not placement.computed:
            raise ModelLoadError(f"{memory_flag} needs {map_flag} auto or balanced, not a whole device "
                                 f"({placement.device_map})")
        return placement

    chosen = one("--device-map", "--max-memory"), one("--drafter-device-map", "--drafter-max-memory")
    if args.offload_dir is not None:
        if not any(p is not None and p.computed for p in chosen):
            raise ModelLoadError("--offload-dir needs --device-map (or --drafter-device-map) auto or balanced")
        if (problem := output_dir_problem(args.offload_dir, "--offload-dir")):
            raise ModelLoadError(problem)
    return chosen


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


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
    target_placement, drafter_placement = placements(args)
    # a placed model loads its dense weights: the preset's low-bit format gives way, a flag's is the loader's to refuse
    target_q = args.target_quantize or ("none" if target_placement else target_q)
    drafter_q = args.drafter_quantize or ("none" if drafter_placement else drafter_q)
    return ModelChoice(target, drafter, args.device or device, target_q, drafter_q, preset, target_placement,
                       drafter_placement)


@dataclass(frozen=True)
class Decoding:
    strategy: StrategySettings
    config: DecodeConfig  # no end ids yet: they come with the tokenizer
    ignored: str | None  # the sampling flags given that the processor does not use, as a warning
    explicit: frozenset[str]  # the calibrated settings (CALIBRATED) given as flags: calibration leaves them be


def decoding(args: argparse.Namespace) -> Decoding:
    """The settings the decoding flags describe; a `FlagError` naming the flag where one is out of bounds."""
    try:
        # An answer of no tokens is no answer: both command lines ask for one at least (DecodeConfig allows 0).
        integer("max_new_tokens", args.max_new_tokens, 1)
        given = strategy_flags(args)
        strategy = StrategySettings(**given)
        processor = make_processor(args.temperature, args.top_k, args.top_p, args.min_p)
        config = DecodeConfig(args.max_new_tokens, processor, seed=args.seed)
    except SettingError as error:
        raise FlagError(f"{flag_of(error.setting)} {error.requirement}, got {error.value}") from None
    explicit = frozenset(name for name in given if name in CALIBRATED)
    return Decoding(strategy, config, ignored_sampling_flags(args), explicit)


def strategy_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The StrategySettings fields the flags give (a calibrated one only where it was given)."""
    given: dict[str, Any] = {}
    for setting in SETTINGS:
        value = getattr(args, setting.dest) if setting.flags and setting.of == "strategy" else None
        if value is not None:
            given.update(zip(setting.fields, value if len(setting.values) > 1 else (value,), strict=True))
    return given


def ignored_sampling_flags(args: argparse.Namespace) -> str | None:
    given = [flag for flag, value in (("--top-k", args.top_k), ("--top-p", args.top_p), ("--min-p", args.min_p))
             if value is not None]
    if given and args.temperature == 0:
        return f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} ignored: --temperature 0 is greedy"
    if args.min_p is not None and len(given) > 1:
        filters = [flag for flag in given if flag != "--min-p"]
        return f"{', '.join(filters)} {'is' if len(filters) == 1 else 'are'} ignored: --min-p replaces them"
    return None
