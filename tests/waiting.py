"""Waiting in tests: poll a condition until a deadline, never sleep a fixed time and hope it was long enough.

A deadline is a bound on a hang (the test fails, naming what it waited for), not a speed target: it is set far
above the time the condition takes on a slow machine."""

from __future__ import annotations

import time
from collections.abc import Callable

from moe.host import process_alive as alive  # a zombie, exited but not reaped, counts as gone


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str, every_s: float = 0.02) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(every_s)


def wait_gone(pids: list[int], timeout_s: float = 30) -> None:
    wait_until(lambda: not any(alive(p) for p in pids), timeout_s,
               f"processes {[p for p in pids if alive(p)]} still running")
