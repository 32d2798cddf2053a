"""Polling helper for tests that wait for something to happen elsewhere (never a timing assertion)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(predicate: Callable[[], bool], what: str, attempts: int = 400, delay_s: float = 0.025) -> None:
    """Poll until `predicate()` holds; the bound only stops a hung test, it is not a latency check."""
    for _ in range(attempts):
        if predicate():
            return
        time.sleep(delay_s)
    raise AssertionError(f"timed out waiting for {what}")
