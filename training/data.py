"""1. Data: the target answers the prompts in batches, its last hidden states kept with the answers; batches saved
as they come, read back and checked on a resume. Answers made before, kept as token ids (`answers.jsonl.gz`, a few
hundred KB where their features take a GB), have their features made again by one forward of the target each."""

from __future__ import annotations

import gzip
import json
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from training.budget import Budget
from utils.errors import one_line
from utils.files import write_atomically

SORTED_BATCHES = 4  # the prompts of this many batches are sorted by length (characters) before they are batched
ANSWERS = "answers.jsonl.gz"  # every answer a run trained on, as token ids: what --answers reads


def make_data(model, tokenizer, prompts: list[str], out: Path, max_new_tokens: int, batch: int, budget: Budget,
              share: float, progress: bool, reused: Sequence[dict] = ()) -> list[dict]:
    """Each prompt's answer and features, {"ids": (T,) long, "features": (T, H) half, "start": answer start, "prompt":
    its text}, saved one batch per file; the prompts the batches already in `out` answered are not asked again,
    whatever batch size made them. `reused` answers (read_answers) come first: each one's features are made by one
    forward of the target over it, and its prompt is not asked again."""
    import torch
    from tqdm import tqdm

    from models.vocab import end_token_ids

    out.mkdir(parents=True, exist_ok=True)
    data, next_file = read_batches(out)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ends = set(end_token_ids(tokenizer, model.generation_config))

    def save(rows: list[dict]) -> None:
        nonlocal next_file
        file = out / f"batch-{next_file:04d}.pt"
        write_atomically(file, lambda temporary: torch.save(rows, temporary))
        next_file += 1
        data.extend(rows)

    again = unanswered_rows(reused, data)
    for first in range(0, len(again), batch):
        if budget.left(share) <= 0:
            print(f"answers: the data share of the budget is spent after {len(data)} answers", file=sys.stderr)
            return data
        save([{**row, "features": _features(model, row["ids"].tolist())} for row in again[first:first + batch]])
    todo = unanswered(prompts, data)
    bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc="answers", unit="prompt",
               disable=not progress)
    for first in range(0, len(todo), batch):
        seconds = budget.left(share)
        if seconds <= 0:
            print(f"answers: the data share of the budget is spent after {len(data)} prompts", file=sys.stderr)
            break
        if first % (batch * SORTED_BATCHES) == 0:  # prompts of like lengths batched together: less padding
            window = slice(first, first + batch * SORTED_BATCHES)
            todo[window] = sorted(todo[window], key=len)
        asked = todo[first:first + batch]
        rows = [_chat_ids(tokenizer, prompt) for prompt in asked]
        save([{**row, "prompt": prompt}
              for row, prompt in zip(_answer(model, rows, pad, ends, max_new_tokens, seconds), asked, strict=True)])
        bar.update(len(rows))
    bar.close()
    return data


def save_answers(data: list[dict], path: Path) -> None:
    """The answers' token ids, a JSON object a line ({"prompt", "start", "ids"}, and "read": true for text the
    target read), gzipped: what read_answers reads."""

    def write(temporary: Path) -> None:
        with gzip.open(temporary, "wt", encoding="utf-8") as file:
            for row in data:
                kept = {key: row[key] for key in ("prompt", "read") if row.get(key)}
                file.write(json.dumps({**kept, "start": row["start"], "ids": row["ids"].tolist()}) + "\n")

    write_atomically(path, write)


def read_answers(paths: list[Path]) -> list[dict]:
    """Answers saved by save_answers, {"ids": (T,) long, "start", "prompt"}; ValueError (one line: the file and line,
    and what is wrong there) for a file that is not one, or holds none. Blank lines are skipped."""
    import torch

    rows = []
    for path in paths:
        try:
            with gzip.open(path, "rt", encoding="utf-8") as file:
                lines = file.readlines()
        except FileNotFoundError:
            raise ValueError(f"no answers file at {path}") from None
        except (OSError, EOFError, UnicodeDecodeError) as error:
            raise ValueError(f"{path}: not a gzipped answers file ({one_line(error)})") from None
        if not any(line.strip() for line in lines):
            raise ValueError(f"{path}: no answers in it ({'an empty file' if not lines else 'blank lines only'}): "
                             "give the answers.jsonl.gz a run wrote beside its head")
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not JSON ({error.msg})") from None
            if (problem := _answer_problem(row)) is not None:
                raise ValueError(f"{path}:{number}: not an answer: {problem}")
            rows.append({"ids": torch.tensor(row["ids"]), "start": row["start"],
                         **{key: row[key] for key in ("prompt", "read") if row.get(key)}})
    return rows


READ_CHARACTERS = 1600  # a text read is cut into pieces of about this many characters (some 400 tokens), at lines
READ_LIMIT = 64 << 20  # the most characters --read takes from one file
READ_ASKED = "Go on."  # each piece is the answer to this: the target reads it where it drafts, in an answer


def read_texts(paths: list[Path]) -> list[tuple[str, str]]:
    """Text files cut into pieces at line ends, (name, piece) each: text the target reads to make training data at a
    prefill's speed (`text_rows`). ValueError (one line) for a file that is missing, not UTF-8 text, or empty."""
    pieces = []
    for path in paths:
        try:
            raw = path.read_bytes()[:READ_LIMIT]
            text = raw.decode("utf-8")
        except FileNotFoundError:
            raise ValueError(f"--read: no file at {path}") from None
        except IsADirectoryError:
            raise ValueError(f"--read: {path} is a directory; give its files") from None
        except UnicodeDecodeError:
            raise ValueError(f"--read: {path} is not UTF-8 text") from None
        if "\x00" in text or not text.strip():
            raise ValueError(f"--read: {path} is {'binary' if text.strip() else 'empty'}: give a text file")
        piece, size = [], 0
        for line in text.splitlines(keepends=True):
            piece.append(line)
            size += len(line)
            if size >= READ_CHARACTERS:
                pieces.append((path.name, "".join(piece)))
                piece, size = [], 0
        pieces.append((path.name, "".join(piece)))
    return [(name, piece) for name, piece in pieces if piece.strip()]


def text_rows(tokenizer, pieces: list[tuple[str, str]]) -> list[dict]:
    """Each piece as the answer to READ_ASKED through the chat template, as read_answers gives answers (marked
    "read": trained on, never held out, since the target did not write it): its features come from one forward."""
    import torch

    from app.text import chat_ids

    prompt = chat_ids(tokenizer, [{"role": "user", "content": READ_ASKED}])
    rows = []
    for number, (name, piece) in enumerate(pieces):
        ids = prompt + tokenizer(piece, add_special_tokens=False)["input_ids"]
        rows.append({"ids": torch.tensor(ids), "start": len(prompt), "prompt": f"read {name} {number}", "read": True})
    return rows


LARGEST_ID = 2**63 - 1  # a token id must fit a long (torch.int64)


def _answer_problem(row) -> str | None:
    """What keeps a saved line from being an answer, {"prompt": text, "start": n, "ids": [token ids]} with its
    prompt's ids before n and its answer's from n; None for an answer."""
    if not isinstance(row, dict):
        return f'a JSON object {{"prompt": text, "start": n, "ids": [token ids]}}, not {type(row).__name__}'
    ids = row.get("ids")
    if not isinstance(ids, list) or len(ids) < 2:
        return '"ids" must be a list of token ids, the prompt\'s then the answer\'s (2 at least)'
    for i in ids:
        if type(i) is not int or not 0 <= i <= LARGEST_ID:
            return f'"ids" holds {json.dumps(i)}: a token id is an integer from 0 to 2^63 - 1'
    start = row.get("start")
    if type(start) is not int or not 1 <= start < len(ids):
        return f'"start" must be an integer from 1 to {len(ids) - 1} (where the answer starts in "ids"), not {start!r}'
    if not isinstance(row.get("prompt", ""), str):
        return '"prompt" must be text'
    return None


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


def unanswered_rows(rows: Sequence[dict], data: Sequence[dict]) -> list[dict]:
    """The answers in `rows` that no answer in `data` stands for yet: one with the same prompt (each answer there
    stands for one), or for an answer kept without its prompt, the same token ids."""
    answered = Counter(_answered(row) for row in data)
    todo = []
    for row in rows:
        if answered[_answered(row)] > 0:
            answered[_answered(row)] -= 1
        else:
            todo.append(row)
    return todo


def _answered(row: dict) -> str | tuple[int, ...]:
    return row["prompt"] if "prompt" in row else tuple(row["ids"].tolist())


def _chat_ids(tokenizer, prompt: str) -> list[int]:
    from app.text import chat_ids

    return chat_ids(tokenizer, [{"role": "user", "content": prompt}])


def _answer(model, rows: list[list[int]], pad: int, ends: set[int], max_new_tokens: int, seconds: float,
            ) -> list[dict]:
    """Greedy answers of a batch (left-padded), with the last hidden state of every prompt and answer token; cut
    short after `seconds` (the budget's: an answer cut short is still the target's own text). A finished answer
    leaves the batch at once, so the forwards carry only the rows still answering (on a CPU a forward's cost grows
    with its rows)."""
    import time

    import torch
    from transformers import DynamicCache

    deadline = time.monotonic() + seconds
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=model.device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=model.device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    decoder, output_layer = model.get_decoder(), model.get_output_embeddings()  # the model without its head, the head
    answers: list[list[int]] = [[] for _ in rows]
    features: list[list] = [[] for _ in rows]  # per row, chunks of (T, H): the prompt's, then one per token fed
    active = list(range(len(rows)))  # the batch rows still answering, in the cache's order
    with torch.inference_mode():
        hidden = decoder(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                         use_cache=True).last_hidden_state
        for b, prompt in enumerate(rows):
            features[b].append(hidden[b, width - len(prompt):].to(torch.float16).cpu())
        last = hidden[:, -1]
        positions = positions[:, -1:]
        while True:
            tokens = output_layer(last).argmax(-1).tolist()
            out_of_time = time.monotonic() >= deadline
            keep = []
            for j, (b, token) in enumerate(zip(active, tokens, strict=True)):
                answers[b].append(token)
                if token not in ends and len(answers[b]) < max_new_tokens and not out_of_time:
                    keep.append(j)
            if not keep:
                break
            if len(keep) < len(active):
                index = torch.tensor(keep, device=model.device)
                cache.reorder_cache(index)
                mask, positions = mask[index], positions[index]
                active, tokens = [active[j] for j in keep], [tokens[j] for j in keep]
            mask = torch.cat([mask, mask.new_ones(len(active), 1)], 1)
            positions = positions + 1
            step = torch.tensor(tokens, device=model.device)[:, None]
            last = decoder(input_ids=step, attention_mask=mask, position_ids=positions, past_key_values=cache,
                           use_cache=True).last_hidden_state[:, -1]
            kept = last.to(torch.float16).cpu()  # one copy a step, each row a view of it
            for j, b in enumerate(active):
                features[b].append(kept[j:j + 1])
    # features for every token but the last (its hidden state is never computed)
    return [{"ids": torch.tensor(prompt + answer), "features": torch.cat(feats), "start": len(prompt)}
            for prompt, answer, feats in zip(rows, answers, features, strict=True)]


def _features(model, ids: list[int]):
    """The last hidden state at every position of `ids` (a prompt and its answer) but the last, from one forward over
    them: what the answer loop kept while it made them, up to another order of sums. One answer a forward: a padded
    batch of 16 took twice as long on a CPU (docs/heads.md)."""
    import torch

    with torch.inference_mode():
        hidden = model.get_decoder()(input_ids=torch.tensor([ids[:-1]], device=model.device),
                                     use_cache=False).last_hidden_state
    return hidden[0].to(torch.float16).cpu()
