"""Waiting for a piece of work unless something else happens first (a client leaving, a rewatch request):
the one race the HTTP streams, the request routes and the health watch all run."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any


async def finished_first(work: asyncio.Future[Any], interrupt: Awaitable[Any]) -> bool:
    """Wait until `work` is done or `interrupt` completes; True when `work` is done.

    `interrupt` is cancelled either way; `work` is left as it is, so the caller decides whether to cancel
    it (and how to clean up after it).
    """
    stop = asyncio.ensure_future(interrupt)
    try:
        await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
    return work.done()
