"""The logprobs of one position, as outputs carry them. Plain Python: no torch."""

from __future__ import annotations

from typing import NamedTuple


class TokenLogprobs(NamedTuple):
    """Logprob information of one sampled (or prompt) position."""

    token_id: int
    logprob: float
    rank: int  # rank 1 = most likely
    top_ids: list[int]  # k alternatives, best first
    top_logprobs: list[float]
