"""KV-cache helpers on transformers Cache objects, and the invariant every strategy keeps.

THE INVARIANT. A `CachedModel`'s `tokens` are exactly the tokens whose keys and values its cache holds, at positions
0..len(tokens)-1. A strategy keeps, after every round: the target's cache holds every committed token but the last;
the last committed token is the next input. A model is only ever fed the tokens its cache has not seen.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin, DynamicLayer

from utils.compiling import every_size

LAST_HIDDEN = -1  # `output_hidden_states` selecting the last one only (transformers takes an index)


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are views of a longer buffer, grown by half again when full: a forward
    writes its rows in place where `torch.cat` would copy the whole cache every step (a fifth of a 1.5B model's step
    on a CPU at a 2,048-token context, docs/kernels.md). Crops stay views; rows past them are overwritten by the next
    update. Keys or values set from outside (another dtype, reordered rows) are copied into a fresh buffer by the next
    update. A compiled step traces only the writes and the views: `reserve` makes room before it, and the count of rows
    held is the size of an empty tensor (rows, 0: its strides are the same for any count), which the graph takes as
    dynamic where an int attribute would be a constant.
    `grows` False: it concatenates as `DynamicLayer` does (the cache before this layer, for `benchmarks.context`)."""

    grows = True

    def __init__(self) -> None:
        self._buffers: list[Tensor | None] = [None, None]  # keys, values: (..., capacity, head_dim)
        self._plain: list[Tensor | None] = [None, None]  # set from outside, or concatenated (not growing)
        self._held = [torch.empty(0, 0), torch.empty(0, 0)]  # (rows held, 0) for each buffer
        self.ready = False  # room made for a compiled forward (`ready_for_step`), until it returns
        super().__init__()

    def _get(self, i: int) -> Tensor | None:
        buffer = self._buffers[i]
        return self._plain[i] if buffer is None else buffer[..., : self._held[i].shape[0], :]

    def _set(self, i: int, value: Tensor | None) -> None:
        buffer = self._buffers[i]
        if buffer is not None and value is not None and _starts(value, buffer):  # a crop of this buffer's rows
            self._held[i] = self._held[i].new_empty(value.shape[-2], 0)
        else:
            self._buffers[i], self._plain[i] = None, value

    keys = property(lambda self: self._get(0), lambda self, value: self._set(0, value))
    values = property(lambda self: self._get(1), lambda self, value: self._set(1, value))

    def reserve(self, end: int, like: Tensor) -> None:
        """Buffers that take `end` rows like `like` (its dtype and other dimensions; writable in this mode), with the
        rows held now at their start."""
        if all(buffer is not None and _takes(buffer, like, end) for buffer in self._buffers):
            return
        keys = self._get(0)
        held = 0 if keys is None or keys.dim() != 4 else keys.shape[-2]
        for i in range(2):
            buffer, current = self._buffers[i], self._get(i)
            if buffer is not None and _takes(buffer, like, end):
                continue
            grown = like.new_empty(*like.shape[:-2], end + max(end // 2, 256), like.shape[-1])
            if current is not None and current.dim() == 4:
                grown[..., :held, :] = current
            self._buffers[i], self._plain[i] = grown, None
        marker = like.new_empty(held, 0)
        self._held = [marker, marker]

    def ready_for_step(self, end: int) -> None:
        """Room for `end` rows like those held, and the row counts made in inference mode: what a compiled step's
        graph was compiled for."""
        self.reserve(end, cast(Tensor, self.keys))
        self._held = [_in_inference_mode(marker) for marker in self._held]
        self.ready = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.grows:
            return super().update(key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        # Not torch.compiler.is_compiling(): another thread's compile, held at a pause mid-trace, makes it True here
        if not self.ready:  # a compiled forward's room was made before it (`reserve`)
            self.reserve(self.get_seq_length() + key_states.shape[-2], key_states)
        held = self._held[0].shape[0]
        end = held + key_states.shape[-2]
        for buffer, new in zip(self._buffers, (key_states, value_states), strict=True):
            if self.ready:  # one graph for any rows: a slice's copy would guard on their count
                cast(Tensor, buffer).index_copy_(-2, torch.arange(held, end, device=new.device), new)
            else:
                cast(Tensor, buffer)[..., held:end, :] = new
        marker = self._held[0].new_empty(end, 0)
        self._held = [marker, marker]
        return cast(Tensor, self.keys), cast(Tensor, self.values)


def _in_inference_mode(marker: Tensor) -> Tensor:
    """`marker` (an empty tensor whose size is a layer's count of rows) made in inference mode if it was not: a
    compiled step, which runs in that mode, then always finds the same kind of tensor there."""
    if marker.is_inference():
        return marker
    with torch.inference_mode():
        return torch.empty(marker.shape[0], 0, device=marker.device)


def _starts(view: Tensor, buffer: Tensor) -> bool:
    """Whether `view` is the first rows of `buffer`."""
    return (view.data_ptr() == buffer.data_ptr() and view.dtype == buffer.dtype and view.shape[:-2] == buffer.shape[:-2]
            and view.shape[-1] == buffer.shape[-1] and view.shape[-2] <= buffer.shape[-2]
            and view.stride() == buffer.stride())


def _takes(buffer: Tensor, like: Tensor, end: int) -> bool:
    """Whether `buffer` takes `end` rows of tensors like `like` (their shape and dtype; writable in this mode), and one
    more: a graph traced with room to spare guards on it, and a buffer filled exactly would compile it again."""
    if buffer.is_inference() and not torch.is_inference_mode_enabled():  # no in-place writes to it out of that mode
        return False
    return (buffer.shape[-2] > end and buffer.dtype == like.dtype and buffer.shape[:-2] == like.shape[:-2]
            and buffer.shape[-1] == like.shape[-1])


def reserve(cache: DynamicCache, end: int) -> None:
    """Room in each `GrowingLayer` of `cache` for `end` rows in all, like those it holds (before a compiled step)."""
    for layer in cache.layers:
        if isinstance(layer, GrowingLayer) and layer.grows and layer.keys is not None and layer.keys.dim() == 4:
            layer.ready_for_step(end)


def done_with_step(cache: DynamicCache) -> None:
    """After a compiled forward: its layers' next updates make their own room again."""
    for layer in cache.layers:
        if isinstance(layer, GrowingLayer):
            layer.ready = False


def _holds_buffers(cache: DynamicCache) -> bool:
    """Whether every growing layer of `cache` has its buffers (a compiled graph writes into them)."""
    growing = [layer for layer in cache.layers if isinstance(layer, GrowingLayer) and layer.grows]
    return all(layer._buffers[0] is not None for layer in growing)


def new_cache(config) -> DynamicCache:
    """A DynamicCache for `config` whose full-attention layers are `GrowingLayer`s."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def stop_growing(cache: DynamicCache) -> None:
    """The `GrowingLayer`s of `cache` concatenate from now on, their rows moved out of the buffers."""
    for layer in cache.layers:
        if isinstance(layer, GrowingLayer) and layer.grows:
            keys, values = layer.keys, layer.values
            layer.grows = False
            layer._buffers, layer._plain = [None, None], [None, None]
            if keys is not None and values is not None:
                layer.keys, layer.values = keys.contiguous(), values.contiguous()


def crop(cache: DynamicCache, length: int) -> None:
    """Roll `cache` back to an absolute `length` tokens; cropping to the current length is a no-op."""
    surplus = cache.get_seq_length() - length
    if surplus < 0:
        raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} tokens to {length}")
    if surplus:
        cache.crop(-surplus)


def select_rows(cache: DynamicCache, rows: Tensor) -> None:
    """Keep/reorder batch rows (beams) in place: row i becomes old row rows[i]."""
    cache.reorder_cache(cast(torch.LongTensor, rows))  # transformers annotates the legacy tensor type


def tree_attention(parents: list[int]) -> tuple[Tensor, Tensor]:
    """A token tree's attention and positions: node i follows node `parents[i]` (< i), or the root for -1.

    Returns `sees` (T, T) bool, True where node j is node i or one of its ancestors, and each node's depth (T,),
    1 for the root's children.
    """
    sees = torch.eye(len(parents), dtype=torch.bool)
    depth = [0] * len(parents)
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"tree node {i} has parent {parent}: parents must come first (-1: the root)")
        if parent >= 0:
            sees[i] |= sees[parent]
        depth[i] = depth[parent] + 1 if parent >= 0 else 1
    return sees, torch.tensor(depth, dtype=torch.long)


def input_device(model) -> torch.device:
    """Where a model's input ids go: its first weight's device; the CPU for a weight accelerate offloaded to disk
    (a meta tensor), whose hooks move each layer's inputs to where it runs and the outputs back to the inputs'."""
    device = next(model.parameters()).device
    return torch.device("cpu") if device.type == "meta" else device


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


class CachedModel:
    """A causal LM with its own DynamicCache and the list of tokens that cache holds (batch of one).

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
        self.cache = new_cache(model.config)
        self.tokens: list[int] = []
        self.forwards = 0
        self.min_rows = 1
        self.device = input_device(model)
        self.keeps_hidden = False
        self._hidden: Tensor | None = None  # (capacity, H) float32; rows beyond len(tokens) are stale

    def keep_hidden(self) -> None:
        """Record hidden states from the next forward on (the cached tokens before it have none: they are dropped)."""
        if not self.keeps_hidden:
            self.keeps_hidden = True
            self.reset()

    @property
    def hidden(self) -> Tensor:
        """(len(tokens), H) the last hidden state of every cached token (`keep_hidden`)."""
        if not self.keeps_hidden:
            raise ValueError("this model does not keep its hidden states: call keep_hidden() first")
        if self._hidden is None:
            width = self.model.get_input_embeddings().embedding_dim
            return torch.empty(0, width, device=self.device)
        return self._hidden[: len(self.tokens)]

    @property
    def max_length(self) -> int:
        return getattr(self.model.config, "max_position_embeddings", None) or 1 << 31

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().out_features

    def reset(self) -> None:
        self.crop(0)

    def crop(self, length: int) -> None:
        crop(self.cache, length)
        del self.tokens[length:]

    def forward(self, ids: list[int], keep: int = 1, **model_kwargs) -> Tensor:
        """Feed `ids` after the cached tokens; logits of the last `keep` positions, (keep, V), float32 or wider.

        `model_kwargs` (a 4D `attention_mask`, `position_ids`) are for tree-shaped input (`extend_tree`); the cache
        must then be brought back to committed tokens (`keep`).
        """
        start = len(self.tokens)
        spare = 0 if model_kwargs else max(self.min_rows - len(ids), 0)  # a tree's rows come with their own mask
        whole = self.whole_model is not None
        if whole and not _holds_buffers(self.cache):  # a new cache: the graph writes into buffers made beforehand
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
            if self.prefill_model is not None:  # two dtypes may share this cache
                self._cache_in((self.prefill_model if prefill else self.model).dtype)
            with (torch.inference_mode() if step else contextlib.nullcontext(),  # the graph was compiled for it
                  every_size() if whole else contextlib.nullcontext()):  # as it was compiled, should it recompile
                out = model(input_ids=input_ids, past_key_values=self.cache, use_cache=True,
                            logits_to_keep=keep + spare, **model_kwargs)
            if step:
                done_with_step(self.cache)
            if spare:
                crop(self.cache, start + len(ids))
        except BaseException:  # e.g. Ctrl-C: some layers may hold the new tokens and others not
            self.cache, self.tokens = new_cache(self.model.config), []
            raise
        if self.keeps_hidden:
            self._store_hidden(start, out.hidden_states[-1][0, : len(ids)])
        self.tokens.extend(ids)
        self.forwards += 1
        logits = out.logits[0, -keep - spare:][:keep]
        return logits if logits.dtype == torch.float64 else logits.float()

    def _store_hidden(self, start: int, rows: Tensor) -> None:
        end = start + len(rows)
        if self._hidden is None or self._hidden.shape[0] < end:
            dtype = torch.float64 if rows.dtype == torch.float64 else torch.float32
            grown = torch.empty(max(2 * end, 256), rows.shape[-1], device=rows.device, dtype=dtype)
            if self._hidden is not None:
                grown[:start] = self._hidden[:start]
            self._hidden = grown
        self._hidden[start:end] = rows.float()

    def _cache_in(self, dtype: torch.dtype) -> None:
        """The cached keys and values in `dtype`: a prefill model may compute in another dtype than the decoding one
        (float32 prefill, int4 weights with bfloat16 activations for the steps on a CPU without native bf16)."""
        for layer in self.cache.layers:  # no public Cache API casts; the same per-layer keys and values as `keep`
            if (isinstance(layer, CacheLayerMixin) and layer.keys is not None and layer.values is not None
                    and layer.keys.dtype != dtype):
                layer.keys, layer.values = layer.keys.to(dtype), layer.values.to(dtype)

    def compile_step(self, workers: int | None = None) -> float:
        """`model` compiled for short forwards, taken at once (`utils.compiling.compile_step`); the seconds it took."""
        from utils.compiling import compile_step

        return compile_step(self, workers)

    def compile_whole(self, workers: int | None = None) -> float:
        """`model` compiled for every forward and checked, ready for `adopt_compiled` (`utils.compiling
        .compile_whole`); the seconds it took. ValueError where it cannot serve."""
        from utils.compiling import compile_whole

        self._compiled_whole, seconds = compile_whole(self, workers)
        return seconds

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

    def extend_tree(self, seq: list[int], tree: list[int], parents: list[int]) -> Tensor:
        """`extend(seq)`, then a token tree after its last token in the same forward; (1 + len(tree), V) logits.

        Row 0 is the last token of `seq`, row 1 + i tree node `tree[i]`, which sees `seq` and its own ancestors
        (`tree_attention(parents)`) at position len(seq) - 1 + depth. The cache then holds the tree's rows after `seq`:
        `keep` the accepted ones.
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

    def keep(self, length: int, rows: list[int]) -> None:
        """Keep the first `length` cached tokens, then the cached rows `rows` (ascending, >= length) moved up behind
        them: after a tree forward, the accepted path. Rows length, length + 1, ... make this a plain `crop`.

        Exact: a tree node's keys and values depend only on its ancestors, and its position (by depth) is the one the
        path gives it in the sequence.
        """
        moved = next((i for i, r in enumerate(rows) if r != length + i), len(rows))
        if moved < len(rows):
            src = torch.tensor(rows[moved:])
            dst = slice(length + moved, length + len(rows))
            for layer in self.cache.layers:  # no public Cache API moves positions; full-attention layers only
                if (not isinstance(layer, CacheLayerMixin) or getattr(layer, "is_sliding", False)
                        or layer.keys is None or layer.values is None):
                    raise NotImplementedError("moving cached rows needs full-attention cache layers")
                at = src.to(layer.keys.device)  # each layer's cache stays on its layer's device (a split model)
                layer.keys[..., dst, :] = layer.keys[..., at, :]
                layer.values[..., dst, :] = layer.values[..., at, :]
            self.tokens[dst] = [self.tokens[r] for r in rows[moved:]]
            if self.keeps_hidden and self._hidden is not None:
                self._hidden[dst] = self._hidden[src.to(self._hidden.device)]
        self.crop(length + len(rows))
