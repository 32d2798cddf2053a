"""Seeded draws: the uniform a seeded row uses at each step, a pure function of (seed, step).

Plain Python (no torch), so the engine process computes it for rows that a worker process samples.
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15


def seeded_uniform(seed: int, step: int) -> float:
    """The uniform in [0, 1) that a row with `seed` draws at `step`: element `step` of a splitmix64 stream.

    A pure function of (seed, step), so a seeded row's tokens never depend on the batch around it, on
    the device, or on the process. The seed is mixed first so that neighbouring seeds (request seed +
    choice index) start unrelated streams.
    """
    state = (_mix64(seed & _MASK64) + (step + 1) * _GOLDEN_GAMMA) & _MASK64
    return (_mix64(state) >> 11) * 2.0**-53  # top 53 bits: every double in [0, 1) on a 2^-53 grid


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers with full avalanche."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)
