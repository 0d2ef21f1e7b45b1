"""One generation at a time on the one model pair: a bounded queue of jobs and the thread that runs them in order.

The engine is not thread-safe, and the pair's caches are one: the worker thread is the only caller of the engine
while the server runs. The HTTP side submits a `Job` and awaits its events on its own event loop; the worker hands
them over with `call_soon_threadsafe`. A job whose client went away is cancelled: the worker skips it if it has not
started, or stops it between two pieces (closing the engine's stream, which leaves the caches consistent for the
next request) if it has.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

STOP_SECONDS = 30.0  # how long stopping waits for the generation under way to see its cancellation


class Engine(Protocol):
    """What the server uses of `app.Engine`."""

    strategies: Any

    def stream(self, prompt, strategy: str = "auto", **settings) -> Any: ...


@dataclass(frozen=True)
class Piece:
    text: str


@dataclass(frozen=True)
class Finished:
    reply: Any  # the engine's Reply: text, token_ids, stats, finish_reason


@dataclass(frozen=True)
class Failed:
    error: Exception


@dataclass(frozen=True)
class Cancelled:
    """The job was cancelled (its client went away): whoever awaits its events stops waiting."""


Event = Piece | Finished | Failed | Cancelled


@dataclass
class Job:
    """One request's generation: what to run, and where its events go."""

    prompt: str | list[dict[str, str]]
    strategy: str
    settings: dict[str, Any]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Safe from any thread, and more than once."""
        if not self.cancelled.is_set():
            self.cancelled.set()
            self.emit(Cancelled())

    def emit(self, event: Event) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server stopped, nobody is listening
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class QueueFull(Exception):
    """The queue holds as many waiting jobs as it may."""


class Worker:
    """The generation thread and its bounded queue of waiting jobs (the one running is not counted, nor those
    cancelled while they waited: they give their place up at once)."""

    def __init__(self, engine: Engine, capacity: int):
        if capacity < 1:
            raise ValueError(f"the queue must hold at least one request, got {capacity}")
        self.engine = engine
        self.capacity = capacity
        self._changed = threading.Condition()
        self._jobs: deque[Job] = deque()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._current: Job | None = None

    @property
    def waiting(self) -> int:
        with self._changed:
            return sum(not job.cancelled.is_set() for job in self._jobs)

    @property
    def busy(self) -> bool:
        return self._current is not None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="generation", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue `job` behind the others; QueueFull if as many wait already as the queue holds."""
        with self._changed:
            self._jobs = deque(waiting for waiting in self._jobs if not waiting.cancelled.is_set())
            if len(self._jobs) >= self.capacity:
                raise QueueFull
            self._jobs.append(job)
            self._changed.notify()

    def stop(self) -> None:
        """Cancel the waiting jobs and the one running, and end the thread once it has stopped."""
        with self._changed:
            self._stopping = True
            for job in self._jobs:
                job.cancel()
            self._jobs.clear()
            if self._current is not None:
                self._current.cancel()
            self._changed.notify()
        if self._thread is not None:
            self._thread.join(STOP_SECONDS)

    def _next(self) -> Job | None:
        """The oldest job not cancelled, once there is one; None once stopping."""
        with self._changed:
            while not self._stopping:
                while self._jobs:
                    job = self._jobs.popleft()
                    if not job.cancelled.is_set():
                        self._current = job
                        return job
                self._changed.wait()
            return None

    def _run(self) -> None:
        while (job := self._next()) is not None:
            try:
                generate(self.engine, job)
            finally:
                self._current = None


def generate(engine: Engine, job: Job) -> None:
    """Run `job` on `engine`, emitting its pieces and then how it ended; stops early once it is cancelled. The end is
    told once the stream is closed: whoever hears it may use the engine next."""
    try:
        stream = engine.stream(job.prompt, strategy=job.strategy, **job.settings)
        with contextlib.closing(stream):  # closing stops a generation cut short and leaves the caches consistent
            for text in stream:
                if job.cancelled.is_set():
                    return
                if text:
                    job.emit(Piece(text))
    except Exception as error:  # noqa: BLE001 (any failure is this request's answer; the server goes on)
        job.emit(Failed(error))
    else:
        job.emit(Finished(stream.reply))
