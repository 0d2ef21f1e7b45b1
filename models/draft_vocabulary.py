"""A draft model's output layer restricted to a draft vocabulary: the K tokens the target says most often.

A small drafter reads its whole output layer every step: Qwen2.5-0.5B's is 151,936 x 896 weights, over a quarter of
the bytes of its step. Restricted to the K most frequent tokens (FR-Spec's idea, as the eagle head drafts), a step
reads K rows instead. The logits come back over the whole vocabulary, -inf outside the K, so nothing downstream
changes: the drafter never proposes a token outside them, and where the target says one the draft is rejected there
and the round ends. A draft distribution over a subset is still a valid q: greedy output and the sampled distribution
are the target's as always; only acceptance can move, and the calibration weighs that against the cheaper step
(app/calibration.py). Which K is counted on answers the project ships (heads/answers/), never on the benchmark's
prompts.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import torch
from torch import Tensor, nn

from models.formats.blocks import BlockLinear
from models.formats.layers import linear_weight

SIZES = (8192, 16384, 32768)  # the restricted sizes the calibration times (0: the whole vocabulary)


def answer_tokens(path: Path) -> list[list[int]]:
    """The answers' token ids (each answer without its prompt) in an answers file ({"start", "ids"} a line,
    gzipped: what train_head.py writes); ValueError, one line, for a file that is not one."""
    answers, number = [], 0
    try:
        with gzip.open(path, "rt", encoding="utf-8") as file:
            for number, line in enumerate(file, 1):  # noqa: B007 (the line an error names)
                if line.strip():
                    row = json.loads(line)
                    answers.append([int(t) for t in row["ids"][int(row["start"]):]])
    except (OSError, EOFError, UnicodeDecodeError, ValueError, KeyError, TypeError) as error:
        where = f"{path}:{number}" if number else str(path)
        raise ValueError(f"{where}: not an answers file ({type(error).__name__}: {error})") from None
    return answers


def ranking(answers: list[list[int]], vocab_size: int) -> Tensor:
    """Every token id, the answers' tokens first by how often they come (ties: lower id first), then the rest by id
    (a BPE vocabulary's lower ids are its earlier, commoner merges)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in answers:
        kept = torch.tensor([t for t in ids if 0 <= t < vocab_size], dtype=torch.long)
        counts.index_add_(0, kept, torch.ones_like(kept))
    # a stable sort on the negated counts: most frequent first, ids ascending among equals and among the unseen
    return torch.sort(-counts, stable=True).indices


def coverage(answers: list[list[int]], vocab_size: int, sizes: tuple[int, ...] = SIZES) -> dict[int, float]:
    """For each size, the share of answer tokens inside that many of the most frequent, held out: ranked on every
    other answer, counted on the others (the rate at which the target's next token can be drafted at all)."""
    ranked = ranking(answers[::2], vocab_size)
    held_out = [t for ids in answers[1::2] for t in ids if 0 <= t < vocab_size]
    if not held_out:
        return {}
    position = torch.empty(vocab_size, dtype=torch.long)
    position[ranked] = torch.arange(vocab_size)
    ranks = position[torch.tensor(held_out)]
    return {size: float((ranks < size).float().mean()) for size in sizes if size < vocab_size}


class VocabularyOutput(nn.Module):
    """An output layer's rows of `ids` only; its logits put back over the whole vocabulary, -inf elsewhere."""

    rows: nn.Module
    ids: Tensor  # buffer

    def __init__(self, rows: nn.Module, ids: Tensor, vocab_size: int):
        super().__init__()
        self.rows = rows
        self.register_buffer("ids", ids)
        self.in_features, self.out_features = rows.in_features, vocab_size

    def forward(self, x: Tensor) -> Tensor:
        part = self.rows(x)
        whole = part.new_full((*part.shape[:-1], self.out_features), float("-inf"))
        return whole.index_copy_(-1, self.ids, part)

    def extra_repr(self) -> str:
        return f"draft vocabulary of {self.ids.numel()} of {self.out_features} tokens"


def restricted(layer: nn.Module, ids: Tensor) -> nn.Module:
    """A linear layer holding only rows `ids` of `layer`, in its format: a GGUF block layer's bytes as they are (the
    same values), any other's weights as a float32 `nn.Linear`."""
    bias = getattr(layer, "bias", None)
    if isinstance(layer, BlockLinear):
        import kernels

        file_rows = kernels.unpack(layer.blocks, layer.type_id)[ids]
        return BlockLinear(file_rows, layer.block_type, layer.in_features, None if bias is None else bias[ids])
    weight = linear_weight(layer)[ids]
    rows = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device,
                     dtype=weight.dtype)
    with torch.no_grad():
        rows.weight.copy_(weight)
        if bias is not None:
            rows.bias.copy_(bias[ids])
    return rows.requires_grad_(False)


class DraftVocabulary:
    """A draft model's output layer, switchable between its whole vocabulary and the `size` most frequent tokens of
    `ranked` (`use`); each restricted layer is built once."""

    def __init__(self, model, ranked: Tensor, held_out_coverage: dict[int, float]):
        self.model, self.ranked, self.coverage = model, ranked, dict(held_out_coverage)
        self.whole = model.get_output_embeddings()
        self.vocab_size = int(self.whole.out_features)
        self.size = 0
        self._layers: dict[int, nn.Module] = {}

    @classmethod
    def from_answers(cls, model, path: Path) -> DraftVocabulary:
        answers = answer_tokens(path)
        size = int(model.get_output_embeddings().out_features)
        return cls(model, ranking(answers, size), coverage(answers, size))

    @property
    def sizes(self) -> tuple[int, ...]:
        """The restricted sizes this vocabulary can take and has a held-out coverage for."""
        return tuple(size for size in SIZES if size in self.coverage)

    def use(self, size: int) -> None:
        """Draft from the `size` most frequent tokens from now on (0: the whole vocabulary)."""
        if size and not 0 < size < self.vocab_size:
            raise ValueError(f"a draft vocabulary takes 1 to {self.vocab_size - 1} tokens (0: all), not {size}")
        if size and size not in self._layers:
            ids = self.ranked[:size].sort().values  # ascending: the rows read in the order they lie
            self._layers[size] = VocabularyOutput(restricted(self.whole, ids), ids, self.vocab_size)
        self.model.set_output_embeddings(self._layers[size] if size else self.whole)
        self.size = size

    def describe(self) -> str:
        if not self.size:
            return f"the whole vocabulary ({self.vocab_size} tokens)"
        held_out = f", {self.coverage[self.size]:.0%} of held-out answer tokens" if self.size in self.coverage else ""
        return f"a draft vocabulary of {self.size} of {self.vocab_size} tokens{held_out}"
