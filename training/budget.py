"""The run's time budget: what `--time-budget` bounds."""

from __future__ import annotations

import time


class Budget:
    def __init__(self, minutes: float):
        self.start, self.seconds = time.monotonic(), minutes * 60

    def used(self) -> float:
        return time.monotonic() - self.start

    def left(self, share: float = 1.0) -> float:
        return self.seconds * share - self.used()
