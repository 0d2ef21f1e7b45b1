"""Work on a background thread that can be paused: the engine compiles its models while the chat waits for input,
and holds the compile while a turn decodes.

A compile beside a decode makes the decode crawl: the compile holds the CPU and, much of the time, the interpreter
lock. A Python thread cannot be suspended from outside, so the work pauses itself: a trace function (set for its
thread only, called on each Python function call, no line events) waits while the pause is on. C code the work is in
when the pause starts runs on until it returns to Python.

At a pause the work also lets its OpenMP team go. A thread that has run a parallel region keeps its team's threads,
idle, until it ends; while libgomp keeps more threads than the machine has cores, every team stops spinning between
regions, and a decode step of some two hundred short regions then waits on the kernel at each (docs/options.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class PausableThread(Generic[T]):
    """Runs `work()` on a daemon thread; `paused()` holds it at its next Python call for as long as it lasts."""

    def __init__(self, work: Callable[[], T], name: str):
        self._work = work
        self._go = threading.Event()
        self._go.set()
        self._waiting = threading.Event()  # set while the work waits at a pause
        self._pauses = 0
        self._lock = threading.Lock()
        self.result: T | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> PausableThread[T]:
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    @property
    def waiting(self) -> bool:
        """The work is held at a pause right now (not merely asked to be)."""
        return self._waiting.is_set()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the work to end, resuming it if paused; True once it has."""
        with self._lock:
            self._pauses = 0
            self._go.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Hold the work while the block runs (nested blocks: until the outermost ends)."""
        with self._lock:
            self._pauses += 1
            self._go.clear()
        try:
            yield
        finally:
            with self._lock:
                self._pauses = max(self._pauses - 1, 0)
                if self._pauses == 0:
                    self._go.set()

    def _trace(self, frame, event, arg):
        if not self._go.is_set():
            release_openmp_team()
            self._waiting.set()
            self._go.wait()
            self._waiting.clear()
        return None  # no tracing inside the frame: only calls are seen

    def _run(self) -> None:
        sys.settrace(self._trace)
        try:
            self.result = self._work()
        except BaseException as error:  # noqa: BLE001 (reported through `error`; the thread ends either way)
            self.error = error
        finally:
            sys.settrace(None)


@functools.cache
def _openmp() -> ctypes.CDLL | None:
    try:
        runtime = ctypes.CDLL("libgomp.so.1")  # the copy torch loaded: a loaded library is found by its name
    except OSError:
        return None
    return runtime if hasattr(runtime, "omp_pause_resource_all") else None  # OpenMP 5.0: GCC 9 on


def release_openmp_team() -> bool:
    """Let the calling thread's idle OpenMP team go (its next parallel region makes a new one), keeping its thread
    count; whether the runtime did. Outside a parallel region only."""
    runtime = _openmp()
    if runtime is None:
        return False
    threads = runtime.omp_get_max_threads()
    released = runtime.omp_pause_resource_all(1) == 0  # omp_pause_soft; it also drops the thread's own settings
    runtime.omp_set_num_threads(threads)
    return released
