"""Train an EAGLE or Medusa draft head for a target, on the target's own answers.

    python train_head.py --target qwen2.5-coder-1.5b --kind eagle --out heads/qwen2.5-coder-1.5b-eagle \
        --prompts ../shared/bench/mt_bench.jsonl ../shared/bench/gsm8k.jsonl ../shared/bench/humaneval.jsonl

1. Data: the target answers every prompt's first turn (through its chat template), greedily, in batches (on a CPU a
   batch of answers costs little more per forward than one), and the same forwards give its last hidden state at
   every position: the head learns the target's own distribution on its own text. Saved in OUT/data as it goes, and
   every answer's token ids in OUT/answers.jsonl.gz: `--answers` reads them back in a later run, on any machine,
   and makes their features again by one forward of the target each (not asking their prompts again).
2. Training: the head's loss is the target's next-token distribution (its output layer on its own features, over the
   draft vocabulary) against the head's, plus, for EAGLE, the distance to the target's next feature; noise on the
   input features stands in for the head's own errors when it drafts from its predictions.
3. Held-out: the prompts kept out (`--held-out`) are drafted by the project's own drafter over the stored features,
   greedy, and the mean tokens per target step (chain and tree) go into the head's config.

`--export-eagle DIR` trains nothing: it writes the eagle head in --out in the EAGLE authors' layout (config.json and
model.safetensors, the names vLLM's "eagle" method and SGLang's EAGLE load; `--export-for sglang` names SGLang's EAGLE
classes in the config) for the --target it was trained on; head files DIR holds already are replaced only with
`--force`:

    python train_head.py --target qwen2.5-coder-1.5b --out heads/qwen2.5-coder-1.5b-eagle --export-eagle eagle-layout

`--time-budget` bounds the whole run (minutes): the answers get `--data-share` of it, training and the held-out
evaluation the rest. A non-empty OUT is refused unless `--resume` continues from what it holds (the prompts its answers
record, their features made again from OUT/answers.jsonl.gz where OUT/data lost them, then its last training
checkpoint) or `--overwrite` starts it over; one run at a time holds OUT. Every file is written whole or not at all
(answers.jsonl.gz never with fewer answers than it held), a damaged one is named and made again; Ctrl-C writes a
checkpoint and exits 130.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from dataclasses import asdict
from pathlib import Path

from models.presets import EMBEDDED, QUANTIZE_CHOICES
from training.budget import Budget
from training.data import ANSWERS, make_data, read_answers, read_texts, save_answers, text_rows, unanswered_rows
from training.held_out import held_out_tokens_per_step
from training.learning import draft_vocabulary, train
from utils.files import Busy, exclusive
from utils.paths import output_dir_problem

DEFAULT_BRANCH = 4
USAGE_EXIT, FAILED_EXIT, INTERRUPTED_EXIT = 2, 1, 130
CHECKPOINT = "checkpoint.pt"
# what --overwrite removes from OUT, with OUT/data's batches
OWN_FILES = ("head.json", "head.safetensors", CHECKPOINT, ANSWERS)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", required=True, help="embedded name, saved directory, .gguf file or Hub id")
    p.add_argument("--kind", choices=("eagle", "medusa"), help="the head to train (required unless --export-eagle)")
    p.add_argument("--out", required=True, help="the head's directory (its data and checkpoints go there too)")
    p.add_argument("--export-eagle", type=Path, metavar="DIR",
                   help="write the eagle head in --out to DIR in the EAGLE authors' layout, and train nothing")
    p.add_argument("--export-for", choices=("vllm", "sglang"), default="vllm",
                   help="--export-eagle: the engine whose config names it gets (vllm: the authors' own; default vllm)")
    p.add_argument("--force", action="store_true",
                   help="--export-eagle: replace the head files DIR already holds (config.json, model.safetensors, "
                        "token_map.pt)")
    p.add_argument("--prompts", nargs="+", default=[],
                   help="JSONL prompt files, one object per line with `turns` (a list of strings: the first is asked)")
    p.add_argument("--dtype", default="float32", help="the target's dtype while making the data (default float32)")
    p.add_argument("--target-quantize", choices=QUANTIZE_CHOICES,
                   help="the target's weights while making the data; default: gguf for a GGUF-backed target (an "
                        "embedded name or a .gguf file: the GGUF's own blocks on the project's kernels, the target "
                        "the chat runs; dense --dtype weights, said in one line, where they cannot run), else none "
                        "(dense --dtype weights)")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-new-tokens", type=int, default=256, help="the longest answer per prompt")
    p.add_argument("--batch", type=int, default=8, help="answers generated together")
    p.add_argument("--time-budget", type=float, default=60.0, help="minutes for the whole run")
    p.add_argument("--data-share", type=float, default=0.55, help="the budget's share for making answers")
    p.add_argument("--epochs", type=int, default=20, help="at most this many passes (the budget stops earlier)")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--draft-vocab", type=int, default=16384, help="tokens the head drafts from (0: all)")
    p.add_argument("--intermediate", type=int, default=1024, help="eagle: its MLP's width")
    p.add_argument("--heads", type=int, default=3, help="medusa: its heads")
    p.add_argument("--draft-depth", type=int, default=1,
                   help="eagle: train on the head's own drafts this deep (EAGLE-3's training-time test: pass d reads "
                        "the feature pass d - 1 predicted); 1: on the target's features only")
    p.add_argument("--train-bf16", action="store_true",
                   help="train with bfloat16 matrix products (torch.autocast), the weights and optimizer in float32: "
                        "faster where the CPU has native bf16 (docs/heads.md)")
    p.add_argument("--answers-only", action="store_true",
                   help="train on the answers' positions only (default: the prompts' too: the target's features "
                        "and predictions there are its own as well)")
    p.add_argument("--held-out", type=float, default=0.1, help="the share of prompts kept out for evaluation")
    p.add_argument("--eval-depth", type=int, default=6, help="draft depth of the held-out evaluation")
    p.add_argument("--eval-tree", type=int, default=13, help="tree size of the held-out evaluation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", help="the answers' directory (default OUT/data): another head's answers are reused, "
                                  "and more are made while the budget allows")
    p.add_argument("--init", type=Path, metavar="DIR",
                   help="train on from this head (the project's format: its weights, shape and draft vocabulary) "
                        "instead of a new one, as a run that adds answers to its data goes on from the head before")
    p.add_argument("--answers", nargs="+", type=Path, default=[], metavar="FILE",
                   help="answers made before, as token ids (the answers.jsonl.gz a run writes beside its head): "
                        "trained on, their features made again by one forward of the target each, their prompts "
                        "not asked again")
    p.add_argument("--read", nargs="+", type=Path, default=[], metavar="FILE",
                   help="text files the target reads: each piece (about 400 tokens, as an answer) trained on, its "
                        "features and the target's predictions from one forward, a prefill's speed, several times "
                        "the tokens a minute that answering makes; kept in answers.jsonl.gz, never held out")
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help="continue from OUT's answers (OUT/data, else answers.jsonl.gz) and checkpoint")
    again.add_argument("--overwrite", action="store_true",
                       help="start a non-empty OUT over: its head, checkpoint and answers (OUT/data) are removed")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.export_eagle is not None:
        if (problem := output_dir_problem(args.export_eagle, "--export-eagle")):
            p.error(problem)
        return args
    if args.force:
        p.error("--force replaces the files of an --export-eagle DIR; a non-empty --out is started over with "
                "--overwrite")
    if args.kind is None:
        p.error("--kind is required (eagle or medusa)")
    if not args.prompts:
        p.error("--prompts needs at least one JSONL file")
    for name in ("max_new_tokens", "batch", "epochs", "heads", "intermediate", "eval_depth", "eval_tree",
                 "draft_depth"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 < args.data_share < 1 or not 0 <= args.held_out < 1 or args.time_budget <= 0 or args.lr <= 0:
        p.error("--data-share in (0, 1), --held-out in [0, 1), --time-budget and --lr > 0")
    if args.draft_depth > 1 and args.kind != "eagle":
        p.error("--draft-depth trains an eagle head on its own drafts: a medusa head drafts from the target's only")
    if args.draft_vocab < 0:
        p.error("--draft-vocab must be >= 0")
    if args.init is not None and not (args.init / "head.json").is_file():
        p.error(f"--init: no head of this project's format at {args.init} (a head.json and head.safetensors)")
    return args


# -- main ------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.export_eagle is not None:
        return export_eagle(args)
    budget = Budget(args.time_budget)
    out = Path(args.out)
    try:
        prompts = read_prompts(args.prompts)
        reused = read_answers(args.answers)
        pieces = read_texts(args.read)
        check_out(out, Path(args.data) if args.data else None, args.resume or args.overwrite)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return USAGE_EXIT
    try:
        with exclusive(out, wait=False):  # made if absent
            return run(args, prompts, budget, argv, reused, pieces)
    except Busy:
        print(f"error: another train_head.py run is using {out}: wait for it to end, or choose another --out",
              file=sys.stderr)
        return USAGE_EXIT
    except KeyboardInterrupt:
        print(f"interrupted: {out} keeps the answers and the checkpoint made so far; --resume continues from them",
              file=sys.stderr)
        return INTERRUPTED_EXIT


def export_eagle(args) -> int:
    """--export-eagle: the head in --out in the EAGLE layout, for the target's config; what differs there on stderr."""
    from transformers import AutoConfig

    from models.loading import model_files
    from sampling.heads.layouts import EAGLE_WEIGHTS, TOKEN_MAP, write_eagle
    from utils.errors import ModelLoadError

    held = [name for name in ("config.json", EAGLE_WEIGHTS, TOKEN_MAP) if (args.export_eagle / name).exists()]
    if held and not args.force:
        print(f"error: --export-eagle: {args.export_eagle} already holds {', '.join(held)}: pass --force to replace "
              f"{'it' if len(held) == 1 else 'them'}, or give another directory", file=sys.stderr)
        return USAGE_EXIT
    try:
        files = model_files(args.target, progress=not args.no_progress)
        notes = write_eagle(args.out, args.export_eagle, AutoConfig.from_pretrained(files.folder), args.export_for)
    except (ModelLoadError, OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return FAILED_EXIT
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print(json.dumps({"eagle": str(args.export_eagle), "from": str(args.out)}))
    return 0


def read_prompts(paths: list[str]) -> list[str]:
    """Every prompt's first turn; ValueError or FileNotFoundError (one line) for a bad file or none at all."""
    from utils.prompts import load_prompts

    prompts = [p.turns[0] for path in paths for p in load_prompts(path, default_category="-")]
    if not prompts:
        raise ValueError(f"no prompts in {', '.join(paths)}: give JSONL files with one {{\"turns\": [...]}} per line")
    return prompts


def check_out(out: Path, data: Path | None, again: bool) -> None:
    """ValueError where OUT (or --data) cannot be written, or OUT holds anything and neither --resume nor --overwrite
    says what to do with it."""
    for path, flag in ((out, "--out"), (data, "--data")):
        if path is not None and (problem := output_dir_problem(path, flag)):
            raise ValueError(problem)
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held and not again:
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise ValueError(f"{out} is not empty ({shown}): pass --resume to continue from it, --overwrite to start it "
                         "over, or choose another --out")


def kept_answers(path: Path) -> list[dict]:
    """The answers a run before kept in OUT (none if absent); a damaged file is named and moved aside (its readable
    lines are not lost), and a new one is written from the answers in hand."""
    if not path.exists():
        return []
    try:
        return read_answers([path])
    except ValueError as error:
        aside = path.with_name(path.name + ".damaged")
        os.replace(path, aside)
        print(f"warning: {error}: moved to {aside.name}, and written again from the answers in hand", file=sys.stderr)
        return []


def remove_own_files(out: Path, data: Path) -> None:
    """What a run left in OUT (its head, checkpoint and, in OUT/data, its answers): --overwrite starts over."""
    for file in [*(out / name for name in OWN_FILES), *(data.glob("batch-*.pt") if data == out / "data" else [])]:
        file.unlink(missing_ok=True)


def run(args, prompts: list[str], budget: Budget, argv: list[str] | None, reused: list[dict],
        pieces: list[tuple[str, str]] = ()) -> int:
    import torch

    from app.engine import Engine
    from sampling.heads.networks import HeadConfig, bind, build, eagle_config, load_head
    from utils.errors import ModelLoadError

    out = Path(args.out)
    data_dir = Path(args.data) if args.data else out / "data"
    torch.manual_seed(args.seed)
    random.Random(args.seed).shuffle(prompts)
    try:
        gguf_backed = args.target in EMBEDDED or args.target.lower().endswith(".gguf")
        quantize = args.target_quantize or ("gguf" if gguf_backed else "none")
        # the target as loaded: the head learns the model the chat runs, not a path probed for verifying
        engine = Engine.load(target=args.target, drafter="none", heads=["none"], probe=False, compile=False,
                             device=args.device, dtype=args.dtype, target_quantize=quantize,
                             progress=not args.no_progress)
    except ModelLoadError as error:
        print(f"error: {error}", file=sys.stderr)
        return FAILED_EXIT
    assert engine.pair is not None
    loaded, model = engine.pair.target, engine.target.model
    vocab_size = model.get_output_embeddings().out_features
    start = None  # the head --init trains on from: read before any answer is made
    if args.init is not None:
        try:
            start = load_head(args.init, model)
        except ModelLoadError as error:
            print(f"error: --init: {error}", file=sys.stderr)
            return FAILED_EXIT
        if start.config.kind != args.kind:
            print(f"error: --init: {args.init} holds a head of kind {start.config.kind}, and --kind asks for "
                  f"{args.kind}", file=sys.stderr)
            return FAILED_EXIT
    kept = kept_answers(out / ANSWERS) if args.resume else []
    reused = [*reused, *unanswered_rows(kept, reused)]  # what OUT/data lost is made again from its token ids
    reused += unanswered_rows(text_rows(loaded.tokenizer, list(pieces)), reused)  # after the answers: held out first
    if reused and (largest := max(int(row["ids"].max()) for row in reused)) >= vocab_size:
        print(f"error: --answers hold token id {largest}, past the target's {vocab_size}: answers of another "
              "tokenizer's model", file=sys.stderr)
        return FAILED_EXIT
    if args.overwrite:
        remove_own_files(out, data_dir)
    data = make_data(model, loaded.tokenizer, prompts, data_dir, args.max_new_tokens, args.batch, budget,
                     args.data_share, not args.no_progress, reused)
    if len(data) < 2:
        print(f"error: the budget left {len(data)} answers to train on, 2 at least are needed: give a larger "
              "--time-budget (or --data-share)", file=sys.stderr)
        return FAILED_EXIT
    save_answers([*data, *unanswered_rows(kept, data)], out / ANSWERS)  # never fewer answers than it kept
    data_seconds = budget.used()
    answered = [row for row in data if not row.get("read")]  # what the target wrote: the held-out answers' kind
    held = max(1, round(len(answered) * args.held_out)) if args.held_out else 0
    held_rows = answered[:held]
    held_ids = {id(row) for row in held_rows}
    train_rows = [row for row in data if id(row) not in held_ids]
    if start is not None:  # its shape and draft vocabulary too: the weights were trained for them
        config, module, vocab = start.config, start.module, start.vocab
    else:
        vocab = draft_vocabulary(train_rows, vocab_size, args.draft_vocab)
        config = (eagle_config(model.config, args.intermediate) if args.kind == "eagle"
                  else HeadConfig("medusa", model.config.hidden_size, num_heads=args.heads))
        module = build(config)
    head = bind(config, module, model, vocab)
    stats = train(head, module, train_rows, args, budget, out / CHECKPOINT, not args.no_progress)
    evaluation = (held_out_tokens_per_step(head, held_rows, args.eval_depth, args.eval_tree, DEFAULT_BRANCH,
                                           seconds=max(budget.left(), 0.0))
                  if held_rows else {})
    tokens = sum(len(r["ids"]) - r["start"] for r in data if not r.get("read"))
    read = [r for r in data if r.get("read")]
    info = {"target": loaded.name, "target_source": loaded.source, "target_format": loaded.format,
            "answers": len(data) - len(read), "held_out_answers": held,
            "answer_tokens": tokens, "read_pieces": len(read), "read_tokens": sum(len(r["ids"]) for r in read),
            "draft_vocab": None if vocab is None else len(vocab),
            "data_seconds": round(data_seconds), "train_seconds": round(stats["seconds"]), "epochs": stats["epoch"],
            "steps": stats["step"], "stopped_by": stats["stopped_by"], "draft_depth": args.draft_depth,
            "train_bf16": args.train_bf16,
            "init": None if start is None else {"head": str(args.init), **{
                key: start.info.get(key) for key in ("answers", "answer_tokens", "steps", "train_seconds")}},
            "held_out": evaluation,
            "parameters": sum(p.numel() for p in module.parameters()), "config": asdict(config),
            "command": "python train_head.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    save_head_atomically(out, config, module, vocab, info)
    print(json.dumps({"head": str(out), **{k: info[k] for k in ("answers", "answer_tokens", "train_seconds",
                                                                    "epochs", "held_out", "parameters")}}))
    return 0


def save_head_atomically(out: Path, config, module, vocab, info: dict) -> None:
    """`save_head` into a temporary directory in OUT, then each file moved into place (os.replace): a head file is
    the old one or the whole new one."""
    import shutil

    from sampling.heads.networks import save_head

    temporary = out / f".head.tmp-{os.getpid()}"
    try:
        save_head(temporary, config, module, vocab, info)
        for file in sorted(temporary.iterdir(), key=lambda f: f.suffix == ".json"):  # the weights first, head.json last
            os.replace(file, out / file.name)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
