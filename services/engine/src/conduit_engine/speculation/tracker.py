"""Per-sequence acceptance: a moving acceptance rate, and the back-off that stops a sequence speculating
while its proposals are mostly rejected (each verified proposal costs query tokens for nothing).

Plain Python. The rate is an exponential moving average of accepted / proposed over the sequence's recent
proposals; under `min_acceptance_rate` the sequence stops proposing for a number of steps that doubles
each time it happens again (16, 32, … up to 1024), then tries once more from a neutral rate.
"""

from __future__ import annotations

from dataclasses import dataclass

_FIRST_BACKOFF = 16
_MAX_BACKOFF = 1024


@dataclass(slots=True)
class AcceptanceTracker:
    min_rate: float
    window: int
    rate: float | None = None  # moving acceptance rate; None before the first verified proposal
    proposals: int = 0  # verified proposals since the rate was last reset
    paused_steps: int = 0  # steps left without speculation
    backoff: int = _FIRST_BACKOFF

    def may_propose(self) -> bool:
        """Whether to propose this step (counts down a pause)."""
        if self.paused_steps > 0:
            self.paused_steps -= 1
            return False
        return True

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        value = num_accepted / num_drafts
        alpha = 2.0 / (self.window + 1)
        self.rate = value if self.rate is None else self.rate + alpha * (value - self.rate)
        self.proposals += 1
        if self.min_rate > 0 and self.proposals >= 2 and self.rate < self.min_rate:
            self.paused_steps = self.backoff
            self.backoff = min(2 * self.backoff, _MAX_BACKOFF)
            self.rate, self.proposals = None, 0

    @property
    def speculating(self) -> bool:
        return self.paused_steps == 0
