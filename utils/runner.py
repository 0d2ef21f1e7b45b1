"""Which forward a causal LM runs: eager, its prefill form, its compiled step or its whole compiled graph, each
feeding the one cache (`utils.caching.CachedTokens`) only the tokens it has not seen."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from utils.caching import (
    CachedTokens,
    common_prefix_length,
    crop,
    done_with_step,
    holds_buffers,
    reserve,
    tree_attention,
)
from utils.compiling import compile_config, compiled, every_size

LAST_HIDDEN = -1  # `output_hidden_states` selecting the last one only (transformers takes an index)


def input_device(model) -> torch.device:
    """Where a model's input ids go: its first weight's device; the CPU for a weight accelerate offloaded to disk
    (a meta tensor), whose hooks move each layer's inputs to where it runs and the outputs back to the inputs'."""
    device = next(model.parameters()).device
    return torch.device("cpu") if device.type == "meta" else device


class CachedModel:
    """A causal LM with its own cache and the list of tokens that cache holds (batch of one: `held`).

    `prefill_model`: the same weights in another form, fed every forward of at least `prefill_from` tokens (prompts)
    while `model` takes the short ones (decoding). A low-bit model decodes faster than a dense one on a CPU, where a
    one-token forward is bound by the bytes of weights read, but prefills several times slower (docs/formats.md). Both
    fill the one cache; drafts from it are verified as always.

    `step_model`: `model` compiled for short forwards (`compile_step`), which it then takes for every forward of
    fewer than `prefill_from` tokens once the cache holds two tokens or more (a cache of 0 or 1 would compile a graph
    of its own: torch specializes those sizes): a drafter's first forward of a round feeds the tokens the target
    accepted after its drafts, often two.

    `whole_model`: `model` compiled for every forward (`compile_whole`, the target's), which it then takes for all of
    them, prompts and token trees too, so that every row the cache holds and every logit comes from the one graph.
    It is handed over by `adopt_compiled`, between turns: a turn runs one graph from its start to its end. It gives
    the last hidden states too, so a draft head reads them from the graph.

    `keep_hidden()`: from then on `hidden` also holds the model's last hidden state (after its final norm) of every
    cached token, row for row with `tokens`, through crops and moved rows alike: what draft heads read.

    `min_rows`: every forward runs at least this many rows. A shorter one (a one-token step) gets spare rows after its
    tokens, which no real row attends to, and they are dropped from the cache and the logits: on a CPU whose kernels
    compute a lone row differently from the same row among several, a step then rounds as a verify's rows do
    (`models.invariance` measures which this machine needs).
    """

    def __init__(self, model, prefill_model=None, prefill_from: int = 8):
        self.model, self.prefill_model, self.prefill_from = model, prefill_model, prefill_from
        self.step_model: Callable[..., Any] | None = None
        self.whole_model: Callable[..., Any] | None = None
        self._compiled_whole: Callable[..., Any] | None = None  # ready, not yet adopted
        self.held = CachedTokens(model.config)
        self.forwards = 0
        self.min_rows = 1
        self.device = input_device(model)

    @property
    def cache(self):
        return self.held.cache

    @property
    def tokens(self) -> list[int]:
        return self.held.tokens

    @property
    def keeps_hidden(self) -> bool:
        return self.held.with_hidden

    def keep_hidden(self) -> None:
        """Record hidden states from the next forward on (the cached tokens before it have none: they are dropped)."""
        if not self.keeps_hidden:
            self.held.with_hidden = True
            self.reset()

    @property
    def hidden(self) -> Tensor:
        """(len(tokens), H) the last hidden state of every cached token (`keep_hidden`)."""
        if not self.keeps_hidden:
            raise ValueError("this model does not keep its hidden states: call keep_hidden() first")
        rows = self.held.hidden()
        if rows is None:
            return torch.empty(0, self.model.get_input_embeddings().embedding_dim, device=self.device)
        return rows

    @property
    def max_length(self) -> int:
        return getattr(self.model.config, "max_position_embeddings", None) or 1 << 31

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().out_features

    def reset(self) -> None:
        self.crop(0)

    def crop(self, length: int) -> None:
        self.held.crop(length)

    def crop_to_path(self, length: int, rows: list[int]) -> None:
        """`CachedTokens.crop_to_path`: the first `length` cached tokens, then the tree rows `rows` moved behind."""
        self.held.crop_to_path(length, rows)

    def forward(self, ids: list[int], logits_rows: int = 1, **model_kwargs) -> Tensor:
        """Feed `ids` after the cached tokens; logits of the last `logits_rows` positions, (logits_rows, V), float32 or
        wider.

        `model_kwargs` (a 4D `attention_mask`, `position_ids`) are for tree-shaped input (`extend_tree`); the cache
        must then be brought back to committed tokens (`crop_to_path`).
        """
        start = len(self.tokens)
        spare = 0 if model_kwargs else max(self.min_rows - len(ids), 0)  # a tree's rows come with their own mask
        whole = self.whole_model is not None
        if whole and not holds_buffers(self.cache):  # a new cache: the graph writes into buffers made beforehand
            self._start_buffers()
        step = whole or (self.step_model is not None and 0 < len(ids) < self.prefill_from and not spare and start >= 2
                         and not model_kwargs and not self.keeps_hidden)
        if step:
            reserve(self.cache, start + len(ids) + spare)  # the compiled graph writes the new rows in place
        fed = ids + ids[-1:] * spare
        if whole and not model_kwargs:  # as a tree's rows come: one graph for both, whatever the rows
            allowed = torch.ones(len(fed), start + len(fed), dtype=torch.bool).tril(start)
            model_kwargs = self._masked(allowed, torch.arange(start, start + len(fed)))
        if self.keeps_hidden or whole:  # the graph always gives it: one graph with a draft head or without
            model_kwargs["output_hidden_states"] = LAST_HIDDEN
        if "position_ids" not in model_kwargs:
            model_kwargs["position_ids"] = torch.arange(start, start + len(fed), device=self.device)[None]
        input_ids = torch.tensor([fed], dtype=torch.long, device=self.device)
        if whole:  # a batch of one, a mask broadcast over the heads: sizes of 1 the graph may rely on
            torch._dynamo.mark_static(input_ids, 0)
            for dim in (0, 1):
                torch._dynamo.mark_static(model_kwargs["attention_mask"], dim)
        try:
            prefill = self.prefill_model is not None and len(ids) >= self.prefill_from
            model = self.prefill_model if prefill else self.model
            if whole or (step and self.step_model is not None):  # a graph's module has no truth value: no `or`
                model = self.whole_model if whole else self.step_model
            if self.prefill_model is not None:  # two dtypes may share this cache: float32 prefill, int4 weights with
                # bfloat16 activations for the steps on a CPU without native bf16
                self.held.cast((self.prefill_model if prefill else self.model).dtype)
            with (torch.inference_mode() if step else contextlib.nullcontext(),  # the graph was compiled for it
                  every_size() if whole else contextlib.nullcontext()):  # as it was compiled, should it recompile
                out = model(input_ids=input_ids, past_key_values=self.cache, use_cache=True,
                            logits_to_keep=logits_rows + spare, **model_kwargs)
            if step:
                done_with_step(self.cache)
            if spare:
                crop(self.cache, start + len(ids))
        except BaseException:  # e.g. Ctrl-C: some layers may hold the new tokens and others not
            self.held.drop()
            raise
        self.held.append(ids, out.hidden_states[-1][0, : len(ids)] if self.keeps_hidden else None)
        self.forwards += 1
        logits = out.logits[0, -logits_rows - spare:][:logits_rows]
        return logits if logits.dtype == torch.float64 else logits.float()

    def compile_step(self, workers: int | None = None) -> float:
        """Compile `model` for short forwards (the context length and the rows dynamic) and take them; the seconds it
        took.

        A one-token forward of a small model on a CPU spends a large share of its time in Python and operator dispatch
        between the matrix products (docs/formats.md); the compiled graph fuses the small operators. Compiling takes
        tens of seconds, and `step_model` is set only once the graphs it needs (one token and several, after a forward
        and after a crop) are built, on a scratch cache (it may run on another thread while this model decodes).
        Errors (no C++ compiler, an unsupported model) propagate and leave the model as it was. `workers`: inductor's
        parallel compile processes (None: its default).
        """
        started = time.perf_counter()
        step = compiled(self.model)
        scratch = CachedModel(self.model)
        scratch.step_model = step
        with torch.inference_mode(), compile_config(workers, serial=True):
            scratch.forward([0, 0, 0])
            scratch.forward([0])
            scratch.forward([0])
            scratch.crop(3)
            scratch.forward([0])
            scratch.forward([0, 0])  # torch specializes one row: several take a graph of their own
        self.step_model = step
        return time.perf_counter() - started

    def compile_whole(self, workers: int | None = None) -> float:
        """`model` compiled for every forward, whatever its rows (one graph for all: torch would give one row a graph
        of its own, which rounds otherwise), tree-shaped ones too, ready for `adopt_compiled`; the seconds it took.

        A target whose linears are the project's kernels spends a fifth of a step in the model's small operators and
        the Python between them; the graph fuses them. A verify's rows must still round as the one-token steps do: the
        graph is checked for that on a scratch cache (steps, a verify and a tree of the same tokens, and a prompt ending
        in the first, bit for bit) and refused (ValueError) where they differ. Errors leave the model as it was.
        """
        if self.prefill_model is not None:
            raise ValueError("a model with a prefill form of its own is not compiled whole")
        started = time.perf_counter()
        graph = compiled(self.model)
        scratch = CachedModel(self.model)
        scratch.min_rows = self.min_rows
        scratch.whole_model = graph
        probe = [(i * 7919 + 11) % self.vocab_size for i in range(16)]
        with torch.inference_mode(), compile_config(workers, every_size_too=True):
            scratch.forward(probe[:10])
            steps = torch.cat([scratch.forward([token]) for token in probe[10:14]])
            scratch.crop(10)
            verify = scratch.forward(probe[10:14], logits_rows=4)
            scratch.crop(9)
            tree = scratch.extend_tree(probe[:10], probe[10:14] + probe[14:16], [-1, 0, 1, 2, 0, 4])[1:5]
            scratch.reset()
            again = scratch.forward(probe[:11])
        if not (torch.equal(steps, verify) and torch.equal(steps, tree) and torch.equal(again, steps[:1])):
            raise ValueError("its compiled forward rounds a verify's rows otherwise than its one-token steps")
        self._compiled_whole = graph
        return time.perf_counter() - started

    def prepare_whole(self) -> None:
        """What `compile_whole` needs done on the decoding thread when it runs on another: transformers installs its
        hidden-state hooks under a lock at the first forward asking for them, and a compile held at a pause while
        holding it would stall a turn's forward that asks too (a draft head's). One eager token, on a scratch cache."""
        CachedModel(self.model)._start_buffers()

    def adopt_compiled(self) -> bool:
        """Take the graph `compile_whole` made for every forward from now on (between turns); whether one runs."""
        if self._compiled_whole is not None:
            self.whole_model, self._compiled_whole = self._compiled_whole, None
        return self.whole_model is not None

    def _start_buffers(self) -> None:
        """Make a new cache's buffers (one token fed eagerly, then dropped): a compiled graph writes into them. The
        same forward installs transformers' hooks that give the hidden states, which a graph cannot install."""
        with torch.inference_mode():
            self.model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device), past_key_values=self.cache,
                       use_cache=True, logits_to_keep=1, output_hidden_states=LAST_HIDDEN)
        crop(self.cache, 0)

    def extend(self, seq: list[int], logits_rows: int = 1) -> Tensor:
        """Make the cache hold `seq` and return the logits of its last `logits_rows` positions, (logits_rows, V).

        Reuses the longest common prefix with what is cached (multi-turn reuse, drafter re-sync after a rejection or
        after all drafts were accepted) and feeds only the rest; the last `logits_rows` tokens are always fed.
        """
        if len(seq) > self.max_length:
            raise ValueError(f"sequence of {len(seq)} tokens exceeds the model's context of {self.max_length}")
        reuse = min(common_prefix_length(self.tokens, seq), len(seq) - logits_rows)
        self.crop(reuse)
        return self.forward(seq[reuse:], logits_rows)

    def extend_tree(self, seq: list[int], tree: list[int], parents: list[int]) -> Tensor:
        """`extend(seq)`, then a token tree after its last token in the same forward; (1 + len(tree), V) logits.

        Row 0 is the last token of `seq`, row 1 + i tree node `tree[i]`, which sees `seq` and its own ancestors
        (`tree_attention(parents)`) at position len(seq) - 1 + depth. The cache then holds the tree's rows after `seq`:
        `crop_to_path` the accepted ones.
        """
        if not tree:  # a plain forward: it takes `min_rows` as a step does
            return self.extend(seq)
        sees, depth = tree_attention(parents)
        if len(seq) + (int(depth.max()) if len(tree) else 0) > self.max_length:
            raise ValueError(f"{len(seq)} tokens and a tree draft exceed the model's context of {self.max_length}")
        reuse = min(common_prefix_length(self.tokens, seq), len(seq) - 1)
        self.crop(reuse)
        fresh = len(seq) - reuse
        allowed = torch.ones(fresh + len(tree), len(seq) + len(tree), dtype=torch.bool)  # (new rows, all columns)
        allowed[:fresh, reuse:] = allowed[:fresh, reuse:].tril()  # causal over the fresh tokens, blind to the tree
        allowed[fresh:, len(seq):] = sees
        positions = torch.cat([torch.arange(reuse, len(seq)), len(seq) - 1 + depth])
        return self.forward(seq[reuse:] + tree, 1 + len(tree), **self._masked(allowed, positions))

    def _masked(self, allowed: Tensor, positions: Tensor) -> dict[str, Tensor]:
        """The model's keyword arguments for rows that see the keys where `allowed` (new rows, all keys) is True,
        at `positions`."""
        dtype = self.model.dtype  # an additive float mask: eager attention adds it, SDPA takes it as is
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
        return {"attention_mask": mask[None, None].to(self.device), "position_ids": positions[None].to(self.device)}
