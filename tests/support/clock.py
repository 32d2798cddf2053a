"""A clock tests set by hand, injected where code reads the time, so leases end exactly when a test says."""

from __future__ import annotations


class ManualClock:
    """Unix seconds, moved only by assigning `now`."""

    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
