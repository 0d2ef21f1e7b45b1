"""Seconds of a `CachedModel`'s forwards after a context, for the calibration and the benchmarks alike."""

from __future__ import annotations

import statistics
import time

import torch

from utils.runner import CachedModel


def time_forward(lm: CachedModel, context: list[int], new: list[int], repeats: int) -> float:
    """Median seconds of one forward over `new` after `context` is cached; the cache is rolled back each time."""
    return statistics.median(time_forwards(lm, context, [new], repeats)[0])


def time_forwards(lm: CachedModel, context: list[int], news: list[list[int]], repeats: int) -> list[list[float]]:
    """Seconds of each forward over one of `news` after `context` is cached, `repeats` times each, the forwards taken
    in turn (a slow spell of the machine falls on all of them alike); the cache is rolled back after each."""
    lm.reset()
    samples: list[list[float]] = [[] for _ in news]
    with torch.inference_mode():
        lm.forward(context)
        for new in news:  # one untimed pass: first-call allocations
            lm.forward(new)
            lm.crop(len(context))
        for _ in range(repeats):
            for new, times in zip(news, samples, strict=True):
                start = time.perf_counter()
                lm.forward(new)
                times.append(time.perf_counter() - start)
                lm.crop(len(context))
    lm.reset()
    return samples
