"""KV-cache helpers on transformers Cache objects, and the invariant every strategy keeps.

THE INVARIANT. A `CachedModel`'s `tokens` are exactly the tokens whose keys and values its cache holds, at positions
0..len(tokens)-1. A strategy keeps, after every round: the target's cache holds every committed token but the last;
the last committed token is the next input. A model is only ever fed the tokens its cache has not seen.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import DynamicCache


def crop(cache: DynamicCache, length: int) -> None:
    """Roll `cache` back to an absolute `length` tokens; cropping to the current length is a no-op."""
    surplus = cache.get_seq_length() - length
    if surplus < 0:
        raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} tokens to {length}")
    if surplus:
        cache.crop(-surplus)


def select_rows(cache: DynamicCache, rows: Tensor) -> None:
    """Keep/reorder batch rows (beams) in place: row i becomes old row rows[i]."""
    cache.reorder_cache(rows)


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


class CachedModel:
    """A causal LM with its own DynamicCache and the list of tokens that cache holds (batch of one)."""

    def __init__(self, model):
        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.tokens: list[int] = []
        self.forwards = 0
        self.device = next(model.parameters()).device

    @property
    def max_length(self) -> int:
        return getattr(self.model.config, "max_position_embeddings", None) or 1 << 31

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    def reset(self) -> None:
        self.crop(0)

    def crop(self, length: int) -> None:
        crop(self.cache, length)
        del self.tokens[length:]

    def forward(self, ids: list[int], keep: int = 1, **model_kwargs) -> Tensor:
        """Feed `ids` after the cached tokens; logits of the last `keep` positions, (keep, V), float32 or wider.

        `model_kwargs` (a 4D `attention_mask`, `position_ids`) are for strategies that feed tree-shaped input; they
        must crop the cache back to committed tokens afterwards.
        """
        start = len(self.tokens)
        if "position_ids" not in model_kwargs:
            model_kwargs["position_ids"] = torch.arange(start, start + len(ids), device=self.device)[None]
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        try:
            out = self.model(input_ids=input_ids, past_key_values=self.cache, use_cache=True, logits_to_keep=keep,
                             **model_kwargs)
        except BaseException:  # e.g. Ctrl-C: some layers may hold the new tokens and others not
            self.cache, self.tokens = DynamicCache(config=self.model.config), []
            raise
        self.tokens.extend(ids)
        self.forwards += 1
        logits = out.logits[0, -keep:]
        return logits if logits.dtype == torch.float64 else logits.float()

    def extend(self, seq: list[int], keep: int = 1) -> Tensor:
        """Make the cache hold `seq` and return the logits of its last `keep` positions, (keep, V).

        Reuses the longest common prefix with what is cached (multi-turn reuse, drafter re-sync after a rejection or
        after all drafts were accepted) and feeds only the rest; the last `keep` tokens are always fed.
        """
        if len(seq) > self.max_length:
            raise ValueError(f"sequence of {len(seq)} tokens exceeds the model's context of {self.max_length}")
        reuse = min(common_prefix_length(self.tokens, seq), len(seq) - keep)
        self.crop(reuse)
        return self.forward(seq[reuse:], keep)
