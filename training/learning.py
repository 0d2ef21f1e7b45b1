"""2. Training: the head's losses against the target's own distribution (and, for EAGLE, its next feature), the
loop with its checkpoints, the draft vocabulary."""

from __future__ import annotations

import math
import random
import sys
import time
from pathlib import Path

from training.budget import Budget
from utils.errors import one_line
from utils.files import write_atomically


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


def draft_mask(length: int, depth: int):
    """Which keys pass `depth` of a training-time test sees, over the keys of passes 1..depth side by side: its
    position i sees pass 1's keys up to i - depth + 1 (the target's real features) and pass p's key at
    i - depth + p (the chain the head drafted from there, itself last), as drafting depth `depth` sees its cache."""
    import torch

    i, j = torch.arange(length)[:, None], torch.arange(length)[None]
    return torch.cat([j <= i - depth + 1, *(j == i - depth + p for p in range(2, depth + 1))], 1)


def losses(head, module, row: dict, noise: float, generator, prompt: bool = True, depth: int = 1):
    """The head's loss on one sequence: soft-label cross-entropy (and EAGLE's feature distance); its top-1
    agreement with the target. `prompt`: the prompt's positions count too (the target's own features and
    predictions there as well), else the answer's only. `depth` (EAGLE): passes of a training-time test, pass d
    reading at each position the feature pass d - 1 predicted there, as drafting depth d does (EAGLE-3); each
    further pass weighs 0.8 of the one before."""
    import torch
    import torch.nn.functional as F

    from sampling.heads.networks import HeadCache

    feats = row["features"].float()  # (T - 1, H): position i's feature
    ids = row["ids"]
    start = 0 if prompt else max(row["start"] - 1, 0)  # from the first position whose next token is the answer's
    if head.config.kind == "eagle":
        # position i reads (f_i, x_{i+1}) and predicts f_{i+1}: pairs i = 0 .. T - 3
        x = feats[:-1]
        std = x.std(0, keepdim=True)
        x = x + (torch.rand(x.shape, generator=generator) - 0.5) * 2 * noise * std
        embeds = head.embeds(ids[1:-1])[None]
        truth, positions = feats[1:], torch.arange(len(x))
        target_logp = head.logits(truth).log_softmax(-1)
        cache = HeadCache() if depth > 1 else None
        total, inputs = 0.0, x
        for d in range(1, depth + 1):
            mask = draft_mask(len(x), d) if cache is not None else None
            pred = module(inputs[None], embeds, positions, mask, cache)[0]
            inputs = torch.cat([x[:1], pred[:-1]])  # the next pass reads at i what this one predicted at i - 1
            keep = slice(max(start, d - 1), None)  # a chain d deep starts at a real position
            logp = head.logits(pred[keep]).log_softmax(-1)
            ce = -(target_logp[keep].exp() * logp).sum(-1).mean()
            regression = F.smooth_l1_loss(pred[keep], truth[keep])
            total = total + 0.8 ** (d - 1) * (regression + 0.1 * ce)
            if d == 1:  # the first pass's figures are reported
                ce_first, agree = ce, (logp.argmax(-1) == target_logp[keep].argmax(-1)).float().mean()
        return total, ce_first, agree
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
    device = next(module.parameters()).device.type  # autocast's (`--train-bf16`)
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
                with torch.autocast(device, dtype=torch.bfloat16, enabled=args.train_bf16):
                    loss, ce, agree = losses(head, module, train_rows[i], 0.1, generator, not args.answers_only,
                                             args.draft_depth)
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
