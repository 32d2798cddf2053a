"""Paged KV-cache block manager: fixed-size blocks, ref counts, an LRU free queue and prefix caching.

Plain Python: no torch. A full, computed block is identified by a chained hash of its tokens and of
every block before it; when its last owner frees it, it stays in the free queue with its hash, so a
later request with the same prefix can take it back instead of recomputing it. A free block is reused
for new content in least-recently-freed order, which evicts its cached content.

A block can also be pinned (`pin`/`unpin`): a reference that belongs to no sequence, taken by a KV
transfer so a finished prefill's blocks outlive it until a decode engine has pulled them.

With a sliding window (every layer of the model attending only to its last `sliding_window` tokens), a
block whose tokens all lie before the window of the sequence's next query is never read again: it is
released at once (its entry becomes RELEASED_BLOCK), so a sequence holds a bounded number of blocks
however long it grows. A released block keeps its prefix-cache hash like any freed block.

A sequence of a LoRA adapter chains its blocks from the adapter's root (`Sequence.lora_root`) instead of
from nothing, so equal tokens under another adapter (or the base model) never share a block.

A queued sequence can hold its prompt's cached prefix (`hold_prefix`): a reference per block, so that what
it (and a cache-aware router) found cached when it arrived cannot be evicted while it waits. Holds are
bounded by a budget of blocks the caller gives (beyond it the rest of the prefix is only moved to the back
of the eviction order, `touch_prefix`); they pass to the sequence's block table when it is admitted
(`allocate_prefix`) and are dropped by `free` (abort) or `release_hold` (the scheduler needs the blocks).

With an event log attached (`events`), every block entering the prefix cache and every cached block
leaving it is recorded there (core/kv_events.py), for the engines' SubscribeKvEvents subscribers.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from conduit_common.kv_blocks import BlockHash, chain_hash, prefix_block_hashes
from conduit_engine.core.kv_events import KvEventLog
from conduit_engine.core.sequence import RELEASED_BLOCK, Sequence

__all__ = ["Block", "BlockHash", "BlockManager", "BlockStats", "chain_hash", "prefix_block_hashes"]


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: BlockHash | None = None  # set once the block is full and computed


@dataclass(frozen=True, slots=True)
class BlockStats:
    total: int
    used: int  # ref_count > 0
    free: int  # ref_count == 0 (includes cached)
    cached: int  # free blocks still holding reusable prefix content
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int  # of which served from it
    pinned: int = 0  # blocks held by at least one pin (KV transfers); counted in `used`
    held: int = 0  # references queued sequences hold on their cached prefix (hold_prefix); in `used`

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks, least recently freed first; allocation pops from the front.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}  # hash → block id holding that content
        # Per sequence: hashes of its full computed blocks, in order (chain state).
        self._seq_hashes: dict[int, list[BlockHash]] = {}
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._pins: Counter[int] = Counter()  # block id → references held by pins
        self._holds: dict[int, list[int]] = {}  # seq id → the cached prefix blocks it holds while queued
        self._num_held = 0  # references in _holds
        # Prefix-cache events for subscribers (SubscribeKvEvents); None: nobody records them.
        self.events: KvEventLog | None = None

    # ----- queries -------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def free_block_ids(self) -> list[int]:
        """Free blocks in the order they will be reused (least recently freed first)."""
        return list(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def blocks_for_sequence(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a sequence of `num_tokens` tokens ever holds at once when each step advances
        it by at most `max_chunk` tokens: all of them, or with a window those from the first the chunk's
        first query sees (window - 1 tokens back) to the chunk's end."""
        blocks = self.blocks_needed(num_tokens)
        if self.sliding_window is None:
            return blocks
        return min(blocks, self.blocks_needed(self.sliding_window - 1 + max_chunk) + 1)

    def stats(self) -> BlockStats:
        free = len(self._free)
        cached = sum(1 for b in self._free if self.blocks[b].hash is not None)
        return BlockStats(
            total=self.num_blocks,
            used=self.num_blocks - free,
            free=free,
            cached=cached,
            prefix_queries=self._prefix_queries,
            prefix_hits=self._prefix_hits,
            pinned=len(self._pins),
            held=self._num_held,
        )

    @property
    def num_held_blocks(self) -> int:
        """References queued sequences hold on their cached prefixes (a block held twice counts twice)."""
        return self._num_held

    def held_blocks(self, seq: Sequence) -> list[int]:
        """The blocks `seq` holds while queued (a copy)."""
        return list(self._holds.get(seq.seq_id, ()))

    # ----- allocation ----------------------------------------------------------------------------
    def allocate_prefix(self, seq: Sequence) -> int:
        """First admission: take the longest cached prefix of `seq`'s tokens. Returns tokens reused.

        At least one token is always left to compute, so the model has something to sample from.
        A sequence that still owes prompt logprobs takes nothing: they come from the model's output
        at every prompt position, which a cache hit would skip.
        """
        assert not seq.block_table, "allocate_prefix on a sequence that already holds blocks"
        hashes: list[BlockHash] = []
        self._seq_hashes[seq.seq_id] = hashes
        if not self.enable_prefix_caching:
            return 0
        if seq.params.prompt_logprobs is not None and seq.num_output_tokens == 0:
            return 0
        max_blocks = (seq.num_tokens - 1) // self.block_size
        parent = seq.lora_root
        for i in range(max_blocks):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = chain_hash(parent, tokens)
            block_id = self._cached.get(h)
            if block_id is None:
                break
            self._take(block_id, keep_content=True)
            seq.block_table.append(block_id)
            hashes.append(h)
            parent = h
        reused = len(seq.block_table) * self.block_size
        seq.num_computed_tokens = reused
        self.release_hold(seq)  # its block table took every held block over (they could not be evicted)
        self.release_outside_window(seq)
        return reused

    def touch_prefix(self, token_ids: list[int] | tuple[int, ...], root: BlockHash | None = None) -> int:
        """A request was queued: make the free blocks holding its prompt's cached prefix the most recently
        freed, so that while it waits other blocks are evicted first (what a router predicted it would find
        cached stays cached). Tail first, so the head stays the last to go. Returns the prefix's blocks."""
        found = self._cached_prefix(token_ids, root)
        self._move_to_back(found)
        return len(found)

    def hold_prefix(self, seq: Sequence, budget: int) -> int:
        """Queued `seq` takes a reference on the blocks of its cached prefix, from the head, while all
        holds together stay within `budget` blocks; the rest of the prefix is only touched. The blocks
        cannot be evicted until `allocate_prefix` takes them over, `release_hold` or `free`. Nothing is
        held for a sequence whose admission would reuse nothing (see allocate_prefix). Returns the
        blocks held."""
        assert not seq.block_table, "hold_prefix on a sequence that already holds blocks"
        if seq.params.prompt_logprobs is not None and seq.num_output_tokens == 0:
            return 0
        self.release_hold(seq)
        found = self._cached_prefix(seq.token_ids, seq.lora_root)
        count = max(0, min(len(found), budget - self._num_held))
        self._move_to_back(found[count:])
        if count:
            for block_id in found[:count]:
                self._take(block_id, keep_content=True)
            self._holds[seq.seq_id] = found[:count]
            self._num_held += count
        return count

    def release_hold(self, seq: Sequence) -> int:
        """Drop the references `hold_prefix` took for `seq` (last block first, like `free`); returns how
        many. The blocks keep their content: they stay cached at the back of the eviction order."""
        held = self._holds.pop(seq.seq_id, None)
        if not held:
            return 0
        self._num_held -= len(held)
        for block_id in reversed(held):
            self._drop(block_id)
        return len(held)

    def _cached_prefix(self, token_ids: list[int] | tuple[int, ...], root: BlockHash | None) -> list[int]:
        """The blocks holding the leading full blocks of `token_ids` (at most (n - 1) // block_size: what
        admission can reuse), up to the first one not cached."""
        if not self.enable_prefix_caching:
            return []
        found: list[int] = []
        parent = root
        for i in range((len(token_ids) - 1) // self.block_size):
            parent = chain_hash(parent, tuple(token_ids[i * self.block_size : (i + 1) * self.block_size]))
            block_id = self._cached.get(parent)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def _move_to_back(self, block_ids: list[int]) -> None:
        """Free blocks among `block_ids` become the most recently freed, the first of them last."""
        for block_id in reversed(block_ids):
            if block_id in self._free:
                self._free.move_to_end(block_id)

    def record_prefix_lookup(self, prompt_tokens: int, cached_tokens: int) -> None:
        """Count one admitted request's prompt in the hit rate (once: not per admission attempt)."""
        self._prefix_queries += prompt_tokens
        self._prefix_hits += cached_tokens

    def ensure_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow `seq`'s block table to hold `num_tokens` tokens; all or nothing."""
        needed = self.blocks_needed(num_tokens) - len(seq.block_table)
        if needed <= 0:
            return True
        if needed > len(self._free):
            return False
        for _ in range(needed):
            block_id = next(iter(self._free))
            self._take(block_id, keep_content=False)
            seq.block_table.append(block_id)
        return True

    def commit_computed_blocks(self, seq: Sequence) -> None:
        """Register every newly full, computed block of `seq` in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        hashes = self._seq_hashes.setdefault(seq.seq_id, [])
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        parent = hashes[-1] if hashes else seq.lora_root
        for i in range(len(hashes), num_full):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = chain_hash(parent, tokens)
            hashes.append(h)
            parent = h
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self._cached:
                block.hash = h
                self._cached[h] = block.block_id
                if self.events is not None:
                    self.events.stored(h, hashes[-2] if i else None, tokens)

    def release_outside_window(self, seq: Sequence) -> None:
        """Give back the blocks before the window of `seq`'s next query (at num_computed_tokens, which
        sees keys from num_computed_tokens - window + 1 on); oldest first, as they left the window."""
        if self.sliding_window is None:
            return
        first_visible = seq.num_computed_tokens - self.sliding_window + 1
        table = seq.block_table
        while (
            seq.num_released_blocks < len(table)
            and (seq.num_released_blocks + 1) * self.block_size <= first_visible
        ):
            self._drop(table[seq.num_released_blocks])
            table[seq.num_released_blocks] = RELEASED_BLOCK
            seq.num_released_blocks += 1

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks (and what it holds while queued), last block first so a prefix's tail is
        evicted before its head."""
        self.release_hold(seq)
        for block_id in reversed(seq.block_table[seq.num_released_blocks :]):
            self._drop(block_id)
        seq.block_table.clear()
        seq.num_released_blocks = 0
        seq.num_computed_tokens = 0
        seq.num_draft_computed = 0  # the draft's KV lived in those blocks too
        self._seq_hashes.pop(seq.seq_id, None)

    def pin(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each of `block_ids`, all held by a live sequence (all or nothing).

        The pin outlives the sequence: a pinned block is neither freed nor reused, and keeps its
        prefix-cache hash, until `unpin`. A block listed twice is pinned twice.
        """
        ids = list(block_ids)
        for block_id in ids:
            if not 0 <= block_id < self.num_blocks:
                raise ValueError(f"block_ids: {block_id} is not a block of this cache")
            if self.blocks[block_id].ref_count == 0:
                raise ValueError(f"block_ids: block {block_id} is free; only held blocks can be pinned")
        for block_id in ids:
            self.blocks[block_id].ref_count += 1
            self._pins[block_id] += 1

    def unpin(self, block_ids: Iterable[int]) -> None:
        """Drop references `pin` took (all or nothing); a block nobody else holds becomes free, last
        block first like `free`, and keeps its cached content."""
        ids = list(block_ids)
        for block_id, count in Counter(ids).items():
            if self._pins.get(block_id, 0) < count:
                raise ValueError(f"block_ids: block {block_id} is unpinned more often than pinned")
        for block_id in reversed(ids):
            self._pins[block_id] -= 1
            if self._pins[block_id] == 0:
                del self._pins[block_id]
            self._drop(block_id)

    def pinned_references(self) -> dict[int, int]:
        """Block id → references held by pins (a copy)."""
        return dict(self._pins)

    def reset_prefix_cache(self) -> None:
        """Forget all cached content of free blocks."""
        for block_id in self._free:
            self._uncache(self.blocks[block_id])

    # ----- invariants ----------------------------------------------------------------------------
    def check_integrity(self, live: list[Sequence] | None = None) -> None:
        """Assert free + used == total and the ref counts match the live sequences' block tables plus
        the pins and the queued sequences' holds (a pinned or held block is never free)."""
        free = set(self._free)
        assert len(free) == len(self._free)
        for block in self.blocks:
            in_free = block.block_id in free
            assert in_free == (block.ref_count == 0), f"block {block.block_id} ref/free mismatch"
            if block.hash is not None:
                assert self._cached.get(block.hash) == block.block_id, f"block {block.block_id} hash lost"
        for h, block_id in self._cached.items():
            assert self.blocks[block_id].hash == h
        if self.events is not None:
            assert self.events.num_cached == len(self._cached), "the event log's cached blocks drifted"
        for block_id, pins in self._pins.items():
            assert 0 < pins <= self.blocks[block_id].ref_count, f"block {block_id} pinned {pins} times"
        holds = [block_id for held in self._holds.values() for block_id in held]
        assert len(holds) == self._num_held, "the count of held blocks drifted"
        assert all(self.blocks[b].ref_count > 0 for b in holds), "a held block is free"
        if live is not None:
            counts = [self._pins.get(block_id, 0) for block_id in range(self.num_blocks)]
            for block_id in holds:
                counts[block_id] += 1
            for seq in live:
                self._check_window(seq)
                held = seq.block_table[seq.num_released_blocks :]
                assert len(set(held)) == len(held), f"seq {seq.seq_id} owns a block twice"
                for block_id in held:
                    counts[block_id] += 1
            for block in self.blocks:
                assert counts[block.block_id] == block.ref_count, f"block {block.block_id} ref count wrong"

    def _check_window(self, seq: Sequence) -> None:
        """Released entries are exactly the leading blocks before the window of the next query."""
        table, released = seq.block_table, seq.num_released_blocks
        assert all(b == RELEASED_BLOCK for b in table[:released]), f"seq {seq.seq_id}: released count wrong"
        assert RELEASED_BLOCK not in table[released:], f"seq {seq.seq_id} reads a released block"
        if self.sliding_window is None:
            assert released == 0, f"seq {seq.seq_id} released blocks without a window"
            return
        first_visible = seq.num_computed_tokens - self.sliding_window + 1
        outside = min(len(table), max(0, first_visible // self.block_size))
        assert released == outside, (
            f"seq {seq.seq_id} holds {outside - released} blocks outside its window"
            if released < outside
            else f"seq {seq.seq_id} released {released - outside} blocks inside its window"
        )

    # ----- internals -----------------------------------------------------------------------------
    def _drop(self, block_id: int) -> None:
        """Remove one reference; a block nobody holds joins the free queue (keeping its content)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed more often than taken"
        if block.ref_count == 0:
            self._free[block_id] = None

    def _take(self, block_id: int, keep_content: bool) -> None:
        """Add a reference; a free block leaves the free queue, and loses its cached content unless
        it is being reused for exactly that content (a prefix-cache hit)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
            if not keep_content:
                self._uncache(block)
        block.ref_count += 1

    def _uncache(self, block: Block) -> None:
        if block.hash is not None:
            if self._cached.get(block.hash) == block.block_id:
                del self._cached[block.hash]
                if self.events is not None:
                    self.events.removed(block.hash)
            block.hash = None
