"""Per-key limits: requests per minute and tokens per minute, each a token bucket, reported with the
headers OpenAI sends (x-ratelimit-limit-*, -remaining-*, -reset-*) and 429 + Retry-After when spent, and
the key's requests in progress (max_concurrent_requests).

Each bucket holds up to its per-minute limit and refills continuously at limit / 60 per second.

- Every request of a key takes one request when it arrives, whatever becomes of it (a request refused
  by validation or by the engine counts too).
- Before a generation runs, its worst case in tokens is reserved: 429 when the key has not that much
  left, and a 429 that says the request is too large when the worst case is above the key's limit. The
  reservation grows by each prompt's tokens when the engine has counted them; when the request ends, it
  is settled to what the request used and the rest is given back (`TokenReservation.settle`).

The clock is injected (seconds, monotonic), so tests drive the buckets exactly. Where the buckets live is
a `LimitStates`: this process's memory (`LocalLimitStates`, one gateway process), or a file every worker
of `--workers N` maps (`keys/shared_limits.py`), so that a key's limits hold for the pod, not per worker.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from conduit_gateway.errors import OpenAIError
from conduit_gateway.keys.keys_file import ApiKey, KeyLimits

Clock = Callable[[], float]


def go_duration(seconds: float) -> str:
    """A wait as OpenAI's reset headers spell it (Go's Duration format, whole milliseconds rounded up):
    0s, 17ms, 1s, 8.64s, 6m0s, 1h0m0s."""
    ms = max(0, math.ceil(round(seconds * 1000, 6)))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    whole, fraction = divmod(rest, 1000)
    text = f"{whole}.{fraction:03d}".rstrip("0") + "s" if fraction else f"{whole}s"
    if hours or minutes:
        text = f"{minutes}m{text}"
    return f"{hours}h{text}" if hours else text


class TokenBucket:
    """`capacity` units, refilled at capacity / 60 per second; the level may go below zero (debt)."""

    def __init__(self, capacity: int, now: float) -> None:
        self.capacity = capacity
        self.level = float(capacity)
        self.updated = now

    @property
    def rate(self) -> float:
        return self.capacity / 60.0

    def refill(self, now: float) -> None:
        self.level = min(float(self.capacity), self.level + (now - self.updated) * self.rate)
        self.updated = now

    def resize(self, capacity: int) -> None:
        """A new limit from a reloaded keys file: what was used stays used."""
        self.level = min(float(capacity), self.level - self.capacity + capacity)
        self.capacity = capacity

    def remaining(self) -> int:
        return max(0, math.floor(self.level + 1e-9))

    def used(self) -> int:
        return self.capacity - self.remaining()

    def seconds_until(self, level: float) -> float:
        return max(0.0, (level - self.level) / self.rate)


@dataclass(slots=True)
class KeyBuckets:
    requests: TokenBucket | None
    tokens: TokenBucket | None


@dataclass(slots=True)
class KeyState:
    """One key's buckets (None until its first request, or after a reload dropped the key) and its
    requests in progress (in every worker)."""

    buckets: KeyBuckets | None = None
    active: int = 0


class LimitStates(Protocol):
    """Where the keys' states live; `open` holds one key's state for a read-modify-write."""

    def open(self, name: str) -> contextlib.AbstractContextManager[KeyState]: ...

    def forget_others(self, names: Iterable[str]) -> None:
        """Drop the buckets of every key not in `names` (their requests in progress stay counted)."""
        ...


class LocalLimitStates:
    """The states in this process's memory (one gateway process)."""

    def __init__(self) -> None:
        self._states: dict[str, KeyState] = {}

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[KeyState]:
        state = self._states.get(name)
        if state is None:
            state = self._states[name] = KeyState()
        yield state

    def forget_others(self, names: Iterable[str]) -> None:
        kept = set(names)
        for name, state in list(self._states.items()):
            if name not in kept:
                state.buckets = None
                if state.active <= 0:
                    del self._states[name]


class RateLimited(OpenAIError):
    """429 for a key over its limit, as OpenAI words it, with Retry-After and the x-ratelimit headers."""


class TokenReservation:
    """The tokens one request holds of its key's bucket: `hold` takes more as the worst case grows,
    `settle` gives back what the request did not use (once)."""

    def __init__(self, limiter: RateLimiter, key: ApiKey, taken: int) -> None:
        self._limiter = limiter
        self._key = key
        self.taken = taken
        self.settled = False

    def hold(self, tokens: int) -> None:
        """The request may use `tokens` in all: take what is beyond what it holds."""
        if not self.settled and tokens > self.taken:
            self._limiter.charge(self._key, tokens - self.taken)
            self.taken = tokens

    def settle(self, used: int) -> None:
        """The request has ended having used `used` tokens: give back the rest (or take what is missing)."""
        if not self.settled:
            self.settled = True
            self._limiter.charge(self._key, used - self.taken)
            self.taken = used

    def headers(self) -> dict[str, str]:
        return self._limiter.headers(self._key)


class RateLimiter:
    """The buckets of every limited key, by key name (a key rotated under the same name keeps them)."""

    def __init__(self, clock: Clock = time.monotonic, states: LimitStates | None = None) -> None:
        self._clock = clock
        self._states = states if states is not None else LocalLimitStates()

    def arrive(self, key: ApiKey) -> None:
        """A request of `key` arrived: take one request and one of its concurrent slots, or raise
        RateLimited (nothing taken). `leave` gives the slot back, however the request ends."""
        with self._states.open(key.name) as state:
            buckets = self._refilled(key, state)
            if buckets.requests is not None and buckets.requests.level < 1:
                raise self._refusal(key, buckets, "requests", buckets.requests, 1)
            limit = key.limits.max_concurrent_requests
            if limit is not None and state.active >= limit:
                raise RateLimited(
                    429,
                    f"Too many concurrent requests for API key {key.name!r}: Limit {limit}, In progress "
                    f"{state.active}. Wait for one to finish.",
                    type="requests",
                    code="rate_limit_exceeded",
                    headers={"Retry-After": "1", **_headers(buckets)},
                )
            if buckets.requests is not None:
                buckets.requests.level -= 1
            state.active += 1

    def occupy(self, key: ApiKey) -> None:
        """Hold one more concurrent slot of `key`, unchecked (a background run outliving its request)."""
        with self._states.open(key.name) as state:
            state.active += 1

    def leave(self, key: ApiKey) -> None:
        with self._states.open(key.name) as state:
            state.active = max(0, state.active - 1)

    def in_progress(self, key: ApiKey) -> int:
        with self._states.open(key.name) as state:
            return state.active

    def reserve(self, key: ApiKey, tokens: int) -> TokenReservation:
        """Take `tokens` (a request's worst case) of `key`'s tokens, or raise RateLimited (nothing taken):
        too large when they are above the key's limit, else when the bucket holds fewer now."""
        with self._states.open(key.name) as state:
            buckets = self._refilled(key, state)
            bucket = buckets.tokens
            if bucket is not None:
                if tokens > bucket.capacity:
                    raise self._too_large(key, buckets, bucket, tokens)
                if bucket.level < max(1, tokens):
                    raise self._refusal(key, buckets, "tokens", bucket, tokens)
                bucket.level -= tokens
        return TokenReservation(self, key, tokens)

    def charge(self, key: ApiKey, tokens: int) -> None:
        """Take `tokens` of the key's bucket (negative: give them back, up to its capacity)."""
        with self._states.open(key.name) as state:
            bucket = self._refilled(key, state).tokens
            if bucket is not None:
                bucket.level = min(float(bucket.capacity), bucket.level - tokens)

    def headers(self, key: ApiKey) -> dict[str, str]:
        with self._states.open(key.name) as state:
            return _headers(self._refilled(key, state))

    def forget_others(self, names: set[str]) -> None:
        """Drop the buckets of keys no longer configured (after a reload)."""
        self._states.forget_others(names)

    def _refilled(self, key: ApiKey, state: KeyState) -> KeyBuckets:
        now = self._clock()
        if state.buckets is None:
            state.buckets = _new_buckets(key.limits, now)
        else:
            _apply_limits(state.buckets, key.limits, now)
        for bucket in (state.buckets.requests, state.buckets.tokens):
            if bucket is not None:
                bucket.refill(now)
        return state.buckets

    def _refusal(
        self, key: ApiKey, buckets: KeyBuckets, kind: str, bucket: TokenBucket, requested: int
    ) -> RateLimited:
        wait = bucket.seconds_until(max(1, requested))
        message = (
            f"Rate limit reached for API key {key.name!r} on {_UNITS[kind]}: Limit {bucket.capacity}, "
            f"Used {bucket.used()}, Requested {requested}. Please try again in {go_duration(wait)}."
        )
        headers = {"Retry-After": str(max(1, math.ceil(round(wait, 6)))), **_headers(buckets)}
        return RateLimited(429, message, type=kind, code="rate_limit_exceeded", headers=headers)

    def _too_large(
        self, key: ApiKey, buckets: KeyBuckets, bucket: TokenBucket, requested: int
    ) -> RateLimited:
        # No Retry-After: waiting does not help, only a smaller request does.
        message = (
            f"Request too large for API key {key.name!r} on {_UNITS['tokens']}: Limit {bucket.capacity}, "
            f"Requested {requested}: the prompt plus every choice's max_tokens (without max_tokens, the "
            "rest of the model's context). The input or output tokens must be reduced in order to run "
            "successfully."
        )
        return RateLimited(429, message, type="tokens", code="rate_limit_exceeded", headers=_headers(buckets))


def _headers(buckets: KeyBuckets) -> dict[str, str]:
    headers: dict[str, str] = {}
    for kind, bucket in (("requests", buckets.requests), ("tokens", buckets.tokens)):
        if bucket is not None:
            headers[f"x-ratelimit-limit-{kind}"] = str(bucket.capacity)
            headers[f"x-ratelimit-remaining-{kind}"] = str(bucket.remaining())
            headers[f"x-ratelimit-reset-{kind}"] = go_duration(bucket.seconds_until(bucket.capacity))
    return headers


_UNITS = {"requests": "requests per min (RPM)", "tokens": "tokens per min (TPM)"}


def _new_buckets(limits: KeyLimits, now: float) -> KeyBuckets:
    return KeyBuckets(
        requests=TokenBucket(limits.requests_per_minute, now) if limits.requests_per_minute else None,
        tokens=TokenBucket(limits.tokens_per_minute, now) if limits.tokens_per_minute else None,
    )


def _apply_limits(buckets: KeyBuckets, limits: KeyLimits, now: float) -> None:
    """Follow a reloaded keys file: add, drop or resize buckets whose limit changed."""
    for attr, limit in (("requests", limits.requests_per_minute), ("tokens", limits.tokens_per_minute)):
        bucket: TokenBucket | None = getattr(buckets, attr)
        if limit is None:
            setattr(buckets, attr, None)
        elif bucket is None:
            setattr(buckets, attr, TokenBucket(limit, now))
        elif bucket.capacity != limit:
            bucket.refill(now)
            bucket.resize(limit)
