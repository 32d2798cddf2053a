"""The KV cache itself in shared memory, for same-host pulls with one copy (--kv-transport shm).

A source engine whose cache lives in its own process on the CPU allocates every layer's K and V tensor
in one memfd (`SharedKvCacheFile`: anonymous shared memory, page-aligned regions, freed by the kernel
when the engine exits however it exits: nothing is left in /dev/shm). A puller on the same host asks for
the pull "direct" (PullKvRequest.shm_direct); the source pins the transfer as usual and answers one chunk
whose `shm` (KvShmBlocks) names the file (its process id, descriptor number and inode), the regions'
offsets, one block's bytes in a region, and the transfer's block ids. The puller maps that file read-only
(`MappedKvSource`, once per source engine: `/proc/<pid>/fd/<fd>`, checked against the inode so a reused
pid or descriptor is refused), copies each run of blocks straight from the source's cache into its own
(`copy_blocks`: one memmove per run of consecutive blocks per region, the GIL released) and then calls
ReleaseKv: released means the blocks stayed pinned through the copy.

Who can read the cache: a process that may open the engine's /proc/<pid>/fd (the same user, where the
kernel lets it inspect the engine: ptrace access mode read) reads every block of this engine's cache while
the engine lives; the descriptor is handed out only in the answer to a live transfer id, as NIXL's
metadata is. A puller that cannot open it (another PID namespace: a container sharing /dev/shm but not
processes) says so and uses the segment path (shm_transport: source gathers into a segment, the puller
scatters from it).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from conduit.engine.v1 import engine_pb2 as pb
from conduit_engine.kv_transfer.errors import KvTransferError, KvTransportUnavailableError
from conduit_engine.page_populate import MADV_POPULATE_READ, populate_in_background

_PAGE = mmap.PAGESIZE
_MAX_MAPPED_SOURCES = 16  # mapped source caches kept by a puller (least recently used unmapped)
MAPPED_IDLE_S = 300.0  # a source not pulled from for this long is unmapped


def _page_round(size: int) -> int:
    return -(-size // _PAGE) * _PAGE


class SharedKvCacheFile:
    """One memfd of `num_regions` page-aligned regions of `region_bytes` each (layer 0's K, layer 0's V,
    layer 1's K, ...), every region mapped shared and writable (`buffers`). Pages are zero and mapped by
    the kernel on first touch, as anonymous memory is."""

    def __init__(self, num_regions: int, region_bytes: int) -> None:
        self.region_bytes = region_bytes
        stride = _page_round(region_bytes)
        self.size = stride * num_regions
        self.fd = os.memfd_create("conduit-kv-cache", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.size)
            self.inode = os.fstat(self.fd).st_ino
            self.offsets = [i * stride for i in range(num_regions)]
            self.buffers = [
                mmap.mmap(self.fd, region_bytes, flags=mmap.MAP_SHARED, offset=offset)
                for offset in self.offsets
            ]
        except BaseException:
            os.close(self.fd)
            raise
        self.pid = os.getpid()

    def describe(self, block_ids: Sequence[int], block_stride: int) -> pb.KvShmBlocks:
        """Where cache blocks `block_ids` lie (a source's answer to a direct pull)."""
        return pb.KvShmBlocks(
            pid=self.pid,
            fd=self.fd,
            inode=self.inode,
            file_bytes=self.size,
            region_offsets=self.offsets,
            block_stride=block_stride,
            block_ids=block_ids,
        )


def block_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first source block, first destination block, length) of each run where both are consecutive."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            first_s, first_d, n = runs[-1]
            runs[-1] = (first_s, first_d, n + 1)
        else:
            runs.append((s, d, 1))
    return runs


class MappedKvSource:
    """A source engine's shared cache file, mapped read-only into this process."""

    def __init__(self, blocks: pb.KvShmBlocks) -> None:
        path = f"/proc/{blocks.pid}/fd/{blocks.fd}"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise KvTransportUnavailableError(f"cannot open the source's KV cache ({path}): {exc}") from None
        try:
            st = os.fstat(fd)
            if st.st_ino != blocks.inode or st.st_size < blocks.file_bytes:
                raise KvTransportUnavailableError(
                    f"{path} is not the source's KV cache (inode {st.st_ino}, {st.st_size} bytes; "
                    f"expected inode {blocks.inode}, {blocks.file_bytes} bytes)"
                )
            self._map = mmap.mmap(fd, blocks.file_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.pid, self.inode, self.size = blocks.pid, blocks.inode, blocks.file_bytes
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)  # read-only: only its address is used
        self.address = int(self._bytes.ctypes.data)
        # A page first read by a copy would fault there (about half the copy's speed): map them all
        # ahead, beside the pulls.
        self._stop = threading.Event()
        self._populating = populate_in_background(
            [(self.address, self.size)], MADV_POPULATE_READ, "kv-source-populate", self._stop
        )

    def matches(self, blocks: pb.KvShmBlocks) -> bool:
        return (blocks.pid, blocks.inode, blocks.file_bytes) == (self.pid, self.inode, self.size)

    def alive(self) -> bool:
        """Whether the source process still runs (its pid may be reused: the idle limit covers that)."""
        try:
            os.kill(self.pid, 0)
        except (ProcessLookupError, PermissionError):  # gone, or someone else's process holds the pid
            return False
        return True

    def close(self) -> None:
        self._stop.set()
        if self._populating is not None:
            self._populating.join()  # at most one chunk's madvise away: never on an unmapped range
        del self._bytes  # the array's export of the map ends first
        self._map.close()


class MappedKvSources:
    """A puller's mapped source caches, by source address. A mapping keeps the source's cache memory
    alive even after the source is gone, so it is retired when its source restarts (a new file at that
    address), exits, or has not been pulled from for `idle_s` (`sweep`), and beyond `limit` sources the
    least recently used goes first. A retired mapping is unmapped once no copy uses it (`acquire` /
    `release` count the copies): a copy never reads an unmapped range."""

    def __init__(self, limit: int = _MAX_MAPPED_SOURCES, idle_s: float = MAPPED_IDLE_S) -> None:
        self._limit = limit
        self._idle_s = idle_s
        self._maps: OrderedDict[str, tuple[MappedKvSource, float]] = OrderedDict()
        self._users: dict[MappedKvSource, int] = {}

    def __len__(self) -> int:
        return len(self._maps)

    def acquire(self, source_address: str, blocks: pb.KvShmBlocks) -> MappedKvSource:
        """The mapping of `blocks`' file at `source_address` (made on first use), held until `release`."""
        entry = self._maps.pop(source_address, None)
        mapped = entry[0] if entry is not None else None
        if mapped is not None and not mapped.matches(blocks):  # the source restarted
            self._retire(mapped)
            mapped = None
        if mapped is None:
            mapped = MappedKvSource(blocks)
        self._maps[source_address] = (mapped, time.monotonic())
        self._users[mapped] = self._users.get(mapped, 0) + 1
        while len(self._maps) > self._limit:
            _, (oldest, _) = self._maps.popitem(last=False)
            self._retire(oldest)
        return mapped

    def release(self, mapped: MappedKvSource) -> None:
        """A copy `acquire` allowed is done with `mapped`."""
        self._users[mapped] -= 1
        if self._users[mapped] == 0:
            del self._users[mapped]
            if all(entry[0] is not mapped for entry in self._maps.values()):  # retired meanwhile
                mapped.close()

    def sweep(self, now: float | None = None) -> int:
        """Retire the sources whose process is gone or that were idle for idle_s; returns how many."""
        now = time.monotonic() if now is None else now
        gone = [
            address
            for address, (mapped, used) in self._maps.items()
            if now - used >= self._idle_s or not mapped.alive()
        ]
        for address in gone:
            self._retire(self._maps.pop(address)[0])
        return len(gone)

    def close(self) -> None:
        """Retire every mapping (those still copying are unmapped when their copy is done)."""
        maps, self._maps = list(self._maps.values()), OrderedDict()
        for mapped, _ in maps:
            self._retire(mapped)

    def _retire(self, mapped: MappedKvSource) -> None:
        if mapped not in self._users:
            mapped.close()


def copy_blocks(
    source: MappedKvSource,
    blocks: pb.KvShmBlocks,
    destination: Sequence[Any],
    dest_block_ids: Sequence[int],
    threads: int = 1,
) -> int:
    """Copy `blocks` from the mapped `source` into `destination` (this engine's cache tensors, in the
    regions' order: layer 0's K, V, layer 1's K, ...) at `dest_block_ids`; returns the bytes copied. Runs
    in a worker thread: each memmove releases the GIL, and with `threads` > 1 that many threads (this one
    and threads - 1 more) each copy an equal share of the bytes, which 4 KiB shared pages need to reach
    memory speed (one thread copies them at about 60% of a plain memmove's rate)."""
    stride = blocks.block_stride
    if len(blocks.region_offsets) != len(destination):
        raise KvTransferError(
            f"the source's cache has {len(blocks.region_offsets)} regions, this one {len(destination)}"
        )
    for tensor in destination:
        if tensor.element_size() * tensor[0].numel() != stride:
            raise KvTransferError(
                f"a source block takes {stride} bytes, a block of this cache {tensor[0].numel()} elements"
            )
    runs = block_runs(blocks.block_ids, dest_block_ids)
    capacity = destination[0].shape[0]
    for offset in blocks.region_offsets:
        for s, _, n in runs:
            if offset + (s + n) * stride > source.size:
                raise KvTransferError(f"source blocks [{s}, {s + n}) lie past the end of its cache")
    outside = [d + n - 1 for _, d, n in runs if d + n > capacity]
    if outside:
        raise KvTransferError(f"destination block {outside[0]} is outside this cache")
    moves = [
        (tensor.data_ptr() + d * stride, source.address + offset + s * stride, n * stride)
        for offset, tensor in zip(blocks.region_offsets, destination, strict=True)
        for s, d, n in runs
    ]
    shares = split_moves(moves, threads)
    helpers = [threading.Thread(target=_move, args=(share,), name="kv-copy") for share in shares[1:]]
    for helper in helpers:
        helper.start()
    try:
        _move(shares[0] if shares else [])
    finally:
        for helper in helpers:
            helper.join()  # the copy writes destination blocks: it ends before the pull does
    return sum(size for _, _, size in moves)


Move = tuple[int, int, int]  # (destination address, source address, bytes)


def split_moves(moves: Sequence[Move], parts: int) -> list[list[Move]]:
    """`moves` cut into at most `parts` lists of (nearly) equal bytes, in order; a move may be cut in
    two where a share ends. Shares under 1 MiB are not worth a thread: fewer parts then."""
    total = sum(size for _, _, size in moves)
    parts = max(1, min(parts, total // _MIN_SHARE_BYTES))
    share = -(-total // parts)
    shares: list[list[Move]] = [[]]
    room = share
    for dst, src, size in moves:
        while size > 0:
            if room == 0:
                shares.append([])
                room = share
            take = min(size, room)
            shares[-1].append((dst, src, take))
            dst, src, size, room = dst + take, src + take, size - take, room - take
    return [part for part in shares if part]


_MIN_SHARE_BYTES = 1 << 20


def _move(moves: Sequence[Move]) -> None:
    for dst, src, size in moves:
        ctypes.memmove(dst, src, size)
