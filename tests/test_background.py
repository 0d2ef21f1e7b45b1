"""app.background: a background thread held at its next Python call while a pause lasts."""

import os
import threading
import time

import pytest
import torch

from app.background import PausableThread, release_openmp_team


def until(condition, seconds: float = 10.0) -> None:
    """Poll `condition` until it holds; fail after `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.001)


def counting(stop: threading.Event, counts: list[int]):
    def step():
        counts[0] += 1

    def work():
        while not stop.is_set():
            step()
        return counts[0]
    return work


def test_work_makes_no_progress_while_paused_and_goes_on_after():
    stop, counts = threading.Event(), [0]
    thread = PausableThread(counting(stop, counts), "count").start()
    until(lambda: counts[0] >= 1000)
    with thread.paused():
        until(lambda: thread.waiting)  # the work reached its next call and waits there
        held = counts[0]
        time.sleep(0.2)  # room for progress, were the pause not holding
        assert counts[0] == held and thread.waiting
        with thread.paused():  # nested: still held after the inner block
            pass
        time.sleep(0.05)
        assert counts[0] == held and thread.waiting
    until(lambda: counts[0] > held)
    assert not thread.waiting
    stop.set()
    assert thread.join(5)
    assert thread.result == counts[0] and thread.error is None


def test_join_resumes_paused_work_and_an_error_is_kept():
    def failing():
        time.sleep(0.01)
        raise RuntimeError("no compiler")

    thread = PausableThread(failing, "fail").start()
    with thread.paused():
        assert thread.join(5)
    assert isinstance(thread.error, RuntimeError) and thread.result is None and not thread.running


@pytest.mark.skipif(not release_openmp_team(), reason="torch's OpenMP runtime is not libgomp 9 or later")
def test_held_work_keeps_no_openmp_team_and_keeps_its_thread_count():
    """A team kept by a waiting thread would make every other team stop spinning between its regions."""
    def tasks() -> int:
        return len(os.listdir("/proc/self/task"))

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        stop, counts, big = threading.Event(), [0], torch.ones(1 << 22)

        def work():
            while not stop.is_set():
                big.sum()  # a parallel region: the thread's own team of two
                counts[0] += 1
            return torch.get_num_threads()

        thread = PausableThread(work, "team").start()
        until(lambda: counts[0] >= 10)
        running = tasks()
        with thread.paused():
            until(lambda: thread.waiting)
            until(lambda: tasks() == running - 1)  # its team's other thread is gone
        held = counts[0]
        until(lambda: counts[0] > held)
        until(lambda: tasks() == running)  # the next region made a new one
        stop.set()
        assert thread.join(5) and thread.result == 2
    finally:
        torch.set_num_threads(before)
