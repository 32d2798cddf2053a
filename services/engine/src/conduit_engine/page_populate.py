"""Having the kernel map a memory range's pages ahead of use, from a daemon thread (madvise in chunks,
the GIL released for each call), so that the first touch of a page on a hot path does not fault.

Populating never changes what a page holds, so it runs safely beside whoever reads or writes the range.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Sequence

log = logging.getLogger(__name__)

# Linux 5.14+: populate (allocate and map) pages readable / writable, leaving their contents as they are.
MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23
_CHUNK = 4 << 20


def populate_in_background(
    ranges: Sequence[tuple[int, int]], advice: int, name: str, stop: threading.Event | None = None
) -> threading.Thread | None:
    """Populate each (address, bytes) of `ranges` with `advice` from a daemon thread named `name`; it
    ends early once `stop` is set. None without madvise."""
    if not ranges:
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)

    def populate() -> None:
        for start, size in ranges:
            for offset in range(0, size, _CHUNK):  # ctypes releases the GIL for each call
                if stop is not None and stop.is_set():
                    return
                if madvise(start + offset, min(_CHUNK, size - offset), advice):
                    log.debug("pages are mapped on first touch (madvise: errno %d)", ctypes.get_errno())
                    return

    thread = threading.Thread(target=populate, name=name, daemon=True)
    thread.start()
    return thread
