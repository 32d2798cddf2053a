"""Per-key limits: requests per minute and tokens per minute, each a token bucket, reported with the
headers OpenAI sends (x-ratelimit-limit-*, -remaining-*, -reset-*) and 429 + Retry-After when spent.

Each bucket holds up to its per-minute limit and refills continuously at limit / 60 per second. A
request needs one whole request and at least one token left. Tokens are charged as they are known:
the prompt's when the engine admits the request (its first message), the output's as they stream, so
a long answer can overdraw the bucket; the next requests wait until it has refilled.

The clock is injected (seconds, monotonic), so tests drive the buckets exactly.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

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
        self._updated = now

    @property
    def rate(self) -> float:
        return self.capacity / 60.0

    def refill(self, now: float) -> None:
        self.level = min(float(self.capacity), self.level + (now - self._updated) * self.rate)
        self._updated = now

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
class _KeyBuckets:
    requests: TokenBucket | None
    tokens: TokenBucket | None


class RateLimited(OpenAIError):
    """429 for a key over its limit, as OpenAI words it, with Retry-After and the x-ratelimit headers."""


class Admission:
    """One admitted request of a key: charges its tokens and reports the key's headers."""

    def __init__(self, limiter: RateLimiter, key: ApiKey) -> None:
        self._limiter = limiter
        self._key = key
        self._charged = 0

    def charge_total(self, tokens: int) -> None:
        """The request has used `tokens` in all (prompt + output) so far: charge what is new."""
        if tokens > self._charged:
            self._limiter.charge(self._key, tokens - self._charged)
            self._charged = tokens

    def headers(self) -> dict[str, str]:
        return self._limiter.headers(self._key)


class RateLimiter:
    """The buckets of every limited key, by key name (a key rotated under the same name keeps them)."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, _KeyBuckets] = {}

    def admit(self, key: ApiKey) -> Admission:
        """Take one request of `key`'s budget, or raise RateLimited (nothing taken)."""
        buckets = self._refilled(key)
        for kind, bucket in (("requests", buckets.requests), ("tokens", buckets.tokens)):
            if bucket is not None and bucket.level < 1:
                raise self._refusal(key, kind, bucket)
        if buckets.requests is not None:
            buckets.requests.level -= 1
        return Admission(self, key)

    def charge(self, key: ApiKey, tokens: int) -> None:
        buckets = self._refilled(key)
        if buckets.tokens is not None:
            buckets.tokens.level -= tokens

    def headers(self, key: ApiKey) -> dict[str, str]:
        buckets = self._refilled(key)
        headers: dict[str, str] = {}
        for kind, bucket in (("requests", buckets.requests), ("tokens", buckets.tokens)):
            if bucket is not None:
                headers[f"x-ratelimit-limit-{kind}"] = str(bucket.capacity)
                headers[f"x-ratelimit-remaining-{kind}"] = str(bucket.remaining())
                headers[f"x-ratelimit-reset-{kind}"] = go_duration(bucket.seconds_until(bucket.capacity))
        return headers

    def forget_others(self, names: set[str]) -> None:
        """Drop the buckets of keys no longer configured (after a reload)."""
        for name in set(self._buckets) - names:
            del self._buckets[name]

    def _refilled(self, key: ApiKey) -> _KeyBuckets:
        now = self._clock()
        buckets = self._buckets.get(key.name)
        if buckets is None:
            buckets = self._buckets[key.name] = _new_buckets(key.limits, now)
        else:
            _apply_limits(buckets, key.limits, now)
        for bucket in (buckets.requests, buckets.tokens):
            if bucket is not None:
                bucket.refill(now)
        return buckets

    def _refusal(self, key: ApiKey, kind: str, bucket: TokenBucket) -> RateLimited:
        wait = bucket.seconds_until(1)
        unit = "requests per min (RPM)" if kind == "requests" else "tokens per min (TPM)"
        requested = ", Requested 1" if kind == "requests" else ""
        message = (
            f"Rate limit reached for API key {key.name!r} on {unit}: Limit {bucket.capacity}, "
            f"Used {bucket.used()}{requested}. Please try again in {go_duration(wait)}."
        )
        headers = {"Retry-After": str(max(1, math.ceil(round(wait, 6)))), **self.headers(key)}
        return RateLimited(429, message, type=kind, code="rate_limit_exceeded", headers=headers)


def _new_buckets(limits: KeyLimits, now: float) -> _KeyBuckets:
    return _KeyBuckets(
        requests=TokenBucket(limits.requests_per_minute, now) if limits.requests_per_minute else None,
        tokens=TokenBucket(limits.tokens_per_minute, now) if limits.tokens_per_minute else None,
    )


def _apply_limits(buckets: _KeyBuckets, limits: KeyLimits, now: float) -> None:
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
