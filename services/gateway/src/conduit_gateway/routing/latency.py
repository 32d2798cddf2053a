"""Recent seconds per generated token of one engine: an exponentially weighted moving average."""

from __future__ import annotations

# Weight of the newest stream: about the last ten streams shape the estimate.
ALPHA = 0.2


class TokenLatency:
    """Fed (decode seconds, tokens) per finished stream; `value` is None until the first sample."""

    def __init__(self) -> None:
        self.value: float | None = None

    def record(self, seconds: float, tokens: int) -> None:
        if tokens <= 0 or seconds < 0:
            return
        sample = seconds / tokens
        self.value = sample if self.value is None else ALPHA * sample + (1 - ALPHA) * self.value
