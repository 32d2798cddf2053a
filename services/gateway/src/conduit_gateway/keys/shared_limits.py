"""The keys' limit states in a file every worker of `--workers N` maps, so a key's limits hold for the pod.

One fixed-size table of slots, found by a hash of the key's name (linear probing); each slot holds the
key's two buckets (capacity, level, time of the last refill) and its requests in progress, one counter
per worker. A read-modify-write of a slot holds an exclusive `flock` on the file: a few microseconds, and
the workers' event loops never wait on each other for longer.

Requests in progress are counted per worker so that a worker that dies does not leave its slots taken
for ever: the worker that replaces it clears its own counters when it starts (`clear_worker`). The
clock is CLOCK_MONOTONIC, the same in every process of the machine, so a refill computed by one worker
is right for all. The file lives in the supervisor's scratch directory (on /dev/shm where there is one).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import struct
from collections.abc import Iterable, Iterator

from conduit_gateway.keys.rate_limit import KeyBuckets, KeyState, TokenBucket

_MAGIC = b"CDKEYLM1"
_HEADER = struct.Struct("<8sqq")  # magic, workers, slots
# name digest; buckets set (0: not yet); requests capacity (0: unlimited), level, last refill; the same
# for tokens; then one in-progress count per worker.
_SLOT_HEAD = struct.Struct("<16sqqddqdd")
DEFAULT_SLOTS = 16384


def _digest(name: str) -> bytes:
    return hashlib.blake2b(name.encode("utf-8"), digest_size=16).digest()


class LimitTableFull(RuntimeError):
    """Every slot holds another key (more distinct key names than the table was made for)."""


class SharedLimitStates:
    """`LimitStates` in the shared file at `path`, as worker `worker` (its column of in-progress counts)."""

    def __init__(self, path: str, worker: int) -> None:
        self._fd = os.open(path, os.O_RDWR)
        size = os.fstat(self._fd).st_size
        self._map = mmap.mmap(self._fd, size)
        magic, self.workers, self.slots = _HEADER.unpack_from(self._map, 0)
        if magic != _MAGIC or not 0 <= worker < self.workers:
            raise ValueError(f"{path} is not a key-limit table for worker {worker}")
        self.worker = worker
        self._active = struct.Struct(f"<{self.workers}q")
        self._slot_bytes = _SLOT_HEAD.size + self._active.size

    @staticmethod
    def create(path: str, workers: int, slots: int = DEFAULT_SLOTS) -> None:
        """Make an empty table for `workers` workers (the supervisor, before it starts them)."""
        slot_bytes = _SLOT_HEAD.size + 8 * workers
        with open(path, "wb") as file:
            file.write(_HEADER.pack(_MAGIC, workers, slots))
            file.truncate(_HEADER.size + slots * slot_bytes)  # sparse: pages appear as keys do

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _offset(self, slot: int) -> int:
        return _HEADER.size + slot * self._slot_bytes

    def _find(self, digest: bytes) -> int:
        """The slot of `digest`, claiming an empty one for a new key."""
        start = int.from_bytes(digest[:8], "little") % self.slots
        for probe in range(self.slots):
            slot = (start + probe) % self.slots
            offset = self._offset(slot)
            held = self._map[offset : offset + 16]
            if held == digest:
                return slot
            if held == bytes(16):
                self._map[offset : offset + 16] = digest
                return slot
        raise LimitTableFull(f"the shared key-limit table holds {self.slots} keys; no slot is free")

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[KeyState]:
        with self._locked():
            offset = self._offset(self._find(_digest(name)))
            state, counts = self._load(offset)
            total = state.active
            try:
                yield state
            finally:
                counts[self.worker] = max(0, counts[self.worker] + state.active - total)
                self._store(offset, state, counts)

    def _load(self, offset: int) -> tuple[KeyState, list[int]]:
        digest, has, r_cap, r_level, r_time, t_cap, t_level, t_time = _SLOT_HEAD.unpack_from(
            self._map, offset
        )
        counts = list(self._active.unpack_from(self._map, offset + _SLOT_HEAD.size))
        buckets = None
        if has:
            buckets = KeyBuckets(_bucket(r_cap, r_level, r_time), _bucket(t_cap, t_level, t_time))
        return KeyState(buckets, sum(counts)), counts

    def _store(self, offset: int, state: KeyState, counts: list[int]) -> None:
        digest = self._map[offset : offset + 16]
        fields: list[float] = []
        for bucket in (state.buckets.requests, state.buckets.tokens) if state.buckets else (None, None):
            fields += [bucket.capacity, bucket.level, bucket.updated] if bucket else [0, 0.0, 0.0]
        _SLOT_HEAD.pack_into(self._map, offset, digest, int(state.buckets is not None), *fields)
        self._active.pack_into(self._map, offset + _SLOT_HEAD.size, *counts)

    def _slots_in_use(self) -> Iterator[tuple[bytes, int]]:
        for slot in range(self.slots):
            offset = self._offset(slot)
            digest = self._map[offset : offset + 16]
            if digest != bytes(16):
                yield digest, offset

    def forget_others(self, names: Iterable[str]) -> None:
        kept = {_digest(name) for name in names}
        with self._locked():
            for digest, offset in self._slots_in_use():
                if digest not in kept:
                    state, counts = self._load(offset)
                    state.buckets = None
                    self._store(offset, state, counts)

    def clear_worker(self) -> None:
        """This worker starts: requests its predecessor held are gone."""
        with self._locked():
            for _, offset in self._slots_in_use():
                state, counts = self._load(offset)
                counts[self.worker] = 0
                self._store(offset, state, counts)


def _bucket(capacity: int, level: float, updated: float) -> TokenBucket | None:
    if capacity <= 0:
        return None
    bucket = TokenBucket(capacity, updated)
    bucket.level = level
    return bucket
