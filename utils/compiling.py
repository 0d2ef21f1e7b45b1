"""How the project calls torch.compile: the sizes it takes as dynamic, the compile's settings, and a model's refusal.
`utils.runner.CachedModel` compiles its step and its whole forward with them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, cast

import torch


def every_size() -> contextlib.AbstractContextManager:
    """Every size taken as dynamic, 0 and 1 too, and none assumed equal to another: one graph then serves every
    number of rows (a row's bits do not depend on it) and every context."""
    from torch.fx.experimental import _config as shapes_config

    return cast(Any, shapes_config).patch(backed_size_oblivious=True, use_duck_shape=False)


def compile_config(workers: int | None, every_size_too: bool = False,
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


def compiled(model) -> Callable[..., Any]:
    """`model` under torch.compile, its sizes dynamic; ValueError where one of its layers says it cannot be."""
    blocker = next((m.compile_blocker for m in model.modules() if hasattr(m, "compile_blocker")), None)
    if blocker is not None:  # a layer that says why it cannot be compiled (models.formats.prepack)
        raise ValueError(blocker)
    return torch.compile(model, dynamic=True)
