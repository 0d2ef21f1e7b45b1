"""utils.background: a background thread held at its next Python call while a pause lasts."""

import threading
import time

from utils.background import PausableThread


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
    while counts[0] < 1000:
        time.sleep(0.001)
    with thread.paused():
        time.sleep(0.05)  # the work reaches its next call and waits there
        held = counts[0]
        time.sleep(0.2)
        assert counts[0] == held
        with thread.paused():  # nested: still held after the inner block
            pass
        time.sleep(0.05)
        assert counts[0] == held
    deadline = time.monotonic() + 5
    while counts[0] == held and time.monotonic() < deadline:
        time.sleep(0.001)
    assert counts[0] > held
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
