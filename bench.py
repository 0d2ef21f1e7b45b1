"""Benchmark our decoding strategies against Hugging Face `generate` baselines on a prompt set.

    python bench.py                                   # embedded pair (or --preset), the project's prompt set
    python bench.py --quick                           # smoke run: 2 prompts, 16 new tokens
    python bench.py --prompts ../shared/bench/mt_bench.jsonl --limit 2 --markdown results.md

Writes results.json (every raw measurement + the machine), summary.md and plot.png under --out, prints tables.
"""

# ruff: noqa: E402 (the entry point comes before the imports that take time, so that it handles a Ctrl-C in them)
from __future__ import annotations

import sys

INTERRUPTED_EXIT = 130

if __name__ == "__main__":  # before the imports below: a Ctrl-C while they load ends it in one line too
    from app.startup import guarded_main

    guarded_main("bench")

import argparse
import datetime
import shlex
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from app.flags import (
    FlagError,
    ModelChoice,
    add_decoding_flags,
    add_model_flags,
    check_model_names,
    decoding,
    hold_torch_to,
    model_choice,
)

# Only what the flags need: torch and transformers are imported once the flags are checked (main), so that a bad flag
# is refused at once, not after seconds of imports.
from benchmarks.names import DEFAULT_PROMPTS, HF_BASELINES, LLAMACPP, NEEDS_SAME_VOCAB, REFERENCE
from models.presets import default_cache_dir, resolve_preset
from sampling.settings import NEEDS_DRAFTER, NEEDS_HEAD, STRATEGIES, StrategySettings
from utils.checks import SettingError, integer
from utils.errors import ModelLoadError
from utils.paths import output_dir_problem
from utils.prompts import Prompt, load_prompts

if TYPE_CHECKING:
    from app.calibration import Calibration
    from app.engine import Engine
    from benchmarks.runner import Encoder, RunSettings
    from models.invariance import Invariance
    from models.loading import LoadedModel, LoadedPair

NOT_BY_DEFAULT = ("drafter", "beam")  # not speculative methods: measured only when asked for
UNIVERSAL_DRAFTER = "smollm2-135m"
QUICK_PROMPTS, QUICK_TOKENS, FULL_TOKENS = 2, 16, 128
SCHEMA_VERSION = 1
RESULTS_DIR = Path("benchmarks/results")  # committed runs, each with its results.json
RESULTS_PAGE = Path("benchmarks/RESULTS.md")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    models = p.add_argument_group("models")
    add_model_flags(models)
    models.add_argument("--universal-drafter", help="drafter with another tokenizer for hf_universal "
                        f"(default {UNIVERSAL_DRAFTER} with a preset, none with --target; 'none' to skip)")
    models.add_argument("--compile", action=argparse.BooleanOptionalAction,
                        help="compile our drafter's short forwards, and our target's forward where its linears "
                             "are the project's CPU kernels, before measuring (torch.compile; HF's models stay as "
                             "loaded). Default: on a CPU")
    models.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's choice)")
    run = p.add_argument_group("run")
    run.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="JSONL prompt set (`turns`, `category`)")
    run.add_argument("--categories", help="comma-separated categories to keep")
    run.add_argument("--limit", type=int, help="at most N prompts per category")
    run.add_argument("--strategies", help="comma-separated: ours (" + ", ".join(STRATEGIES) + "), HF baselines ("
                     + ", ".join(HF_BASELINES) + ") and llama.cpp (" + ", ".join(LLAMACPP) + ", built by ./setup.sh "
                     "--llamacpp); default: all but " + ", ".join(NOT_BY_DEFAULT + LLAMACPP))
    run.add_argument("--no-hf", action="store_true", help="skip the Hugging Face baselines")
    run.add_argument("--quick", action="store_true",
                     help=f"smoke run: {QUICK_PROMPTS} prompts, {QUICK_TOKENS} new tokens unless given")
    run.add_argument("--cost-repeats", type=int, help="timed forwards per cost measurement (default 7, 3 quick)")
    decoding_flags = p.add_argument_group("decoding")
    add_decoding_flags(decoding_flags, max_new_tokens=None, seed=0,
                       max_new_tokens_default=f"default {FULL_TOKENS} ({QUICK_TOKENS} with --quick)")
    out = p.add_argument_group("output")
    out.add_argument("--out", type=Path, help="output directory (default bench_results/<timestamp>/)")
    out.add_argument("--resume", action="store_true", help="continue the interrupted run in --out: prompts already "
                     "in its progress.jsonl are kept, the rest are measured (the settings must be the same)")
    out.add_argument("--markdown", type=Path, help="also write the markdown summary to this path")
    out.add_argument("--force", action="store_true", help="replace an existing --markdown file")
    out.add_argument("--no-progress", action="store_true", help="no progress bars")
    out.add_argument("--results-page", action="store_true",
                     help=f"only regenerate {RESULTS_PAGE} from the runs committed under {RESULTS_DIR}/ and exit")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.max_new_tokens is None:
        args.max_new_tokens = QUICK_TOKENS if args.quick else FULL_TOKENS
    _validate(p, args)
    return args


def _validate(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The benchmark's own flags; the decoding and model flags are checked by the settings they build."""
    for flag, value in (("--limit", args.limit), ("--threads", args.threads)):
        try:
            if value is not None:
                integer(flag, value, 1)
        except SettingError as error:
            p.error(str(error))
    if args.resume and not args.out:
        p.error("--resume needs --out: the directory of the run to continue")
    if args.strategies:
        names = _split(args.strategies)
        known = STRATEGIES + HF_BASELINES + LLAMACPP
        unknown = [n for n in names if n not in known]
        if unknown:
            p.error(f"unknown strategies {', '.join(unknown)}; choose from {', '.join(known)}")
        if args.no_hf and any(n in HF_BASELINES for n in names):
            p.error("--no-hf contradicts the HF baselines named in --strategies")
    try:
        check_model_names(args)
        args.decoding = decoding(args)
    except FlagError as error:
        p.error(str(error))


def _split(text: str | None) -> list[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def selected_strategies(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(ours, hf and llama.cpp), autoregressive first among ours: the baseline, and it builds multi-turn contexts."""
    if args.strategies:
        names = _split(args.strategies)
    else:
        names = [s for s in STRATEGIES if s not in NOT_BY_DEFAULT] + ([] if args.no_hf else list(HF_BASELINES))
    ours = [REFERENCE] + [n for n in dict.fromkeys(names) if n in STRATEGIES and n != REFERENCE]
    others = [n for n in dict.fromkeys(names) if n in HF_BASELINES + LLAMACPP]
    return ours, others


def model_specs(args: argparse.Namespace) -> tuple[ModelChoice, str | None]:
    """The pair to measure, and the drafter with another tokenizer for hf_universal (None: none)."""
    choice = model_choice(args, resolve_preset)
    universal = args.universal_drafter or (UNIVERSAL_DRAFTER if choice.preset else None)
    return choice, None if universal == "none" else universal


def select_prompts(args: argparse.Namespace) -> list[Prompt]:
    """The prompts to measure (--prompts, --categories, --limit, --quick); ValueError or FileNotFoundError, one line,
    for a bad file or selection."""
    prompts = load_prompts(args.prompts, _split(args.categories) or None, args.limit)
    if args.quick:
        firsts: dict[str, Prompt] = {}
        for prompt in prompts:
            firsts.setdefault(prompt.category, prompt)
        prompts = list(firsts.values())[:QUICK_PROMPTS]
    if not prompts:
        raise ValueError(f"no prompts selected from {args.prompts}")
    return prompts


def check_output_dir(out: Path, resume: bool) -> None:
    """ValueError where --out cannot take this run: not a directory, or it holds another run and --resume is not given
    (its measurements would be overwritten)."""
    problem = output_dir_problem(out)
    if problem:
        raise ValueError(problem)
    if resume:
        return
    if (out / "results.json").exists():
        raise ValueError(f"{out} holds a finished run (results.json): pass --resume to keep its measurements, or "
                         "choose another --out")
    if (out / "progress.jsonl").exists():
        raise ValueError(f"{out} holds an interrupted run (progress.jsonl): pass --resume to continue it, or choose "
                         "another --out")


def check_markdown_file(path: Path | None, force: bool) -> None:
    """ValueError where --markdown cannot take the summary: a directory, under a file, or a file that is there already
    and --force does not say to replace (found before the run, never after it)."""
    if path is None:
        return
    existing = next(p for p in path.parents if p.exists() or p == p.parent)
    if not existing.is_dir():
        raise ValueError(f"--markdown {path} lies under the file {existing}: give a path in a directory")
    if (problem := output_dir_problem(existing, "--markdown")):  # one it cannot write to
        raise ValueError(problem)
    if path.is_dir():
        raise ValueError(f"--markdown {path} is a directory: give a file name")
    if path.exists() and not force:
        raise ValueError(f"--markdown {path} exists: pass --force to replace it, or give another file name")


@dataclass(frozen=True)
class Models:
    """What the benchmark loaded: our engine (the pair, its heads, its cached models) and hf_universal's drafter."""

    choice: ModelChoice
    engine: Engine
    pair: LoadedPair  # what the engine loaded
    universal: LoadedModel | None


@dataclass(frozen=True)
class Started:
    """What the start found out and chose: the target's path, the settings (calibrated), the drafter's compile."""

    identity: Invariance
    settings: StrategySettings
    calibration: Calibration | None
    compiled: float | None  # seconds the drafter's compile took; None: not compiled
    target_compiled: float | None = None  # the same for the target's whole forward


@dataclass(frozen=True)
class Measured:
    """The interleaved run: every measurement, and what the report says about the run."""

    contestants: list
    skipped: list[dict]
    measurements: list
    skipped_prompts: list
    run_settings: RunSettings
    encoder: Encoder


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hold_torch_to(args.kernels)  # before torch loads (and its inductor cache is chosen)
    if args.results_page:
        return write_results_page()
    out = args.out or Path("bench_results") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    try:  # what can be wrong with the files, found before the models load
        prompts = select_prompts(args)
        check_output_dir(out, args.resume)
        check_markdown_file(args.markdown, args.force)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        models = load_models(args)
    except ModelLoadError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    from benchmarks.runner import CheckpointMismatch

    started = start(models)
    contestants, skipped = build_contestants(args, models, started)
    try:
        measured = measure(args, prompts, models, started, contestants, skipped, out)
    except CheckpointMismatch as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from benchmarks.report import print_report, write_report

    report = make_report(args, argv, prompts, models, started, measured, out)
    write_report(report, out, args.markdown)
    print_report(report, out)
    return 0


def write_results_page() -> int:
    """--results-page: benchmarks/RESULTS.md from the committed runs."""
    from benchmarks.report import results_page

    page, runs, skipped_runs = results_page(RESULTS_DIR)
    for reason in skipped_runs:
        print(f"warning: skipped {reason}", file=sys.stderr)
    RESULTS_PAGE.write_text(page, encoding="utf-8")
    print(f"wrote {RESULTS_PAGE} from {runs} runs", file=sys.stderr)
    return 0


def load_models(args: argparse.Namespace) -> Models:
    """Our engine, started as the chat starts it (`Engine.load`), and hf_universal's drafter (ModelLoadError)."""
    import torch

    from app.engine import Engine
    from app.startup import PrintReport, load_options
    from models.loading import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.decoding.ignored:
        print(f"warning: {args.decoding.ignored}", file=sys.stderr)
    choice, universal_spec = model_specs(args)
    engine = Engine.load(**load_options(args, choice), progress=not args.no_progress, calibrate=args.calibrate,
                         settings=args.decoding.strategy, keep=args.decoding.explicit, compile=args.compile,
                         report=PrintReport())
    pair = engine.pair
    assert pair is not None  # Engine.load keeps what it loaded
    universal = pair.drafter if engine.tokenizers else None  # a drafter of another tokenizer is its own
    if "hf_universal" in selected_strategies(args)[1] and universal_spec and universal is None:
        universal = load_model(universal_spec, device=choice.device, dtype=args.dtype,
                               trust_remote_code=args.trust_remote_code, cache_dir=args.cache_dir,
                               progress=not args.no_progress)
    return Models(choice, engine, pair, universal)


def start(models: Models) -> Started:
    """What our engine's start found out and chose: the target's path, the settings, the compiles' seconds."""
    engine = models.engine
    return Started(engine.identity, engine.settings, engine.tuning.calibration if engine.tuning else None,
                   engine.compiles.seconds("drafter"), engine.compiles.seconds("target"))


def build_contestants(args: argparse.Namespace, models: Models, started: Started) -> tuple[list, list[dict]]:
    """Ours, the HF baselines and llama.cpp; those that cannot run here are skipped, each with its reason."""
    from benchmarks.contestants import OurStrategy
    from benchmarks.hf_baselines import build_hf_baselines
    from benchmarks.llamacpp import for_pair as llamacpp_for_pair

    ours, others = selected_strategies(args)
    settings, target_lm, drafter_lm = started.settings, models.engine.target, models.engine.drafter
    cached = [lm for lm in (target_lm, drafter_lm) if lm is not None]
    contestants: list = []
    skipped: list[dict] = []
    for name in ours:
        if name in NEEDS_DRAFTER and drafter_lm is None:
            skipped.append({"name": name, "reason": "no drafter model loaded"})
        elif name in NEEDS_HEAD and name not in models.engine.heads:
            skipped.append({"name": name, "reason": f"no trained {name} head (--head DIR; train_head.py makes one)"})
        elif name == "drafter" and models.pair.tokenizers:
            skipped.append({"name": name, "reason": "the drafter has another tokenizer than the target's"})
        else:
            strategy = models.engine.build(name, settings)
            contestants.append(OurStrategy(strategy, cached, asdict(settings), name in NEEDS_DRAFTER))
    hf_names = [n for n in others if n in HF_BASELINES]
    if models.pair.tokenizers:  # HF's assisted generation with one tokenizer cannot take this drafter
        skipped += [{"name": n, "reason": "the drafter has another tokenizer (hf_universal runs it)"}
                    for n in hf_names if n in NEEDS_SAME_VOCAB]
        hf_names = [n for n in hf_names if n not in NEEDS_SAME_VOCAB]
    baselines, hf_skipped = build_hf_baselines(hf_names, models.pair.target,
                                               models.pair.drafter, models.universal, gamma=settings.gamma,
                                               lookup_max_ngram=settings.lookup_max_ngram)
    contestants += baselines
    skipped += [asdict(s) for s in hf_skipped]
    for name in (n for n in others if n in LLAMACPP):
        contestant, reason = llamacpp_for_pair(name, models.pair, args.cache_dir or default_cache_dir())
        if contestant is None:
            skipped.append({"name": name, "reason": reason})
        else:
            contestants.append(contestant)
    return contestants, skipped


def measure(args: argparse.Namespace, prompts: list[Prompt], models: Models, started: Started, contestants: list,
            skipped: list[dict], out: Path) -> Measured:
    """Every contestant on every prompt, interleaved, checkpointed in --out (CheckpointMismatch: another run's)."""
    import torch

    from benchmarks.runner import Checkpoint, Encoder, RunSettings, run_benchmark

    target, drafter, end_ids = models.pair.target, models.pair.drafter, models.pair.end_ids
    tokenizer = target.tokenizer
    config = replace(args.decoding.config, end_ids=end_ids)
    loaded = [m.model for m in (target, drafter, models.universal) if m is not None]
    context_limit = min(getattr(m.config, "max_position_embeddings", None) or 1 << 31 for m in loaded)
    encoder = Encoder(
        encode=models.engine.encode,
        decode=lambda ids: tokenizer.decode([t for t in ids if t not in end_ids], skip_special_tokens=True,
                                            clean_up_tokenization_spaces=False))
    run_settings = RunSettings(config, warmup_tokens=4 if args.quick else 8, context_limit=context_limit,
                               progress=not args.no_progress, remember=models.engine.session.add)
    fingerprint = {"target": target.label, "drafter": drafter.label if drafter else None,
                   "dtype": str(next(target.model.parameters()).dtype), "device": str(target.model.device),
                   "threads": torch.get_num_threads(), "max_new_tokens": args.max_new_tokens,
                   "decoding": repr(config.processor), "seed": args.seed,
                   "strategy_settings": asdict(started.settings), "drafter_compiled": started.compiled is not None,
                   "target_compiled": models.engine.target.whole_model is not None,
                   "target_path": str(started.identity.path), "contestants": [c.describe() for c in contestants]}
    checkpoint = Checkpoint(out / "progress.jsonl", fingerprint, resume=args.resume)
    if checkpoint.done:
        print(f"resuming: {len(checkpoint.done)} prompts already measured in {checkpoint.path}", file=sys.stderr)
    measurements, skipped_prompts = run_benchmark(prompts, contestants, encoder, run_settings, checkpoint)
    return Measured(contestants, skipped, measurements, skipped_prompts, run_settings, encoder)


def make_report(args: argparse.Namespace, argv: list[str] | None, prompts: list[Prompt], models: Models,
                started: Started, measured: Measured, out: Path) -> dict:
    """results.json's content: the machine, the configuration, the costs, the summary and every measurement."""
    from benchmarks.costs import measure_costs, timing_context
    from benchmarks.hf_baselines import sampling_kwargs, sklearn_available
    from benchmarks.report import machine_description, summarize
    from utils.prompts import count_by_category

    target, drafter, universal = models.pair.target, models.pair.drafter, models.universal
    settings, compiled, contestants = started.settings, started.compiled, measured.contestants
    processor, context_limit = measured.run_settings.config.processor, measured.run_settings.context_limit
    gammas = {c.name: c.gamma for c in contestants if getattr(c, "gamma", None)}
    stops_early = {c.name for c in contestants if getattr(c, "stops_early", False)}
    verified = {*gammas.values(), *(g for name in stops_early for g in range(1, gammas[name] + 1))}
    context = timing_context(prompts, measured.encoder.encode, args.max_new_tokens,
                             context_limit - max([settings.gamma, *gammas.values()]) - 1)
    costs = measure_costs(models.engine.target, models.engine.drafter, context, settings.gamma,
                          args.cost_repeats or (3 if args.quick else 7), tuple(sorted(verified)))
    drafter_models = {c.name for c in contestants if c.kind == "ours" and c.uses_drafter_model}
    described = "greedy" if processor.is_greedy else f"sampling ({processor!r}), seed {args.seed}"
    return {
        "schema_version": SCHEMA_VERSION,
        "command": "python bench.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        "machine": machine_description(target.model.device, next(target.model.parameters()).dtype),
        "config": {
            **asdict(models.choice),
            "target": target.label, "target_source": target.source,
            "drafter": drafter.label if drafter else None, "drafter_source": drafter.source if drafter else None,
            "drafter_compiled": compiled is not None, "drafter_compile_seconds": compiled,
            "draft_vocabulary": models.engine.draft_vocabulary,
            "target_compiled": models.engine.target.whole_model is not None,  # a draft head's strategy drops it
            "target_compile_seconds": started.target_compiled,
            "target_quantize": target.quantize, "drafter_quantize": drafter.quantize if drafter else None,
            "universal_drafter": universal.name if universal else None,
            "end_ids": list(models.pair.end_ids), "max_new_tokens": args.max_new_tokens, "gamma": settings.gamma,
            "decoding": described, "greedy": processor.is_greedy, "temperature": args.temperature,
            "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p, "seed": args.seed,
            "hf_sampling_kwargs": sampling_kwargs(processor), "strategy_settings": asdict(settings),
            "calibration": started.calibration.as_dict() if started.calibration else None,
            "greedy_identity": started.identity.as_dict(),
            "heads": {kind: {"path": head.info.get("path"), "parameters": head.size, "config": asdict(head.config),
                             "training": {k: v for k, v in head.info.items() if k != "path"}}
                      for kind, head in models.engine.heads.items()},
            "prompts": str(args.prompts), "categories": _split(args.categories) or None, "limit": args.limit,
            "quick": args.quick, "prompt_counts": count_by_category(prompts), "context_limit": context_limit,
            "warmup_tokens": measured.run_settings.warmup_tokens, "sklearn_available": sklearn_available(),
            "multi_turn": "every turn measured; later turns continue from our autoregressive answers",
        },
        "contestants": [c.describe() for c in contestants],
        "skipped_contestants": measured.skipped,
        "skipped_prompts": measured.skipped_prompts,
        "costs": costs.as_dict(),
        "prompts": [{"id": p.id, "category": p.category, "turns": list(p.turns)} for p in prompts],
        "summary": summarize(measured.measurements, costs, gammas, drafter_models, stops_early),
        "measurements": measured.measurements,
        "files": {"json": str(out / "results.json"), "markdown": str(out / "summary.md"),
                  "plot": str(out / "plot.png")},
    }


if __name__ == "__main__":
    sys.exit(main())
