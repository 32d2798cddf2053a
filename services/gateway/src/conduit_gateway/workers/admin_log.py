"""The admin API across workers: every change to the pool is a line appended to one shared log, and
every worker applies the lines the others wrote, in order.

A worker that answers an admin request holds the log's exclusive lock while it catches up (applies
what the others wrote), checks the request against the pool it now has, changes its own pool and
appends the change; so two workers' changes never interleave, and 409s (`node_exists`,
`too_many_nodes`) see every worker's changes. The others catch up within `POLL_S` (a task that watches
the file's size), and before they answer any admin request. A worker that starts (or replaces one that
died) replays the whole log after adding its static nodes, so it reaches the same pool as its siblings.
Entries are changes, not state: a node found by DNS and removed through the API comes back in each
worker at its next resolution, as in one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Callable, Iterator

from conduit_gateway.config import ConfigError
from conduit_gateway.routing.node import NodeSource
from conduit_gateway.routing.pool import DuplicateNodeError, EnginePool, UnknownNodeError
from conduit_gateway.routing.roles import NodeRole

log = logging.getLogger(__name__)

POLL_S = 0.2

Record = Callable[..., None]


class AdminLog:
    """The shared log at `path` as one worker sees it: `offset` is how much of it its pool reflects."""

    def __init__(self, path: str, pool: EnginePool) -> None:
        self.path = path
        self.pool = pool
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        self.offset = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Replay the log (after the pool's static nodes joined), then follow it."""
        self.catch_up()
        self._task = asyncio.create_task(self._follow(), name="admin-log")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        os.close(self._fd)

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            try:
                if os.fstat(self._fd).st_size > self.offset:
                    self.catch_up()
            except Exception:  # keep following: one bad change must not stop the next ones
                log.exception("admin log: could not apply the other workers' changes")

    def catch_up(self) -> None:
        with self._locked(fcntl.LOCK_SH):
            self._apply_new()

    @contextlib.contextmanager
    def change(self) -> Iterator[Record]:
        """Hold the log while an admin request changes the pool: `record(op, address, role=...)` appends
        a change once the block ends without an error."""
        entries: list[dict[str, str]] = []

        def record(op: str, address: str, role: str | None = None) -> None:
            entries.append({"op": op, "address": address, **({"role": role} if role else {})})

        with self._locked(fcntl.LOCK_EX):
            self._apply_new()
            yield record
            if entries:
                data = "".join(json.dumps(entry) + "\n" for entry in entries).encode()
                os.write(self._fd, data)
                self.offset = os.fstat(self._fd).st_size  # its own lines are applied already

    @contextlib.contextmanager
    def _locked(self, mode: int) -> Iterator[None]:
        fcntl.flock(self._fd, mode)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _apply_new(self) -> None:
        size = os.fstat(self._fd).st_size
        if size <= self.offset:
            return
        data = os.pread(self._fd, size - self.offset, self.offset)
        self.offset = size
        for line in data.decode().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                log.error("admin log: skipping a line that is not JSON: %r", line[:200])
                continue
            self._apply(entry)

    def _apply(self, entry: dict[str, str]) -> None:
        op, address, pool = entry["op"], entry["address"], self.pool
        try:
            if op == "add":
                pool.add(address, NodeSource.ADMIN, NodeRole(entry.get("role", NodeRole.COLOCATED.value)))
            elif op == "remove":
                pool.remove(address)
            elif op == "drain":
                pool.drain(address)
            elif op == "resume":
                pool.resume(address)
        except (DuplicateNodeError, UnknownNodeError, ConfigError) as exc:
            # A sibling's change this worker's pool already reflects (or cannot: e.g. a DNS node gone).
            log.debug("admin log: %s %s: %s", op, address, exc)
