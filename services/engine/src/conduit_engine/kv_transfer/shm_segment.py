"""Shared-memory segments for same-host KV transfers (--kv-transport shm): files in /dev/shm, mapped.

A pull's segment belongs to the puller: it creates it (its whole size reserved up front, so a full
/dev/shm is an error at creation, not a SIGBUS while writing), names it in its PullKv request, reads each
chunk out of it into its cache and unlinks it when the pull ends, however it ends (completed, failed,
cancelled). The source only opens an existing segment by name and writes into it; the name must match
`conduit-kv-<32 hex digits>` (no path, no other file). So a segment serves one pull, and no transfer's
lease, release or expiry can leave one behind (ShmKvTransport makes the next pull's segment ahead, named
to no source until that pull).

`shm_host_id` is how two engines agree they share that memory: the host's boot id (unique per host and
boot) plus the device and inode of the /dev/shm mount (containers on one host each get their own unless
they share it). Equal strings mean the same tmpfs.
"""

from __future__ import annotations

import mmap
import os
import re
import uuid
from pathlib import Path

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "conduit-kv-"
_NAME = re.compile(r"conduit-kv-[0-9a-f]{32}")
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
# Shared, and every page mapped up front (one kernel call, not a page fault per 4 KiB during the copy).
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def shm_host_id(shm_dir: Path = SHM_DIR) -> str | None:
    """This engine's host and /dev/shm identity (KvSourceTransports.shm_host); None without either."""
    try:
        boot_id = _BOOT_ID.read_text().strip()
        st = shm_dir.stat()
    except OSError:
        return None
    return f"{boot_id}:{st.st_dev}:{st.st_ino}"


def is_segment_name(name: str) -> bool:
    return _NAME.fullmatch(name) is not None


class ShmSegment:
    """One mapped segment; `view` is writable memory of exactly `size` bytes."""

    def __init__(self, name: str, size: int, owner: bool, shm_dir: Path = SHM_DIR) -> None:
        self.name, self.size, self.owner = name, size, owner
        self._path = shm_dir / name
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if owner else 0)
        fd = os.open(self._path, flags, 0o600)
        try:
            if owner:
                os.posix_fallocate(fd, 0, size)  # ENOSPC now rather than SIGBUS on a write
            elif os.fstat(fd).st_size < size:
                raise ValueError(
                    f"shm_segment: {name} holds {os.fstat(fd).st_size} bytes, the pull needs {size}"
                )
            self._map = mmap.mmap(fd, size, flags=_MAP_FLAGS)
        except BaseException:
            os.close(fd)
            if owner:
                self._unlink()
            raise
        os.close(fd)
        self.view = memoryview(self._map)

    @classmethod
    def create(cls, size: int, shm_dir: Path = SHM_DIR) -> ShmSegment:
        """A fresh segment of `size` bytes (> 0) that this process owns (and unlinks on close)."""
        return cls(f"{SEGMENT_PREFIX}{uuid.uuid4().hex}", size, owner=True, shm_dir=shm_dir)

    @classmethod
    def open(cls, name: str, size: int, shm_dir: Path = SHM_DIR) -> ShmSegment:
        """A puller's segment `name` (ValueError unless a segment name of at least `size` bytes)."""
        if not is_segment_name(name):
            raise ValueError(f"shm_segment: expected {SEGMENT_PREFIX}<32 hex digits>, got {name!r}")
        return cls(name, size, owner=False, shm_dir=shm_dir)

    def close(self) -> None:
        """Unmap (once nothing views the memory any more) and, for the owner, unlink the segment."""
        try:
            self.view.release()
            self._map.close()
        except BufferError:  # a tensor still views it: the mapping goes with that tensor
            pass
        if self.owner:
            self._unlink()

    def _unlink(self) -> None:
        try:
            os.unlink(self._path)
        except FileNotFoundError:
            pass
