"""Train an EAGLE or Medusa draft head for a target, on the target's own answers.

    python train_head.py --target qwen2.5-coder-1.5b --kind eagle --out heads/qwen2.5-coder-1.5b-eagle \
        --prompts ../shared/bench/mt_bench.jsonl ../shared/bench/gsm8k.jsonl ../shared/bench/humaneval.jsonl

1. Data: the target answers every prompt's first turn (through its chat template), greedily, in batches (on a CPU a
   batch of answers costs little more per forward than one), and the same forwards give its last hidden state at
   every position: the head learns the target's own distribution on its own text. Saved in OUT/data as it goes.
2. Training: the head's loss is the target's next-token distribution (its output layer on its own features, over the
   draft vocabulary) against the head's, plus, for EAGLE, the distance to the target's next feature; noise on the
   input features stands in for the head's own errors when it drafts from its predictions.
3. Held-out: the prompts kept out (`--held-out`) are drafted by the project's own drafter over the stored features,
   greedy, and the mean tokens per target step (chain and tree) go into the head's config.

`--time-budget` bounds the whole run (minutes): the answers get `--data-share` of it, training and the held-out
evaluation the rest. A non-empty OUT is refused unless `--resume` continues from what it holds (the prompts its answers
record, then its last training checkpoint) or `--overwrite` starts it over; one run at a time holds OUT. Every file is
written whole or not at all, a damaged one is named and made again; Ctrl-C writes a checkpoint and exits 130.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from utils.errors import one_line
from utils.files import Busy, exclusive, write_atomically
from utils.paths import output_dir_problem

DEFAULT_BRANCH = 4
USAGE_EXIT, FAILED_EXIT, INTERRUPTED_EXIT = 2, 1, 130
CHECKPOINT = "checkpoint.pt"
OWN_FILES = ("head.json", "head.safetensors", CHECKPOINT)  # what --overwrite removes from OUT, with OUT/data's batches


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", required=True, help="embedded name, saved directory, .gguf file or Hub id")
    p.add_argument("--kind", choices=("eagle", "medusa"), required=True)
    p.add_argument("--out", required=True, help="the head's directory (its data and checkpoints go there too)")
    p.add_argument("--prompts", nargs="+", default=[],
                   help="JSONL prompt files, one object per line with `turns` (a list of strings: the first is asked)")
    p.add_argument("--dtype", default="float32", help="the target's dtype while making the data (default float32)")
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
    p.add_argument("--answers-only", action="store_true",
                   help="train on the answers' positions only (default: the prompts' too: the target's features "
                        "and predictions there are its own as well)")
    p.add_argument("--held-out", type=float, default=0.1, help="the share of prompts kept out for evaluation")
    p.add_argument("--eval-depth", type=int, default=6, help="draft depth of the held-out evaluation")
    p.add_argument("--eval-tree", type=int, default=13, help="tree size of the held-out evaluation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", help="the answers' directory (default OUT/data): another head's answers are reused, "
                                  "and more are made while the budget allows")
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="continue from OUT's data and checkpoint")
    again.add_argument("--overwrite", action="store_true",
                       help="start a non-empty OUT over: its head, checkpoint and answers (OUT/data) are removed")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if not args.prompts:
        p.error("--prompts needs at least one JSONL file")
    for name in ("max_new_tokens", "batch", "epochs", "heads", "intermediate", "eval_depth", "eval_tree"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 < args.data_share < 1 or not 0 <= args.held_out < 1 or args.time_budget <= 0 or args.lr <= 0:
        p.error("--data-share in (0, 1), --held-out in [0, 1), --time-budget and --lr > 0")
    if args.draft_vocab < 0:
        p.error("--draft-vocab must be >= 0")
    return args


class Budget:
    def __init__(self, minutes: float):
        self.start, self.seconds = time.monotonic(), minutes * 60

    def used(self) -> float:
        return time.monotonic() - self.start

    def left(self, share: float = 1.0) -> float:
        return self.seconds * share - self.used()


# -- 1. data ---------------------------------------------------------------------------------------------------


def make_data(model, tokenizer, prompts: list[str], out: Path, max_new_tokens: int, batch: int, budget: Budget,
              share: float, progress: bool) -> list[dict]:
    """Each prompt's answer and features, {"ids": (T,) long, "features": (T, H) half, "start": answer start, "prompt":
    its text}, saved one batch per file; the prompts the batches already in `out` answered are not asked again,
    whatever batch size made them."""
    import torch
    from tqdm import tqdm

    from utils.vocab import end_token_ids

    out.mkdir(parents=True, exist_ok=True)
    data, next_file = read_batches(out)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ends = set(end_token_ids(tokenizer, model.generation_config))
    todo = unanswered(prompts, data)
    bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc="answers", unit="prompt",
               disable=not progress)
    for first in range(0, len(todo), batch):
        seconds = budget.left(share)
        if seconds <= 0:
            print(f"answers: the data share of the budget is spent after {len(data)} prompts", file=sys.stderr)
            break
        asked = todo[first:first + batch]
        rows = [_chat_ids(tokenizer, prompt) for prompt in asked]
        data_rows = [{**row, "prompt": prompt}
                     for row, prompt in zip(_answer(model, rows, pad, ends, max_new_tokens, seconds), asked,
                                            strict=True)]
        file = out / f"batch-{next_file:04d}.pt"
        write_atomically(file, lambda temporary, rows=data_rows: torch.save(rows, temporary))
        next_file += 1
        data += data_rows
        bar.update(len(rows))
    bar.close()
    return data


def read_batches(out: Path) -> tuple[list[dict], int]:
    """The answers in `out`'s batch files, and the number the next file takes; a damaged file is named and skipped (its
    prompts are answered again)."""
    import torch

    data, next_file = [], 0
    for file in sorted(out.glob("batch-*.pt"), key=lambda f: (len(f.name), f.name)):
        number = file.stem.removeprefix("batch-")
        next_file = max(next_file, int(number) + 1) if number.isdigit() else next_file
        try:
            rows = torch.load(file, weights_only=True)
            problem = _batch_problem(rows)
        except Exception as error:  # noqa: BLE001 (whatever a cut or foreign file raises: it is made again)
            problem = one_line(error)
        if problem:
            print(f"warning: {file} is damaged ({problem}): skipped, its prompts are answered again", file=sys.stderr)
            continue
        data += rows
    return data, next_file


def _batch_problem(rows) -> str | None:
    import torch

    for row in rows if isinstance(rows, list) else [None]:
        if not isinstance(row, dict) or not isinstance(row.get("ids"), torch.Tensor) \
                or not isinstance(row.get("features"), torch.Tensor) or not isinstance(row.get("start"), int):
            return "not a list of answers"
        if row["ids"].dim() != 1 or row["features"].dim() != 2 or len(row["features"]) != len(row["ids"]) - 1:
            return "an answer's ids and features do not match"
    return None


def unanswered(prompts: list[str], data: list[dict]) -> list[str]:
    """The prompts (in order) that no answer in `data` records; answers saved before prompts were recorded stand for
    the first prompts, in order (as they were made)."""
    answered = Counter(row["prompt"] for row in data if "prompt" in row)
    unrecorded = sum("prompt" not in row for row in data)
    todo = []
    for prompt in prompts:
        if answered[prompt] > 0:
            answered[prompt] -= 1
        elif unrecorded > 0:
            unrecorded -= 1
        else:
            todo.append(prompt)
    return todo


def _chat_ids(tokenizer, prompt: str) -> list[int]:
    from benchmarks.prompts import chat_ids

    return chat_ids(tokenizer, [{"role": "user", "content": prompt}])


def _answer(model, rows: list[list[int]], pad: int, ends: set[int], max_new_tokens: int, seconds: float,
            ) -> list[dict]:
    """Greedy answers of a batch (left-padded), with the last hidden state of every prompt and answer token; cut
    short after `seconds` (the budget's: an answer cut short is still the target's own text)."""
    import torch

    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), do_sample=False,
                             max_new_tokens=max_new_tokens, output_hidden_states=True, return_dict_in_generate=True,
                             pad_token_id=pad, eos_token_id=sorted(ends) or None, temperature=None, top_p=None,
                             top_k=None, max_time=seconds)
    # step 0 holds the prompt's positions, each later step one position: the token fed there
    features = torch.cat([step[-1] for step in out.hidden_states], 1).to(torch.float16).cpu()  # (B, width + n - 1, H)
    sequences = out.sequences.cpu()
    result = []
    for b, prompt in enumerate(rows):
        answer = sequences[b, width:].tolist()
        stop = next((i + 1 for i, t in enumerate(answer) if t in ends), len(answer))
        answer = answer[:stop]
        seq = prompt + answer
        # features for every token but the last (its hidden state was never computed)
        feats = features[b, width - len(prompt): width + len(answer) - 1]
        result.append({"ids": torch.tensor(seq), "features": feats.clone(), "start": len(prompt)})
    return result


# -- 2. training -----------------------------------------------------------------------------------------------


def draft_vocabulary(data: list[dict], vocab_size: int, size: int):
    """The `size` token ids the head drafts from: the answers' tokens by frequency, then the lowest ids (a BPE
    vocabulary's commonest merges) to fill it; None for the whole vocabulary."""
    import torch

    if size == 0 or size >= vocab_size:
        return None
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for row in data:
        counts.index_add_(0, row["ids"][row["start"]:], torch.ones(len(row["ids"]) - row["start"], dtype=torch.long))
    seen = [int(t) for t in counts.argsort(descending=True, stable=True) if counts[t] > 0][:size]
    fill = [t for t in range(vocab_size) if counts[t] == 0][: size - len(seen)]
    return torch.tensor(sorted(seen + fill))


def losses(head, module, row: dict, noise: float, generator, prompt: bool = True):
    """The head's loss on one sequence: soft-label cross-entropy (and EAGLE's feature distance); its top-1
    agreement with the target. `prompt`: the prompt's positions count too (the target's own features and
    predictions there as well), else the answer's only."""
    import torch
    import torch.nn.functional as F

    feats = row["features"].float()  # (T - 1, H): position i's feature
    ids = row["ids"]
    start = 0 if prompt else max(row["start"] - 1, 0)  # from the first position whose next token is the answer's
    if head.config.kind == "eagle":
        # position i reads (f_i, x_{i+1}) and predicts f_{i+1}: pairs i = 0 .. T - 3
        x = feats[:-1]
        std = x.std(0, keepdim=True)
        x = x + (torch.rand(x.shape, generator=generator) - 0.5) * 2 * noise * std
        embeds = head.embeds(ids[1:-1])
        pred = module(x[None], embeds[None], torch.arange(len(x)))[0]
        truth = feats[1:]
        keep = slice(start, None)
        target_logp = head.logits(truth[keep]).log_softmax(-1)
        logp = head.logits(pred[keep]).log_softmax(-1)
        ce = -(target_logp.exp() * logp).sum(-1).mean()
        regression = F.smooth_l1_loss(pred[keep], truth[keep])
        agree = (logp.argmax(-1) == target_logp.argmax(-1)).float().mean()
        return regression + 0.1 * ce, ce, agree
    outs = module(feats[start:])  # head j at position i: the token at i + j + 2, i.e. the target's logits at i + j + 1
    total, agree = 0.0, []
    for j, out in enumerate(outs):
        shift = j + 1
        if len(out) <= shift:
            continue
        target_logp = head.logits(feats[start + shift:]).log_softmax(-1)
        logp = head.logits(out[:-shift]).log_softmax(-1)
        total = total + -(target_logp.exp() * logp).sum(-1).mean() * (0.8 ** j)
        agree.append((logp.argmax(-1) == target_logp.argmax(-1)).float().mean())
    mean_agree = torch.stack(agree).mean() if agree else torch.tensor(0.0)
    return total, total, mean_agree


def train(head, module, train_rows: list[dict], args, budget: Budget, checkpoint: Path, progress: bool) -> dict:
    """Train until the epochs or the budget end; a checkpoint at each epoch's end, at the end and at a Ctrl-C (which
    is raised again once it is written)."""
    import torch
    from tqdm import tqdm

    module.train().requires_grad_(True)
    optimizer = torch.optim.AdamW(module.parameters(), lr=args.lr, weight_decay=0.0)
    state = {"epoch": 0, "step": 0, "seconds": 0.0}
    if args.resume and checkpoint.is_file():
        state = resume_checkpoint(checkpoint, module, optimizer) or state
    steps_total = args.epochs * len(train_rows)
    generator = torch.Generator().manual_seed(args.seed)
    started = time.monotonic() - state["seconds"]
    train_seconds = max(budget.left() - eval_reserve(budget) + state["seconds"], 1.0)

    def save() -> None:
        state["seconds"] = time.monotonic() - started
        saved = {"module": module.state_dict(), "optimizer": optimizer.state_dict(), "state": state}
        write_atomically(checkpoint, lambda temporary: torch.save(saved, temporary))

    bar = tqdm(total=steps_total, initial=state["step"], desc=f"training {head.config.kind}", unit="seq",
               disable=not progress)
    stopped = "epochs"
    try:
        while state["epoch"] < args.epochs:
            order = list(range(len(train_rows)))
            random.Random(args.seed + state["epoch"]).shuffle(order)  # each epoch's own order: a resume goes on in it
            for i in order[state["step"] % len(train_rows):]:
                if budget.left() <= eval_reserve(budget):
                    stopped = "time budget"
                    break
                # cosine decay over whichever ends first, the epochs or the time budget
                done = max(state["step"] / max(steps_total, 1), (time.monotonic() - started) / train_seconds)
                lr = args.lr * 0.5 * (1 + math.cos(math.pi * min(done, 1)))
                for group in optimizer.param_groups:
                    group["lr"] = max(lr, args.lr * 0.05)
                loss, ce, agree = losses(head, module, train_rows[i], 0.1, generator, not args.answers_only)
                ce, agree = ce.detach(), agree.detach()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(module.parameters(), 0.5)
                optimizer.step()
                state["step"] += 1
                bar.update(1)
                bar.set_postfix(ce=f"{ce.item():.3f}", top1=f"{agree.item():.2f}")
            else:
                state["epoch"] += 1
                save()
                continue
            break
    except KeyboardInterrupt:
        bar.close()
        save()
        raise
    bar.close()
    save()
    module.eval().requires_grad_(False)
    return {**state, "stopped_by": stopped}


def resume_checkpoint(checkpoint: Path, module, optimizer) -> dict | None:
    """The training state a checkpoint holds, loaded into `module` and `optimizer`; None (said) where it is damaged
    or belongs to another head: training starts over."""
    import torch

    initial = {k: v.clone() for k, v in module.state_dict().items()}
    try:
        saved = torch.load(checkpoint, weights_only=True)
        state = saved["state"]
        if not all(isinstance(state.get(k), int | float) for k in ("epoch", "step", "seconds")):
            raise ValueError("no epoch, step and seconds")
        module.load_state_dict(saved["module"])
        optimizer.load_state_dict(saved["optimizer"])
        return state
    except Exception as error:  # noqa: BLE001 (a cut file, another head's shapes: either way it cannot continue)
        module.load_state_dict(initial)  # a load that failed half-way leaves some of its weights
        print(f"warning: {checkpoint} cannot be continued ({one_line(error)}): training starts over",
              file=sys.stderr)
        return None


def eval_reserve(budget: Budget) -> float:
    """Seconds kept for the held-out evaluation and saving."""
    return min(120.0, 0.05 * budget.seconds)


# -- 3. held-out -----------------------------------------------------------------------------------------------


class StoredFeatures:
    """A stand-in for the target's cached model over one stored sequence: what the head drafters read."""

    max_length = 1 << 31

    def __init__(self, ids: list[int], features):
        self.all_ids, self.features = ids, features
        self.tokens: list[int] = []

    def keep_hidden(self) -> None:
        pass

    def at(self, length: int) -> None:
        self.tokens = self.all_ids[: length - 1]

    @property
    def hidden(self):
        return self.features[: len(self.tokens)]


def held_out_tokens_per_step(head, rows: list[dict], depth: int, tree: int, branch: int, limit: int = 1200,
                             seconds: float = math.inf) -> dict[str, float | int]:
    """Mean tokens per target step, greedy, when the drafter drafts at each answer position of `rows` (the answer
    being the target's own greedy text, a draft is accepted as far as it matches it); at most `limit` positions and
    half of `seconds` each for the chain and the tree (`positions`: the fewer they had)."""
    from sampling.drafters.eagle import EagleDrafter
    from sampling.drafters.medusa import MedusaDrafter
    from utils.logits_processor import GreedyProcessor

    results: dict[str, float | int] = {"positions": limit}
    for name, width in (("chain", 1), ("tree", branch)):
        steps = accepted = 0
        deadline = time.monotonic() + seconds / 2
        for row in rows:
            ids = row["ids"].tolist()
            stored = StoredFeatures(ids, row["features"].float())
            make = EagleDrafter if head.config.kind == "eagle" else MedusaDrafter
            drafter = make(stored, head, width, depth if name == "chain" else tree)
            for n in range(max(row["start"], 2), len(ids)):
                if steps >= limit or time.monotonic() >= deadline:
                    break
                stored.at(n)
                draft = drafter.propose(ids[:n], depth, GreedyProcessor(), None)
                accepted += _accepted(draft, ids[n:])
                steps += 1
        results[f"{name}_tokens_per_step"] = round(1 + accepted / max(steps, 1), 3)
        results["positions"] = min(results["positions"], steps)
    return results


def _accepted(draft, truth: list[int]) -> int:
    """How many drafts greedy verification keeps when the target's text is `truth`."""
    parents = draft.parents or list(range(-1, len(draft) - 1))
    best, depth = 0, {-1: 0}
    for i, (token, parent) in enumerate(zip(draft.tokens, parents, strict=True)):
        if parent in depth and depth[parent] < len(truth) and token == truth[depth[parent]]:
            depth[i] = depth[parent] + 1
            best = max(best, depth[i])
    return best


# -- main ------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    budget = Budget(args.time_budget)
    out = Path(args.out)
    try:
        prompts = read_prompts(args.prompts)
        check_out(out, Path(args.data) if args.data else None, args.resume or args.overwrite)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return USAGE_EXIT
    try:
        with exclusive(out, wait=False):  # made if absent
            return run(args, prompts, budget, argv)
    except Busy:
        print(f"error: another train_head.py run is using {out}: wait for it to end, or choose another --out",
              file=sys.stderr)
        return USAGE_EXIT
    except KeyboardInterrupt:
        print(f"interrupted: {out} keeps the answers and the checkpoint made so far; --resume continues from them",
              file=sys.stderr)
        return INTERRUPTED_EXIT


def read_prompts(paths: list[str]) -> list[str]:
    """Every prompt's first turn; ValueError or FileNotFoundError (one line) for a bad file or none at all."""
    from benchmarks.prompts import load_prompts

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


def remove_own_files(out: Path, data: Path) -> None:
    """What a run left in OUT (its head, checkpoint and, in OUT/data, its answers): --overwrite starts over."""
    for file in [*(out / name for name in OWN_FILES), *(data.glob("batch-*.pt") if data == out / "data" else [])]:
        file.unlink(missing_ok=True)


def run(args, prompts: list[str], budget: Budget, argv: list[str] | None) -> int:
    import torch

    from utils.heads import HeadConfig, bind, build, eagle_config
    from utils.loading import load_model
    from utils.presets import ModelLoadError

    out = Path(args.out)
    data_dir = Path(args.data) if args.data else out / "data"
    torch.manual_seed(args.seed)
    random.Random(args.seed).shuffle(prompts)
    try:
        loaded = load_model(args.target, device=args.device, dtype=args.dtype, progress=not args.no_progress)
    except ModelLoadError as error:
        print(f"error: {error}", file=sys.stderr)
        return FAILED_EXIT
    model = loaded.model
    if args.overwrite:
        remove_own_files(out, data_dir)
    data = make_data(model, loaded.tokenizer, prompts, data_dir, args.max_new_tokens, args.batch, budget,
                     args.data_share, not args.no_progress)
    if len(data) < 2:
        print(f"error: the budget left {len(data)} answers to train on, 2 at least are needed: give a larger "
              "--time-budget (or --data-share)", file=sys.stderr)
        return FAILED_EXIT
    data_seconds = budget.used()
    held = max(1, round(len(data) * args.held_out)) if args.held_out else 0
    held_rows, train_rows = data[:held], data[held:]
    vocab_size = model.get_output_embeddings().out_features
    vocab = draft_vocabulary(train_rows, vocab_size, args.draft_vocab)
    config = (eagle_config(model.config, args.intermediate) if args.kind == "eagle"
              else HeadConfig("medusa", model.config.hidden_size, num_heads=args.heads))
    module = build(config)
    head = bind(config, module, model, vocab)
    stats = train(head, module, train_rows, args, budget, out / CHECKPOINT, not args.no_progress)
    evaluation = (held_out_tokens_per_step(head, held_rows, args.eval_depth, args.eval_tree, DEFAULT_BRANCH,
                                           seconds=max(budget.left(), 0.0))
                  if held_rows else {})
    tokens = sum(len(r["ids"]) - r["start"] for r in data)
    info = {"target": loaded.name, "target_source": loaded.source, "answers": len(data), "held_out_answers": held,
            "answer_tokens": tokens, "draft_vocab": None if vocab is None else len(vocab),
            "data_seconds": round(data_seconds), "train_seconds": round(stats["seconds"]), "epochs": stats["epoch"],
            "steps": stats["step"], "stopped_by": stats["stopped_by"], "held_out": evaluation,
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

    from utils.heads import save_head

    temporary = out / f".head.tmp-{os.getpid()}"
    try:
        save_head(temporary, config, module, vocab, info)
        for file in sorted(temporary.iterdir(), key=lambda f: f.suffix == ".json"):  # the weights first, head.json last
            os.replace(file, out / file.name)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
