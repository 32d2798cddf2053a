"""Which engine holds which prefix-cache blocks, as their SubscribeKvEvents streams tell (for kv_aware).

One entry per engine: the set of block hashes it has cached, and whether that set is current (its
snapshot has arrived and no batch was missed since). An engine that is not current counts as holding
nothing, so kv_aware routes its requests by load alone until its snapshot is back.

Memory bound: at most `max_blocks_per_engine` hashes per engine (a stored event beyond it is dropped and
counted, which only makes predictions conservative); a hash is a 32-byte `bytes` in a set, about 100 bytes
with its set slot, so the index holds at most about 100 B × max_blocks_per_engine × engines. An engine
never caches more blocks than it has (GetModelInfo's num_kv_blocks), so the bound only matters for an
engine that misbehaves.

Everything here runs on the gateway's event loop; routing reads it synchronously and never waits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

BYTES_PER_ENTRY = 100  # a 32-byte hash object plus its set slot, for the documented bound


@dataclass(slots=True)
class EngineBlocks:
    """One engine's cached blocks as far as its event stream has told."""

    hashes: set[bytes] = field(default_factory=set)
    current: bool = False  # snapshot complete and no gap since
    engine_id: str = ""
    sequence: int = 0  # of the last batch applied
    lag_s: float = 0.0  # age of the last batch when it was applied
    resubscribes: int = 0
    dropped: int = 0  # stored events over the bound
    # Requests routed here with a prediction: predicted and actual cached prompt blocks, summed, and the
    # sums of min and max of the two per request (accuracy = agreed / union).
    predictions: int = 0
    predicted_blocks: int = 0
    actual_blocks: int = 0
    agreed_blocks: int = 0
    union_blocks: int = 0

    def record_prediction(self, predicted: int, actual: int) -> None:
        self.predictions += 1
        self.predicted_blocks += predicted
        self.actual_blocks += actual
        self.agreed_blocks += min(predicted, actual)
        self.union_blocks += max(predicted, actual)


class KvIndex:
    """Block hashes per engine address."""

    def __init__(self, max_blocks_per_engine: int) -> None:
        if max_blocks_per_engine < 1:
            raise ValueError("max_blocks_per_engine must be >= 1")
        self.max_blocks_per_engine = max_blocks_per_engine
        self._engines: dict[str, EngineBlocks] = {}

    def engine(self, address: str) -> EngineBlocks:
        entry = self._engines.get(address)
        if entry is None:
            entry = self._engines[address] = EngineBlocks()
        return entry

    def peek(self, address: str) -> EngineBlocks | None:
        return self._engines.get(address)

    def indexed_blocks(self, address: str) -> int | None:
        """Blocks indexed for the engine; None while it is not current."""
        entry = self._engines.get(address)
        return len(entry.hashes) if entry is not None and entry.current else None

    def forget(self, address: str) -> None:
        """The engine's blocks are unknown (restart, ejection, broken stream): it holds nothing here until
        a new snapshot arrives. Its counters stay."""
        entry = self._engines.get(address)
        if entry is not None:
            entry.hashes = set()
            entry.current = False
            entry.sequence = 0

    def remove(self, address: str) -> None:
        """The engine left the pool."""
        self._engines.pop(address, None)

    def store(self, entry: EngineBlocks, block_hash: bytes) -> None:
        if len(entry.hashes) >= self.max_blocks_per_engine and block_hash not in entry.hashes:
            entry.dropped += 1
            return
        entry.hashes.add(block_hash)

    def overlap(self, address: str, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a prompt (its chained hashes, in order) the engine has cached: the
        engine reuses a cached prefix up to its first missing block, so the count stops there."""
        entry = self._engines.get(address)
        if entry is None or not entry.current:
            return 0
        hashes = entry.hashes
        count = 0
        for block_hash in block_hashes:
            if block_hash not in hashes:
                break
            count += 1
        return count

    def total_blocks(self) -> int:
        return sum(len(entry.hashes) for entry in self._engines.values())
