"""The engine's side of its worker processes: spawn them, talk to them in order, notice when one fails,
and leave none behind.

Workers are started with the `spawn` method: a fresh interpreter (fork + exec), so no worker inherits
the engine's threads, gRPC state or CUDA context, and spawning is safe whether or not gRPC has started.
Each worker gets two one-way pipes (commands in, replies out) and a rendezvous file for
torch.distributed. A monitor thread waits on the workers' process sentinels: a worker that dies,
while a step runs or while the engine is idle, records the failure and wakes the engine's listeners.

No orphans either way: the engine kills every worker when one fails and when it shuts down (SIGKILL
after a short grace); a worker's watchdog ends it when the engine is gone (parallel/worker.py).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection, wait

from conduit_engine.errors import WorkerFailedError
from conduit_engine.worker.wire import Frame, Kind, encode, receive
from conduit_engine.worker.worker_process import worker_main

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0
_MONITOR_DEFER_S = 0.2


class WorkerGroup:
    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size: must be >= 1, got {world_size}")
        ctx = multiprocessing.get_context("spawn")
        self.world_size = world_size
        self._store_dir = tempfile.mkdtemp(prefix="conduit-workers-")
        store = os.path.join(self._store_dir, "rendezvous")
        self._commands: list[Connection] = []
        self._replies: list[Connection] = []
        self._processes: list[multiprocessing.process.BaseProcess] = []
        for rank in range(world_size):
            command_r, command_w = ctx.Pipe(duplex=False)
            reply_r, reply_w = ctx.Pipe(duplex=False)
            process = ctx.Process(
                target=worker_main,
                args=(rank, world_size, command_r, reply_w, store),
                name=f"conduit-worker-{rank}",
                daemon=True,  # a backstop: multiprocessing terminates daemons when the interpreter exits
            )
            process.start()
            command_r.close()
            reply_w.close()
            self._commands.append(command_w)
            self._replies.append(reply_r)
            self._processes.append(process)
        self._lock = threading.Lock()
        self._failure: str | None = None
        self._listeners: list[Callable[[], None]] = []
        self._closing = False
        self._wake_r, self._wake_w = os.pipe()
        threading.Thread(target=self._watch, name="conduit-worker-monitor", daemon=True).start()
        log.info("started %d worker process(es): pids %s", world_size, self.pids)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes if p.pid is not None]

    @property
    def failure(self) -> str | None:
        """Why the group stopped working (the first failure seen), or None."""
        return self._failure

    def on_failure(self, listener: Callable[[], None]) -> None:
        """Call `listener` (on any thread) once a worker has failed."""
        self._listeners.append(listener)
        if self._failure is not None:
            listener()

    # ----- commands and answers ----------------------------------------------------------------------
    def send(self, data: bytes) -> None:
        """Send one frame to every worker, in rank order."""
        for rank in range(self.world_size):
            try:
                self._commands[rank].send_bytes(data)
            except OSError as exc:
                raise self._fail(self._death_reason(rank) or f"worker rank {rank}: {exc}") from exc

    def expect(self, kind: Kind, ranks: Iterable[int] = (0,)) -> dict[int, Frame]:
        """Wait for one `kind` frame from each of `ranks`. Any worker's death or ERROR raises
        WorkerFailedError (as does an unexpected frame)."""
        if self._failure is not None:
            raise WorkerFailedError(self._failure)
        pending, got = set(ranks), {}
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._processes)}
        while pending:
            ready = wait([*self._replies, *sentinels])
            for rank, conn in enumerate(self._replies):
                if conn in ready:
                    frame = self._read(rank)
                    if frame.kind is not kind or rank not in pending:
                        raise self._fail(f"worker rank {rank} sent {frame.kind.name}, expected {kind.name}")
                    got[rank] = frame
                    pending.discard(rank)
            for sentinel, rank in sentinels.items():
                if sentinel in ready:
                    raise self._fail(self._death_reason(rank) or f"worker rank {rank} exited")
        return got

    def _read(self, rank: int) -> Frame:
        try:
            frame = receive(self._replies[rank])
        except (EOFError, OSError) as exc:
            raise self._fail(self._death_reason(rank) or f"worker rank {rank} closed its pipe") from exc
        if frame.kind is Kind.ERROR:
            raise self._fail(f"worker rank {rank} failed: {frame.json()['error']}")
        return frame

    # ----- failures --------------------------------------------------------------------------------------
    def _death_reason(self, rank: int, read_error: bool = True) -> str | None:
        """How worker `rank` ended (the ERROR it sent before, when `read_error`: only the thread that
        reads the replies may), or None if it still runs."""
        process = self._processes[rank]
        process.join(timeout=0.5)
        if process.exitcode is None:
            return None
        if read_error and self._replies[rank].poll():
            try:
                frame = receive(self._replies[rank])
                if frame.kind is Kind.ERROR:
                    return f"worker rank {rank} failed: {frame.json()['error']}"
            except (EOFError, OSError):
                pass
        code = process.exitcode
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        return f"worker rank {rank} (pid {process.pid}) {how}"

    def _fail(self, reason: str) -> WorkerFailedError:
        """Record the group's first failure, kill the surviving workers (they may be blocked in a
        collective, or on a full pipe, with the failed one) and tell the listeners. The error to raise
        carries the first failure's reason, whichever thread saw it."""
        with self._lock:
            first = self._failure is None and not self._closing
            if first:
                self._failure = reason
        if first:
            log.error("%s: the engine cannot run the model any more", reason)
            for process in self._processes:
                if process.is_alive():
                    process.kill()
            for listener in self._listeners:
                listener()
        return WorkerFailedError(self._failure or reason)

    def _watch(self) -> None:
        """Monitor thread: the first worker death while nobody waits for an answer (an idle engine)."""
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._processes)}
        try:
            ready = wait([*sentinels, self._wake_r])
        finally:
            os.close(self._wake_r)
        # A step in flight reports the death itself, with the worker's own error: give it a moment.
        time.sleep(_MONITOR_DEFER_S)
        if self._closing or self._failure is not None:
            return
        for sentinel, rank in sentinels.items():
            if sentinel in ready:
                self._fail(self._death_reason(rank, read_error=False) or f"worker rank {rank} exited")
                return

    # ----- shutdown ----------------------------------------------------------------------------------------
    def shutdown(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        """Ask every worker to exit; kill those still running after `grace_s` (at once after a failure,
        when the survivors may be blocked in a collective). Idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass  # the monitor has already stopped
        os.close(self._wake_w)
        if self._failure is None:
            for conn in self._commands:
                try:
                    conn.send_bytes(encode(Kind.SHUTDOWN))
                except OSError:
                    pass
        else:
            grace_s = 0.0  # the survivors may be blocked in a collective with the dead one
        deadline = time.monotonic() + grace_s
        for process in self._processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in self._processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
        for conn in (*self._commands, *self._replies):
            conn.close()
        shutil.rmtree(self._store_dir, ignore_errors=True)
        log.info("worker processes stopped: exit codes %s", [p.exitcode for p in self._processes])
