"""`conduit-gateway --workers N` (N > 1): a supervisor process that runs N gateway workers on one port.

Each worker is a whole gateway (its own engine pool, health watches, DNS discovery and event loop) that
binds the ports with SO_REUSEPORT, so the kernel spreads connections over them. The supervisor
- binds the ports first (SO_REUSEPORT, never listening), so a port in use stops it before any worker
  starts, and port 0 becomes one port that every worker binds;
- makes the scratch directory the workers share (key limits, the admin log, metrics sockets;
  workers/slot.py), on /dev/shm where there is one, and removes it when it exits;
- starts the workers (fresh interpreters: `spawn`, no state forked), and starts again a worker that
  exits while it is not stopping, after a pause that doubles while it keeps dying young; a worker that
  exits before it ever served (a static engine refused at start, say) stops them all, as one gateway
  process would stop, and the supervisor exits 1;
- forwards SIGTERM (and SIGINT) as SIGTERM to every worker, so each drains as one gateway does
  (--shutdown-grace), and exits once all have: 0 when each ended cleanly, 1 otherwise;
- forwards SIGHUP, so each worker re-reads its keys file, token and certificate.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import time
from types import FrameType

from conduit_common import logs
from conduit_gateway.config import GatewayConfig
from conduit_gateway.keys.shared_limits import SharedLimitStates
from conduit_gateway.workers.slot import WorkerSlot

log = logging.getLogger("conduit_gateway.workers")

FIRST_RESTART_PAUSE_S = 0.5
MAX_RESTART_PAUSE_S = 30.0
# A worker that ran this long before it died restarts after the first pause again.
HEALTHY_RUN_S = 30.0
_CLEAN_EXITS = (0, -signal.SIGTERM, -signal.SIGINT)


def run_worker(config: GatewayConfig, slot: WorkerSlot) -> None:
    """A worker process's body: one gateway, with what it shares with its siblings."""
    _stop_with_parent()
    # A SIGHUP forwarded before the app's handler is in (its lifespan) must not end the worker.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    logs.configure("DEBUG" if config.log_level == "trace" else config.log_level, config.log_format)
    from conduit_gateway.http.app import create_app
    from conduit_gateway.http.server import serve

    serve(config, create_app(config, worker=slot), reuse_port=True)


def _stop_with_parent() -> None:
    """SIGTERM this worker if the supervisor dies without forwarding one (killed with SIGKILL)."""
    parent = os.getppid()
    if sys.platform == "linux":
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


class Supervisor:
    """Starts, restarts and stops the workers; `run()` returns the exit status."""

    def __init__(self, config: GatewayConfig, directory: str) -> None:
        self.config = config
        self.directory = directory
        self._context = multiprocessing.get_context("spawn")
        self._workers: dict[int, multiprocessing.process.BaseProcess] = {}
        self._started: dict[int, float] = {}
        self._pause: dict[int, float] = {}
        self._due: dict[int, float] = {}  # index → when its restart is due
        self._stopping = False
        self._failed = False

    def _slot(self, index: int) -> WorkerSlot:
        return WorkerSlot(index, self.config.workers, self.directory)

    def _start(self, index: int) -> None:
        process = self._context.Process(
            target=run_worker,
            args=(self.config, self._slot(index)),
            name=f"conduit-gateway-worker-{index}",
        )
        process.start()
        self._workers[index] = process
        self._started[index] = time.monotonic()
        log.info("worker %d started (pid %d)", index, process.pid)

    def _signal_all(self, signum: int) -> None:
        for process in self._workers.values():
            if process.pid is not None and process.exitcode is None:
                os.kill(process.pid, signum)

    def _on_stop(self, signum: int, _frame: FrameType | None) -> None:
        if not self._stopping:
            log.info("%s: stopping %d worker(s)", signal.Signals(signum).name, len(self._workers))
        self._stop_all()

    def _stop_all(self) -> None:
        self._stopping = True
        self._due.clear()
        self._signal_all(signal.SIGTERM)

    def _on_hup(self, _signum: int, _frame: FrameType | None) -> None:
        self._signal_all(signal.SIGHUP)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_hup)
        for index in range(self.config.workers):
            self._start(index)
        while self._workers or self._due:
            sentinels = [process.sentinel for process in self._workers.values()]
            multiprocessing.connection.wait(sentinels, timeout=self._wait_s())
            self._reap()
            now = time.monotonic()
            for index, due in list(self._due.items()):
                if due <= now and not self._stopping:
                    del self._due[index]
                    self._start(index)
        return 1 if self._failed else 0

    def _wait_s(self) -> float:
        if not self._due:
            return 1.0
        return max(0.0, min(self._due.values()) - time.monotonic())

    def _reap(self) -> None:
        for index, process in list(self._workers.items()):
            code = process.exitcode
            if code is None:
                continue
            del self._workers[index]
            process.close()
            if self._stopping:
                log.info("worker %d exited (%s)", index, code)
                self._failed |= code not in _CLEAN_EXITS
                continue
            if not os.path.exists(self._slot(index).ready_path(index)):
                log.error("worker %d exited (%s) before it started serving; stopping the others", index, code)
                self._failed = True
                self._stop_all()
                continue
            ran = time.monotonic() - self._started[index]
            pause = self._pause.get(index, FIRST_RESTART_PAUSE_S)
            pause = FIRST_RESTART_PAUSE_S if ran >= HEALTHY_RUN_S else pause
            self._pause[index] = min(MAX_RESTART_PAUSE_S, pause * 2)
            log.error(
                "worker %d exited (%s) after %.1fs; starting it again in %.1fs", index, code, ran, pause
            )
            self._due[index] = time.monotonic() + pause


def supervise(config: GatewayConfig) -> int:
    """Run `config.workers` workers until SIGTERM; the exit status."""
    from conduit_gateway.http.server import bind_socket

    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    directory = tempfile.mkdtemp(prefix="conduit-gateway-", dir=shm)
    reserved = [bind_socket(config.host, config.port, reuse_port=True)]
    if config.admin_port is not None:
        reserved.append(bind_socket(config.host, config.admin_port, reuse_port=True))
    if config.response_store == "memory":
        log.warning(
            "--response-store memory is each worker's own: a stored response is found only by the worker "
            "that made it; give a redis:// store for --workers"
        )
    try:
        config = dataclasses.replace(config, port=reserved[0].getsockname()[1])
        SharedLimitStates.create(WorkerSlot(0, config.workers, directory).limits_path, config.workers)
        log.info(
            "serving on %s:%d with %d workers (shared state in %s)",
            config.host,
            config.port,
            config.workers,
            directory,
        )
        return Supervisor(config, directory).run()
    finally:
        for sock in reserved:
            sock.close()
        shutil.rmtree(directory, ignore_errors=True)
