"""The compiled graphs: which model compiles by default, and the one compile that falls back to eager.

The drafter's short forwards (`CachedModel.compile_step`) and the target's whole forward (`compile_whole`) compile in
the foreground (the benchmark, one prompt) or on a background thread (the chat), which a generation holds while it
decodes: beside a decode the compile would make it crawl. The drafter takes its graph once it is ready, the target at
the start of the next generation (`CachedModel.adopt_compiled`), so that a generation runs one target graph throughout.
A compile that fails leaves its model eager and says why.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from app.background import PausableThread
from app.startup import SILENT, Report, Said
from utils.runner import CachedModel

COMPILING = "compiling (background)"
WHAT = {"drafter": "the drafter's short forwards", "target": "the target's forward"}


def target_compiles_by_default(model) -> bool:
    """The target's whole forward compiles by default where its linears are the project's CPU kernels: the small
    operators between them and the Python around them are then a fifth of a step (docs/kernels.md)."""
    from models.formats.blocks import BlockLinear

    return any(isinstance(module, BlockLinear) for module in model.modules())


def drafter_compiles_by_default(model) -> bool:
    """The drafter's one-token step compiles by default on a CPU, where Python and dispatch are a large share of
    it, unless its weights are oneDNN-prepacked (torch.compile cannot lower them)."""
    from models.formats.prepack import is_prepacked

    return next(model.parameters()).device.type == "cpu" and not is_prepacked(model)


@dataclass(frozen=True)
class Compiled:
    """How one model's compile went: still running, ready after `seconds`, or failed (`error`, one line)."""

    seconds: float | None = None
    error: str | None = None

    @property
    def status(self) -> str:
        if self.error is not None:
            return f"not compiled ({self.error})"
        return COMPILING if self.seconds is None else f"compiled (ready after {self.seconds:.0f} s)"


class Compiles:
    """The compiles of one pair: each model's `Compiled` (None: not asked), and the thread of a background one."""

    def __init__(self) -> None:
        self.drafter: Compiled | None = None
        self.target: Compiled | None = None
        self._thread: PausableThread | None = None

    @property
    def running(self) -> bool:
        return COMPILING in (self.status("drafter"), self.status("target"))

    def status(self, name: str) -> str | None:
        compiled = getattr(self, name)
        return None if compiled is None else compiled.status

    def seconds(self, name: str) -> float | None:
        compiled = getattr(self, name)
        return None if compiled is None else compiled.seconds

    def start(self, jobs: list[tuple[str, CachedModel]], background: bool,
              report: Report = SILENT) -> PausableThread | None:
        """Compile each (name, model) of `jobs` in turn; on a background thread (returned), or now, each compile's
        status and failure told to `report`."""
        if not jobs:
            return None
        for name, lm in jobs:
            setattr(self, name, Compiled())
            if background and name == "target":
                lm.prepare_whole()
        quiet = background  # a background thread would write across the chat's input line
        workers = 1 if background else None  # one worker: a pause holds all of the compile

        def work() -> None:
            for name, lm in jobs:
                try:
                    with contextlib.nullcontext() if quiet else report.status(f"compiling {WHAT[name]} …"):
                        seconds = lm.compile_step(workers=workers) if name == "drafter" else \
                            lm.compile_whole(workers=workers)
                except Exception as error:  # noqa: BLE001 (any failure leaves the model eager; the reason is shown)
                    reason = next(iter(str(error).strip().splitlines()), "")
                    setattr(self, name, Compiled(error=f"{type(error).__name__}: {reason}"))
                    if not quiet:
                        report.say(f"{'the drafter' if name == 'drafter' else 'the target'} runs uncompiled: "
                                   f"{type(error).__name__}: {reason}", Said.PROBLEM)
                else:
                    setattr(self, name, Compiled(seconds))

        if not background:
            work()
            return None
        self._thread = PausableThread(work, "compile").start()
        return self._thread

    def paused(self) -> contextlib.AbstractContextManager:
        """Hold a background compile while the block runs (a generation: its timings then compare with later ones)."""
        return self._thread.paused() if self._thread is not None else contextlib.nullcontext()

    def wait(self) -> None:
        """Block until a background compile ends."""
        if self._thread is not None:
            self._thread.join()
