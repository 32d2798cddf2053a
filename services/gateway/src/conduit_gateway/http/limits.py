"""The gateway's own bound on concurrent generations: full means 429 now, never a queue in the gateway."""

from __future__ import annotations


class ConcurrencyLimiter:
    """A non-blocking counting semaphore (the event loop is single-threaded, so no lock is needed)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0

    def try_acquire(self) -> bool:
        if self.active >= self.limit:
            return False
        self.active += 1
        return True

    def release(self) -> None:
        self.active -= 1
