"""The real gateway app (uvicorn on 127.0.0.1, a free port) in a background thread, built from a
GatewayConfig plus what only an in-process app can take: an injected DNS resolver, clock and tracer
provider."""

from __future__ import annotations

import threading
import time

import uvicorn
from opentelemetry.sdk.trace import TracerProvider

from conduit_gateway.config import GatewayConfig
from conduit_gateway.http.app import create_app
from conduit_gateway.http.protocol import bounded_http_protocol
from conduit_gateway.keys.rate_limit import Clock
from conduit_gateway.routing.discovery import Resolver
from tests.support.processes import free_port

__all__ = ["GatewayThread"]


class GatewayThread:
    """The gateway for `engines` with any GatewayConfig overrides; `url` is its base URL."""

    def __init__(
        self,
        engines: list[str],
        resolver: Resolver | None = None,
        clock: Clock = time.monotonic,
        tracer_provider: TracerProvider | None = None,
        **overrides: object,
    ) -> None:
        """`clock` replaces the rate limits' time source (a ManualClock drives them exactly);
        `tracer_provider` receives the app's spans (tests read them with an in-memory exporter)."""
        self.port = free_port()
        self.config = GatewayConfig(engines=tuple(engines), host="127.0.0.1", port=self.port, **overrides)
        self.app = create_app(self.config, resolver=resolver, clock=clock, tracer_provider=tracer_provider)
        self._server = uvicorn.Server(
            uvicorn.Config(
                self.app,
                host="127.0.0.1",
                port=self.port,
                loop="asyncio",
                log_level="warning",
                # The gateway's own HTTP protocol, as `conduit-gateway` serves: its bounds, and the body
                # writer that streamed responses write through (pushed and coalesced chunks).
                http=bounded_http_protocol(self.config.max_header_bytes, self.config.header_timeout_s),
            )
        )
        self._thread = threading.Thread(target=self._server.run, name="gateway", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ctx(self):
        return self.app.state.ctx

    def start(self) -> GatewayThread:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the in-process gateway did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)

    def __enter__(self) -> GatewayThread:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
