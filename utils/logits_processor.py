"""Logits processors: logits -> probabilities -> token, written once for every strategy.

Every processor works on `(..., V)` tensors and never mutates its input. Order (as in HF): temperature, then the
filters (top-k, top-p, min-p). `probs` gives the distribution a strategy samples from (and that speculative
verification uses for both p and q), `sample` draws from it with an explicit `torch.Generator`.
"""

from __future__ import annotations

import torch
from torch import Tensor


class LogitsProcessor:
    """Base class: subclasses override `_filter` (and `is_greedy`)."""

    is_greedy = False

    def __init__(self, temperature: float = 1.0):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 for a sampling processor, got {temperature}")
        self.temperature = float(temperature)

    def _filter(self, logits: Tensor) -> Tensor:
        """Mask excluded tokens with -inf; `logits` is already a fresh float tensor."""
        return logits

    def __call__(self, logits: Tensor) -> Tensor:
        """Processed logits, float32 or wider, -inf where a token is excluded. The input is not modified."""
        logits = logits.float() if logits.dtype not in (torch.float32, torch.float64) else logits
        return self._filter(logits / self.temperature)

    def probs(self, logits: Tensor) -> Tensor:
        return torch.softmax(self(logits), dim=-1)

    def sample(self, probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """One token per row of `probs` (..., V) -> (...)."""
        flat = probs.reshape(-1, probs.shape[-1])
        return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])

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
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)

    def sample(self, probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
        return probs.argmax(-1)


class MultinomialProcessor(LogitsProcessor):
    """Plain sampling with temperature."""


class TopKProcessor(LogitsProcessor):
    def __init__(self, temperature: float = 1.0, top_k: int = 50):
        super().__init__(temperature)
        if int(top_k) != top_k or top_k < 1:
            raise ValueError(f"top_k must be an integer >= 1, got {top_k}")
        self.top_k = int(top_k)

    def _filter(self, logits: Tensor) -> Tensor:
        return _keep_top_k(logits, self.top_k)


class NucleusProcessor(LogitsProcessor):
    """Top-p: keep the smallest set of most likely tokens whose probability reaches `top_p`."""

    def __init__(self, temperature: float = 1.0, top_p: float = 0.9):
        super().__init__(temperature)
        _check_top_p(top_p)
        self.top_p = float(top_p)

    def _filter(self, logits: Tensor) -> Tensor:
        return _keep_top_p(logits, self.top_p)


class TopKNucleusProcessor(LogitsProcessor):
    """Top-k, then top-p on what is left."""

    def __init__(self, temperature: float = 1.0, top_k: int = 50, top_p: float = 0.9):
        super().__init__(temperature)
        if int(top_k) != top_k or top_k < 1:
            raise ValueError(f"top_k must be an integer >= 1, got {top_k}")
        _check_top_p(top_p)
        self.top_k, self.top_p = int(top_k), float(top_p)

    def _filter(self, logits: Tensor) -> Tensor:
        return _keep_top_p(_keep_top_k(logits, self.top_k), self.top_p)


class MinPProcessor(LogitsProcessor):
    """Min-p: keep tokens whose probability is at least `min_p` times the most likely token's."""

    def __init__(self, temperature: float = 1.0, min_p: float = 0.05):
        super().__init__(temperature)
        if not 0 < min_p <= 1:
            raise ValueError(f"min_p must be in (0, 1], got {min_p}")
        self.min_p = float(min_p)

    def _filter(self, logits: Tensor) -> Tensor:
        threshold = logits.max(-1, keepdim=True).values + torch.log(torch.tensor(self.min_p, dtype=logits.dtype))
        return logits.masked_fill(logits < threshold, float("-inf"))


def _check_top_p(top_p: float) -> None:
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def _keep_top_k(logits: Tensor, k: int) -> Tensor:
    if k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def _keep_top_p(logits: Tensor, top_p: float) -> Tensor:
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(-1)
    # Drop a token when the tokens before it already reach top_p; the most likely token always stays.
    drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


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
    """The processor that HF-style flags describe: temperature 0 means greedy."""
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
