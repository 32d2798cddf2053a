"""Run a real EngineServer (grpc.aio, 127.0.0.1, free port) in a background thread for tests."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from conduit.engine.v1 import engine_pb2_grpc
from conduit_engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, ServerConfig
from conduit_engine.entrypoints.server import EngineServer


class ServerThread:
    def __init__(
        self,
        config: EngineConfig,
        before_start: Callable[[EngineServer], None] | None = None,
        **server_options: Any,
    ) -> None:
        """`server_options`: EngineServer's keyword arguments (tracer_provider)."""
        self.config = config
        self._server_options = server_options
        self.server: EngineServer | None = None
        self.loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._before_start = before_start
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.server = EngineServer(self.config, **self._server_options)
            if self._before_start is not None:
                self._before_start(self.server)
            self.loop.run_until_complete(self.server.start())
        except BaseException as exc:
            self._error = exc
        finally:
            self._started.set()
        if self._error is None:
            self.loop.run_forever()

    def start(self, wait: bool = True) -> ServerThread:
        self._thread.start()
        if wait:
            self.wait_started()
        return self

    def wait_started(self) -> None:
        self._started.wait(timeout=300)
        if self._error is not None:
            raise self._error

    @property
    def address(self) -> str:
        assert self.server is not None
        return f"127.0.0.1:{self.server.port}"

    def stub(self) -> engine_pb2_grpc.EngineStub:
        return engine_pb2_grpc.EngineStub(grpc.insecure_channel(self.address))

    def check_integrity(self) -> None:
        """Run the block manager's integrity check on the engine thread (raises AssertionError)."""
        assert self.server is not None and self.server.async_engine is not None
        async_engine = self.server.async_engine
        asyncio.run_coroutine_threadsafe(
            async_engine.run_sync(async_engine.core.check_integrity), self.loop
        ).result(30)

    @property
    def metrics_url(self) -> str:
        """The engine's /metrics (its config has a metrics_port; 0 picks a free one)."""
        assert self.server is not None and self.server.telemetry.metrics_port is not None
        return f"http://127.0.0.1:{self.server.telemetry.metrics_port}/metrics"

    def stop(self) -> None:
        if self.server is not None and self._error is None:
            fut = asyncio.run_coroutine_threadsafe(self.server.drain_and_stop(), self.loop)
            fut.result(timeout=60)
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)


def engine_config(model, **scheduler) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(path=str(model)),
        cache=CacheConfig(num_blocks=128, block_size=16),
        scheduler=SchedulerConfig(**scheduler),
        server=ServerConfig(host="127.0.0.1", port=0, drain_seconds=5),
    )


def wait_until(predicate, attempts=200, delay=0.05):
    for _ in range(attempts):
        if predicate():
            return True
        time.sleep(delay)
    return predicate()
