"""Prefix-cache events of one block manager: which full blocks entered the cache and which left it.

The block manager calls `stored` when a full, computed block is registered under its chained hash and
`removed` when a cached block is reused for other content (evicted) or forgotten; `cleared` says every
cached block is gone. The engine loop takes what accumulated as one numbered batch after each step
(`take_batch`), and a new subscriber starts from `snapshot`: every block cached now, as of the last batch's
sequence number, so snapshot + later batches replay the cache exactly.

Plain Python and cheap on purpose: a stored block costs a dict insert and a list append of a tuple the
block manager already built; nothing is serialised here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

from conduit_common.kv_blocks import BlockHash


class BlockStored(NamedTuple):
    """A full block entered the prefix cache under `block_hash`."""

    block_hash: BlockHash
    parent_hash: BlockHash | None  # None for a sequence's first block
    token_ids: tuple[int, ...]


class BlockRemoved(NamedTuple):
    """The block cached under `block_hash` left the cache (evicted or forgotten)."""

    block_hash: BlockHash


class AllCleared(NamedTuple):
    """Every cached block left the cache."""


KvEvent = BlockStored | BlockRemoved | AllCleared


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    """The events of one engine step (or one command between steps), in order."""

    sequence: int  # 1, 2, 3, … with no gaps
    events: tuple[KvEvent, ...]
    created_unix_ms: int
    num_cached: int  # blocks cached after it


class KvEventLog:
    """Accumulates a block manager's events and the set of blocks they leave cached."""

    def __init__(self) -> None:
        self._pending: list[KvEvent] = []
        # Cached blocks now (as the events describe them): hash → (parent hash, token ids).
        self._live: dict[BlockHash, tuple[BlockHash | None, tuple[int, ...]]] = {}
        self.sequence = 0  # of the last batch taken

    def stored(
        self, block_hash: BlockHash, parent_hash: BlockHash | None, token_ids: tuple[int, ...]
    ) -> None:
        self._live[block_hash] = (parent_hash, token_ids)
        self._pending.append(BlockStored(block_hash, parent_hash, token_ids))

    def removed(self, block_hash: BlockHash) -> None:
        if self._live.pop(block_hash, None) is not None:
            self._pending.append(BlockRemoved(block_hash))

    def cleared(self) -> None:
        self._live.clear()
        self._pending.append(AllCleared())

    @property
    def has_pending(self) -> bool:
        """Events recorded since the last batch was taken."""
        return bool(self._pending)

    @property
    def num_cached(self) -> int:
        return len(self._live)

    def take_batch(self) -> KvEventBatch | None:
        """The events since the last batch as the next numbered batch; None when there are none."""
        if not self._pending:
            return None
        self.sequence += 1
        batch = KvEventBatch(self.sequence, tuple(self._pending), int(time.time() * 1000), len(self._live))
        self._pending = []
        return batch

    def snapshot(self) -> tuple[int, list[BlockStored]]:
        """Every cached block and the sequence number it is current as of. Take the pending batch first:
        events not yet in a batch are in the snapshot, but would be sent again."""
        assert not self._pending, "take_batch before snapshot"
        blocks = [BlockStored(h, parent, tokens) for h, (parent, tokens) in self._live.items()]
        return self.sequence, blocks
