"""The KV cache: its storage (`GrowingLayer`, crops, moved rows) and the invariant every strategy keeps.

THE INVARIANT. A `CachedTokens`' `tokens` are exactly the tokens whose keys and values its cache holds, at positions
0..len(tokens)-1. A strategy keeps, after every round: the target's cache holds every committed token but the last;
the last committed token is the next input. A model is only ever fed the tokens its cache has not seen
(`utils.runner.CachedModel` feeds them).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin, DynamicLayer


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


def holds_buffers(cache: DynamicCache) -> bool:
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


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


class CachedTokens:
    """A DynamicCache and the list of tokens it holds (batch of one), kept to THE INVARIANT; `with_hidden`: also
    the last hidden state of every cached token, row for row with `tokens`, through crops and moved rows alike."""

    def __init__(self, config, with_hidden: bool = False):
        self.config = config
        self.cache = new_cache(config)
        self.tokens: list[int] = []
        self.with_hidden = with_hidden
        self._hidden: Tensor | None = None  # (capacity, H) float32; rows beyond len(tokens) are stale

    def hidden(self) -> Tensor | None:
        """(len(tokens), H) the last hidden state of every cached token; None before any was recorded."""
        return None if self._hidden is None else self._hidden[: len(self.tokens)]

    def crop(self, length: int) -> None:
        crop(self.cache, length)
        del self.tokens[length:]

    def append(self, ids: list[int], hidden: Tensor | None = None) -> None:
        """`ids` now held by the cache after the tokens before them; `hidden` (len(ids), H) their hidden states."""
        if hidden is not None:
            self._store_hidden(len(self.tokens), hidden)
        self.tokens.extend(ids)

    def drop(self) -> None:
        """A new, empty cache: for a forward cut short, after which some layers may hold its tokens and others not."""
        self.cache, self.tokens = new_cache(self.config), []

    def _store_hidden(self, start: int, rows: Tensor) -> None:
        end = start + len(rows)
        if self._hidden is None or self._hidden.shape[0] < end:
            dtype = torch.float64 if rows.dtype == torch.float64 else torch.float32
            grown = torch.empty(max(2 * end, 256), rows.shape[-1], device=rows.device, dtype=dtype)
            if self._hidden is not None:
                grown[:start] = self._hidden[:start]
            self._hidden = grown
        self._hidden[start:end] = rows.float()

    def cast(self, dtype: torch.dtype) -> None:
        """The cached keys and values in `dtype`: two forms of a model in other dtypes may share this cache."""
        for layer in self.cache.layers:  # no public Cache API casts; the same per-layer keys and values as below
            if (isinstance(layer, CacheLayerMixin) and layer.keys is not None and layer.values is not None
                    and layer.keys.dtype != dtype):
                layer.keys, layer.values = layer.keys.to(dtype), layer.values.to(dtype)

    def crop_to_path(self, length: int, rows: list[int]) -> None:
        """Roll back to the first `length` cached tokens, then the cached rows `rows` (ascending, >= length) moved up
        behind them: after a tree forward, the accepted path. Rows length, length + 1, ... make this a plain `crop`.

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
            if self.with_hidden and self._hidden is not None:
                self._hidden[dst] = self._hidden[src.to(self._hidden.device)]
        self.crop(length + len(rows))
