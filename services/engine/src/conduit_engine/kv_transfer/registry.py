"""The source side of KV transfers: finished prefills whose blocks are pinned for a decode engine to pull.

Plain Python: no torch. `produce` pins a prompt's blocks through the BlockManager under a fresh,
unguessable transfer id with a lease. The blocks are then neither freed nor reused until the transfer
ends, in one of three ways:

- a pull completes (`finish_pull(completed=True)`: the last chunk was sent);
- `release` (ReleaseKv: the client went away, or no decode engine took the request);
- the lease runs out (`expire_due`, or lazily when the id is next looked up).

An ended transfer answers NOT_FOUND to new pulls at once, but its blocks stay pinned while a pull that
started earlier is still reading them; the last such pull to finish unpins them. A pull that fails
midway (the puller went away) leaves the transfer open until its lease ends, so it can be pulled again.

Threading: like the BlockManager, a registry belongs to the engine loop thread. The gRPC handlers reach
it through `AsyncEngine.run_sync`, and the loop calls `expire_due` between steps. Time comes from an
injected clock (Unix seconds, `time.time` by default) so tests decide when leases end.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from conduit_engine.core.block_manager import BlockHash, BlockManager, chain_hash, prefix_block_hashes
from conduit_engine.kv_transfer.errors import KvTransferNotFoundError

DEFAULT_LEASE_SECONDS = 30.0


@dataclass(slots=True)
class KvTransfer:
    """One produced prompt KV: its pinned blocks, in token order, and what they hold."""

    transfer_id: str
    block_ids: tuple[int, ...]  # cache blocks of tokens [0, block_size), [block_size, 2 * block_size), ...
    token_ids: tuple[int, ...]  # the prompt whose KV the blocks hold
    block_hashes: tuple[BlockHash, ...]  # prefix-cache chain hashes of the full blocks
    expires_at: float  # Unix seconds when the lease ends
    lora_name: str | None = None  # the LoRA adapter the KV was computed with (None: the base model)
    active_pulls: int = 0
    ended: bool = False  # pulled, released or expired: no new pulls; unpinned when no pull is active

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def expires_unix_ms(self) -> int:
        return int(self.expires_at * 1000)


class KvTransferRegistry:
    """Transfer id → pinned transfer, over one BlockManager."""

    def __init__(
        self,
        block_manager: BlockManager,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if lease_seconds <= 0:
            raise ValueError(f"lease_seconds: must be > 0, got {lease_seconds}")
        self.block_manager = block_manager
        self.lease_seconds = lease_seconds
        self._clock = clock
        self._transfers: dict[str, KvTransfer] = {}

    # ----- queries -------------------------------------------------------------------------------
    @property
    def num_pending(self) -> int:
        """Transfers that can still be pulled (GetLoad.kv_transfers_pending)."""
        return sum(1 for t in self._transfers.values() if not t.ended)

    @property
    def num_pinned_blocks(self) -> int:
        """Distinct blocks pinned by transfers, ended ones still being read included."""
        return len({b for t in self._transfers.values() for b in t.block_ids})

    def transfer(self, transfer_id: str) -> KvTransfer | None:
        """The record of a transfer still holding blocks (pending, or ended while a pull reads it)."""
        return self._transfers.get(transfer_id)

    def transfer_ids(self) -> list[str]:
        """Ids of the transfers still holding blocks (pending, or ended with a pull still reading)."""
        return list(self._transfers)

    # ----- lifecycle -----------------------------------------------------------------------------
    def produce(
        self,
        block_ids: Sequence[int],
        token_ids: Sequence[int],
        lora_name: str | None = None,
        lora_root: BlockHash | None = None,
    ) -> KvTransfer:
        """Pin the blocks holding `token_ids`' KV (their owner must still hold them) under a new id.

        `block_ids` are the first blocks of the owner's block table: exactly enough for the tokens.
        `lora_name`, `lora_root`: the owner's adapter and its prefix-cache root (its blocks' hashes chain
        from there).
        """
        if not token_ids:
            raise ValueError("token_ids: a transfer holds at least one token")
        needed = self.block_manager.blocks_needed(len(token_ids))
        if len(block_ids) != needed:
            raise ValueError(f"block_ids: {len(token_ids)} tokens take {needed} blocks, got {len(block_ids)}")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError("block_ids: a block appears twice")
        self.block_manager.pin(block_ids)
        transfer = KvTransfer(
            transfer_id=uuid.uuid4().hex,  # a capability: whoever knows it can read the prompt's KV
            block_ids=tuple(block_ids),
            token_ids=tuple(token_ids),
            block_hashes=_block_hashes(token_ids, self.block_manager.block_size, lora_root),
            expires_at=self._clock() + self.lease_seconds,
            lora_name=lora_name,
        )
        self._transfers[transfer.transfer_id] = transfer
        return transfer

    def start_pull(self, transfer_id: str) -> KvTransfer:
        """Begin reading a pending transfer: its blocks stay pinned until `finish_pull`.

        Raises KvTransferNotFoundError for an unknown, pulled, released or expired id.
        """
        transfer = self._pending(transfer_id)
        transfer.active_pulls += 1
        return transfer

    def finish_pull(self, transfer_id: str, completed: bool) -> None:
        """End a pull `start_pull` began; a completed one ends the transfer. A failed one leaves it
        pending until its lease ends (then the blocks are unpinned now if nobody else reads them)."""
        transfer = self._transfers.get(transfer_id)
        if transfer is None or transfer.active_pulls == 0:
            raise ValueError(f"transfer_id: no pull of {transfer_id!r} is in progress")
        transfer.active_pulls -= 1
        if completed or self._clock() >= transfer.expires_at:
            transfer.ended = True
        self._unpin_if_done(transfer)

    def release(self, transfer_id: str) -> bool:
        """End a pending transfer early (ReleaseKv). False when it was unknown or had already ended."""
        transfer = self._transfers.get(transfer_id)
        if transfer is None or transfer.ended:
            return False
        transfer.ended = True
        self._unpin_if_done(transfer)
        return True

    def expire_due(self) -> list[str]:
        """End every pending transfer whose lease has run out; returns their ids."""
        now = self._clock()
        expired = [t for t in self._transfers.values() if not t.ended and now >= t.expires_at]
        for transfer in expired:
            transfer.ended = True
            self._unpin_if_done(transfer)
        return [t.transfer_id for t in expired]

    def release_all(self) -> int:
        """End every pending transfer (the engine shuts down); returns how many were pending."""
        pending = [t.transfer_id for t in self._transfers.values() if not t.ended]
        for transfer_id in pending:
            self.release(transfer_id)
        return len(pending)

    # ----- invariants ----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Assert the BlockManager's pins are exactly the live transfers' blocks, and that a pinned full
        block still holds the content its hash names (pins keep blocks from being reused)."""
        expected: dict[int, int] = {}
        for transfer in self._transfers.values():
            assert not transfer.ended or transfer.active_pulls > 0, f"{transfer.transfer_id} ended but pinned"
            for block_id in transfer.block_ids:
                expected[block_id] = expected.get(block_id, 0) + 1
            for block_id, h in zip(transfer.block_ids, transfer.block_hashes, strict=False):
                held = self.block_manager.blocks[block_id].hash
                assert held in (None, h), f"pinned block {block_id} of {transfer.transfer_id} changed content"
        assert self.block_manager.pinned_references() == expected, "pins differ from the live transfers"

    # ----- internals -----------------------------------------------------------------------------
    def _pending(self, transfer_id: str) -> KvTransfer:
        transfer = self._transfers.get(transfer_id)
        if transfer is not None and not transfer.ended and self._clock() >= transfer.expires_at:
            transfer.ended = True
            self._unpin_if_done(transfer)
        if transfer is None or transfer.ended:
            raise KvTransferNotFoundError(
                f"transfer_id: {transfer_id!r} is unknown here, or was already pulled, released or expired"
            )
        return transfer

    def _unpin_if_done(self, transfer: KvTransfer) -> None:
        if transfer.ended and transfer.active_pulls == 0:
            del self._transfers[transfer.transfer_id]
            self.block_manager.unpin(transfer.block_ids)


def _block_hashes(token_ids: Sequence[int], block_size: int, root: BlockHash | None) -> tuple[BlockHash, ...]:
    """The prefix-cache hashes of the full blocks of `token_ids`, chained from `root` (an adapter's)."""
    if root is None:
        return tuple(prefix_block_hashes(list(token_ids), block_size))
    hashes: list[BlockHash] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, tuple(token_ids[start : start + block_size]))
        hashes.append(parent)
    return tuple(hashes)
