"""The real Envoy as a process on 127.0.0.1 with deploy/envoy/envoy.yaml rewritten for loopback ports."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.deploy import envoy_config
from tests.deploy.paths import tool
from tests.support.processes import ManagedProcess, free_port

START_TIMEOUT_S = 60.0


@dataclass
class EnvoyProxy:
    process: ManagedProcess
    http_port: int
    grpc_port: int
    admin_port: int

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def health_flags(self, cluster: str) -> dict[str, str]:
        """host:port → health flags of every host of `cluster`, from the admin /clusters page."""
        text = httpx.get(f"{self.admin_url}/clusters", timeout=5.0).text
        flags: dict[str, str] = {}
        for line in text.splitlines():
            parts = line.split("::")
            if len(parts) == 4 and parts[0] == cluster and parts[2] == "health_flags":
                flags[parts[1]] = parts[3]
        return flags

    def wait_for_health(
        self, cluster: str, host: str, flags: str, timeout_s: float = START_TIMEOUT_S
    ) -> None:
        """Poll the admin page until `host` of `cluster` shows `flags` (a bounded wait, not a timing test)."""
        deadline = time.monotonic() + timeout_s
        while self.health_flags(cluster).get(host) != flags:
            assert self.process.process.poll() is None, f"envoy exited:\n{self.process.output_tail()}"
            assert time.monotonic() < deadline, (
                f"{cluster}/{host} never showed {flags!r}; now {self.health_flags(cluster)}"
            )
            time.sleep(0.2)

    def access_log(self) -> list[dict[str, str]]:
        """The JSON access-log lines Envoy has written to its stdout so far."""
        entries = []
        for line in self.process.output_tail(max_chars=1_000_000).splitlines():
            if line.startswith("{"):
                entries.append(json.loads(line))
        return entries

    def stop(self) -> None:
        self.process.stop()


def start_envoy(
    directory: Path, *, gateway_port: int, engine_port: int, config: dict[str, Any] | None = None
) -> EnvoyProxy:
    """Envoy on the shipped config (or `config`, e.g. the chart's): listeners and admin on free loopback
    ports, upstreams on the given ones."""
    ports = {"http_port": free_port(), "grpc_port": free_port(), "admin_port": free_port()}
    config = envoy_config.loopback(
        config if config is not None else envoy_config.load(),
        gateway_port=gateway_port,
        engine_port=engine_port,
        **ports,
    )
    path = directory / "envoy.yaml"
    path.write_text(yaml.safe_dump(config))
    args = [
        str(tool("envoy")),
        "-c",
        str(path),
        "--disable-hot-restart",
        "--concurrency",
        "1",
        "--log-level",
        "warn",
    ]
    process = ManagedProcess("envoy", args, ports["http_port"])
    proxy = EnvoyProxy(process=process, **ports)

    def admin_ready() -> bool:
        try:
            return httpx.get(f"{proxy.admin_url}/ready", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        process.wait_ready(admin_ready, START_TIMEOUT_S)
    except BaseException:
        process.stop()
        raise
    return proxy


@contextmanager
def stack_behind_envoy(
    directory: Path,
    start_engine: Callable[[], ManagedProcess],
    start_gateway: Callable[[ManagedProcess], ManagedProcess],
    config: dict[str, Any] | None = None,
) -> Iterator[tuple[ManagedProcess, ManagedProcess, EnvoyProxy]]:
    """An engine, a gateway in front of it, and Envoy (`config`, default the shipped one) in front of
    both, once Envoy's health checks pass for each; everything is stopped at the end."""
    started: list[ManagedProcess | EnvoyProxy] = []
    try:
        engine = start_engine()
        started.append(engine)
        gateway = start_gateway(engine)
        started.append(gateway)
        envoy = start_envoy(directory, gateway_port=gateway.port, engine_port=engine.port, config=config)
        started.append(envoy)
        envoy.wait_for_health("engine", engine.address, "healthy")
        envoy.wait_for_health("gateway", gateway.address, "healthy")
        yield engine, gateway, envoy
    finally:
        for process in reversed(started):
            process.stop()
