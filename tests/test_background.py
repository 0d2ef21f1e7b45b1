"""chat.background: a background thread held at its next Python call while a pause lasts."""

import threading
import time

from chat.background import PausableThread


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
