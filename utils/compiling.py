"""torch.compile for a `CachedModel`: the drafter's short forwards (`compile_step`) and the target's whole forward
(`compile_whole`), each built on a scratch cache of its own, so that it may run on another thread while the model
decodes."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from utils.caching import CachedModel


def compile_step(lm: CachedModel, workers: int | None = None) -> float:
    """Compile `lm.model` for short forwards (the context length and the rows dynamic) and hand them to it.

    A one-token forward of a small model on a CPU spends a large share of its time in Python and operator dispatch
    between the matrix products (docs/formats.md); the compiled graph fuses the small operators. Compiling takes tens
    of seconds, and `step_model` is set only once the graphs it needs (one token and several, after a forward and
    after a crop) are built. Errors (no C++ compiler, an unsupported model) propagate and leave the model as it was.
    Returns the seconds it took. `workers`: inductor's parallel compile processes (None: its default).
    """
    from utils.caching import CachedModel

    started = time.perf_counter()
    step = _compiled(lm)
    scratch = CachedModel(lm.model)
    scratch.step_model = step
    with torch.inference_mode(), _compile_config(workers, serial=True):
        scratch.forward([0, 0, 0])
        scratch.forward([0])
        scratch.forward([0])
        scratch.crop(3)
        scratch.forward([0])
        scratch.forward([0, 0])  # torch specializes one row: several take a graph of their own
    lm.step_model = step
    return time.perf_counter() - started


def compile_whole(lm: CachedModel, workers: int | None = None) -> tuple[Callable[..., Any], float]:
    """`lm.model` compiled for every forward, whatever its rows (one graph for all: torch would give one row a graph of
    its own, which rounds otherwise), tree-shaped ones too, and the seconds it took.

    A target whose linears are the project's kernels spends a fifth of a step in the model's small operators and the
    Python between them; the graph fuses them. A verify's rows must still round as the one-token steps do: the graph
    is checked for that on a scratch cache (steps, a verify and a tree of the same tokens, and a prompt ending in the
    first, bit for bit) and refused (ValueError) where they differ. Errors leave the model as it was.
    """
    from utils.caching import CachedModel

    if lm.prefill_model is not None:
        raise ValueError("a model with a prefill form of its own is not compiled whole")
    started = time.perf_counter()
    graph = _compiled(lm)
    scratch = CachedModel(lm.model)
    scratch.min_rows = lm.min_rows
    scratch.whole_model = graph
    probe = [(i * 7919 + 11) % lm.vocab_size for i in range(16)]
    with torch.inference_mode(), _compile_config(workers, every_size_too=True):
        scratch.forward(probe[:10])
        steps = torch.cat([scratch.forward([token]) for token in probe[10:14]])
        scratch.crop(10)
        verify = scratch.forward(probe[10:14], keep=4)
        scratch.crop(9)
        tree = scratch.extend_tree(probe[:10], probe[10:14] + probe[14:16], [-1, 0, 1, 2, 0, 4])[1:5]
        scratch.reset()
        again = scratch.forward(probe[:11])
    if not (torch.equal(steps, verify) and torch.equal(steps, tree) and torch.equal(again, steps[:1])):
        raise ValueError("its compiled forward rounds a verify's rows otherwise than its one-token steps")
    return graph, time.perf_counter() - started


def every_size() -> contextlib.AbstractContextManager:
    """Every size taken as dynamic, 0 and 1 too, and none assumed equal to another: one graph then serves every
    number of rows (a row's bits do not depend on it) and every context."""
    from torch.fx.experimental import _config as shapes_config

    return cast(Any, shapes_config).patch(backed_size_oblivious=True, use_duck_shape=False)


def _compile_config(workers: int | None, every_size_too: bool = False,
                    serial: bool = False) -> contextlib.AbstractContextManager:
    """Inductor's parallel compile processes (None: its default), `every_size` where asked, and guards that skip a
    module's whole subtree while the tags of its objects' dicts show it unchanged (dynamo's recursive dict tags, off
    by default and past 256 objects; a model has thousands): half the guards' time a step (docs/kernels.md).
    `serial`: the graph's own fused operators on one thread (the matmuls keep torch's threads): a short forward's are
    too small to pay for starting a second (a drafter step 3-17% faster, docs/kernels.md)."""
    from torch._dynamo import config as dynamo_config
    from torch._inductor import config as inductor_config  # loads with torch.compile: not before it is needed

    stack = contextlib.ExitStack()
    stack.enter_context(dynamo_config.patch(use_recursive_dict_tags_for_guards=True,
                                            max_saved_pointers_for_recursive_dict_tags_check=1 << 20))
    if every_size_too:
        stack.enter_context(every_size())
    if workers:
        stack.enter_context(inductor_config.patch(compile_threads=workers))
    if serial:
        stack.enter_context(inductor_config.patch({"cpp.threads": 1}))
    return stack


def _compiled(lm: CachedModel) -> Callable[..., Any]:
    blocker = next((m.compile_blocker for m in lm.model.modules() if hasattr(m, "compile_blocker")), None)
    if blocker is not None:  # a layer that says why it cannot be compiled (models.formats.prepack)
        raise ValueError(blocker)
    return torch.compile(lm.model, dynamic=True)
