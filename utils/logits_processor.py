"""Logits processors: logits -> probabilities -> token, written once for every strategy.

Every processor works on `(..., V)` tensors and never mutates its input. Order (as in HF): temperature, then the
filters (top-k, top-p, min-p). `probs` gives the distribution a strategy samples from (and that speculative
verification uses for both p and q), `sample` draws from it with an explicit `torch.Generator`.

The module works through tensor methods and never imports torch itself: the command lines build a processor to check
their sampling flags before loading anything, and --help stays instant.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from utils.checks import integer, number

if TYPE_CHECKING:
    import torch
    from torch import Tensor

# Lower temperatures sample the argmax anyway, and far lower ones make logits / T overflow (inf, then nan).
MIN_TEMPERATURE = 1e-3


def check_temperature(temperature: float) -> float:
    return number("temperature", temperature, MIN_TEMPERATURE, hint=" (use 0 for greedy)")


def check_top_k(top_k: int) -> int:
    return integer("top_k", top_k, 1)


def check_top_p(top_p: float) -> float:
    return number("top_p", top_p, 0, 1, low_open=True)


def check_min_p(min_p: float) -> float:
    return number("min_p", min_p, 0, 1, low_open=True)


def sample(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One token per row of `probs` (..., V), each row's weights (not necessarily summing to 1) -> (...).

    The inverse of each row's cumulative distribution (in float64) at one uniform draw a row; a token of weight 0 is
    never drawn. `torch.multinomial` draws an exponential per token of the vocabulary instead: about 3 ms a row of
    151,936 tokens on a CPU, against 0.1 (docs/design.md).
    """
    import torch  # here: this module loads before torch does (the command line's checks)

    flat = probs.reshape(-1, probs.shape[-1])
    cumulative = torch.cumsum(flat, -1, dtype=torch.float64)
    u = torch.rand(flat.shape[0], 1, generator=generator, dtype=torch.float64, device=flat.device)
    # right: the first token whose cumulative weight exceeds the draw (u = 0 skips leading zero weights); the clamp
    # only takes a draw that rounds up to the total
    index = torch.searchsorted(cumulative, u * cumulative[:, -1:], right=True)
    return index.clamp_max(flat.shape[-1] - 1).reshape(probs.shape[:-1])


class LogitsProcessor:
    """Base class: subclasses override `_filter` (and `is_greedy`)."""

    is_greedy = False

    def __init__(self, temperature: float = 1.0):
        self.temperature = check_temperature(temperature)

    def _filter(self, logits: Tensor) -> Tensor:
        """Mask excluded tokens with -inf; `logits` is already a fresh float tensor."""
        return logits

    def __call__(self, logits: Tensor) -> Tensor:
        """Processed logits, float32 or wider, -inf where a token is excluded. The input is not modified."""
        logits = logits.float() if logits.element_size() < 4 else logits  # bf16, fp16: float32
        return self._filter(logits / self.temperature)

    def probs(self, logits: Tensor) -> Tensor:
        return self(logits).softmax(-1)

    def sample(self, probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """One token per row of `probs` (..., V) -> (...)."""
        return sample(probs, generator)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class GreedyProcessor(LogitsProcessor):
    """Exact argmax: `probs` is one-hot, never a tiny temperature."""

    is_greedy = True

    def __init__(self):
        self.temperature = 1.0

    def probs(self, logits: Tensor) -> Tensor:
        logits = self(logits)
        return logits.new_zeros(logits.shape).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)

    def sample(self, probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
        return probs.argmax(-1)


class MultinomialProcessor(LogitsProcessor):
    """Plain sampling with temperature."""


class TopKProcessor(LogitsProcessor):
    def __init__(self, temperature: float = 1.0, top_k: int = 50):
        super().__init__(temperature)
        self.top_k = check_top_k(top_k)

    def _filter(self, logits: Tensor) -> Tensor:
        return _keep_top_k(logits, self.top_k)


class NucleusProcessor(LogitsProcessor):
    """Top-p: keep the smallest set of most likely tokens whose probability reaches `top_p`."""

    def __init__(self, temperature: float = 1.0, top_p: float = 0.9):
        super().__init__(temperature)
        self.top_p = check_top_p(top_p)

    def _filter(self, logits: Tensor) -> Tensor:
        return _keep_top_p(logits, self.top_p)


class TopKNucleusProcessor(LogitsProcessor):
    """Top-k, then top-p on what is left."""

    def __init__(self, temperature: float = 1.0, top_k: int = 50, top_p: float = 0.9):
        super().__init__(temperature)
        self.top_k, self.top_p = check_top_k(top_k), check_top_p(top_p)

    def _filter(self, logits: Tensor) -> Tensor:
        return _keep_top_p(_keep_top_k(logits, self.top_k), self.top_p)


class MinPProcessor(LogitsProcessor):
    """Min-p: keep tokens whose probability is at least `min_p` times the most likely token's."""

    def __init__(self, temperature: float = 1.0, min_p: float = 0.05):
        super().__init__(temperature)
        self.min_p = check_min_p(min_p)

    def _filter(self, logits: Tensor) -> Tensor:
        threshold = logits.max(-1, keepdim=True).values + math.log(self.min_p)
        return logits.masked_fill(logits < threshold, float("-inf"))


def _keep_top_k(logits: Tensor, k: int) -> Tensor:
    if k >= logits.shape[-1]:
        return logits
    kth = logits.topk(k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def _keep_top_p(logits: Tensor, top_p: float, first: int = 64) -> Tensor:
    """Drop a token when the likelier tokens before it already reach top_p; the most likely token always stays.
    The likeliest `first` tokens are ranked first, twice as many while some row's nucleus reaches past them: a
    nucleus is a few tokens of a 150k vocabulary, and a whole sort of it costs milliseconds per row on a CPU."""
    if top_p >= 1.0:
        return logits
    probs, vocab = logits.softmax(-1), logits.shape[-1]
    k = min(first, vocab)
    while True:
        top = probs.topk(k, dim=-1)  # sorted, likeliest first
        before = top.values.cumsum(-1) - top.values
        if k == vocab or bool((before[..., -1] >= top_p).all()):  # every row drops its k-th: the nucleus lies within
            break
        k = min(2 * k, vocab)
    kept = before < top_p
    keep = kept.new_zeros(logits.shape).scatter_(-1, top.indices, kept)
    return logits.masked_fill(~keep, float("-inf"))


PROCESSORS: dict[str, type[LogitsProcessor]] = {
    "greedy": GreedyProcessor,
    "multinomial": MultinomialProcessor,
    "topk": TopKProcessor,
    "nucleus": NucleusProcessor,
    "topknucleus": TopKNucleusProcessor,
    "minp": MinPProcessor,
}


def make_processor(temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                   min_p: float | None = None) -> LogitsProcessor:
    """The processor that HF-style flags describe: temperature 0 means greedy. Every value given is checked, also
    those the chosen processor does not use (greedy ignores the filters; min-p replaces top-k and top-p)."""
    if top_k is not None:
        check_top_k(top_k)
    if top_p is not None:
        check_top_p(top_p)
    if min_p is not None:
        check_min_p(min_p)
    if temperature == 0:
        return GreedyProcessor()
    if min_p is not None:
        return MinPProcessor(temperature, min_p)
    if top_k is not None and top_p is not None:
        return TopKNucleusProcessor(temperature, top_k, top_p)
    if top_k is not None:
        return TopKProcessor(temperature, top_k)
    if top_p is not None:
        return NucleusProcessor(temperature, top_p)
    return MultinomialProcessor(temperature)
