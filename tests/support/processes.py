"""Real engine and gateway processes on 127.0.0.1 for integration tests and benchmarks.

`start_engine` waits until grpc.health.v1 says SERVING, `start_gateway` until GET /health answers 200;
both raise with the tail of the process's output when it exits or does not get ready in time.
"""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import grpc

from tests.support.health import engine_serving, gateway_health
from tests.support.shared import REPO_ROOT, require_shared, shared_dir

__all__ = [
    "ManagedProcess",
    "ProcessStartError",
    "free_port",
    "require_shared",
    "shared_dir",
    "start_engine",
    "start_gateway",
]

ENGINE_START_TIMEOUT_S = 180.0
GATEWAY_START_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0


class ProcessStartError(RuntimeError):
    """A process exited or did not become ready; the message ends with its output's tail."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago. Under pytest-xdist each worker takes only the
    ports of its own residue, so that two workers never pick the same one between its release here and
    its server binding it. (Linux hands bind() odd ports by preference: the residue is of port // 2.)"""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if (port // 2) % workers == index % workers:
            return port


class ManagedProcess:
    """A child process listening on 127.0.0.1:`port`; output goes to a log file (no pipe to fill up)."""

    def __init__(
        self, name: str, args: Sequence[str], port: int, env: Mapping[str, str] | None = None
    ) -> None:
        self.name = name
        self.args = list(args)
        self.port = port
        self.host = "127.0.0.1"
        self.scheme = "http"
        self._log = tempfile.NamedTemporaryFile(prefix=f"conduit-{name}-", suffix=".log", delete=False)
        self.log_path = Path(self._log.name)
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.process = subprocess.Popen(
            self.args,
            cwd=REPO_ROOT,
            env=full_env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.address}"

    def output_tail(self, max_chars: int = 4000) -> str:
        if not self._log.closed:  # still usable after stop(), which closes the log
            self._log.flush()
        text = self.log_path.read_text(errors="replace")
        return text[-max_chars:]

    def wait_ready(self, probe: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise ProcessStartError(
                    f"{self.name} exited with code {self.process.returncode} before it was ready; "
                    f"output:\n{self.output_tail()}"
                )
            if probe():
                return
            if time.monotonic() > deadline:
                self.kill()
                raise ProcessStartError(
                    f"{self.name} was not ready within {timeout_s:.0f}s; output:\n{self.output_tail()}"
                )
            time.sleep(0.2)

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited after `grace_s`; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        return self.process.returncode

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)

    def __enter__(self) -> ManagedProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def start_engine(
    model: str | Path,
    *extra_args: str,
    env: Mapping[str, str] | None = None,
    timeout_s: float = ENGINE_START_TIMEOUT_S,
    credentials: grpc.ChannelCredentials | None = None,
) -> ManagedProcess:
    """`python -m conduit_engine --model MODEL --host 127.0.0.1 --port <free> [extra_args]`, SERVING.

    `credentials`: how the readiness probe reaches an engine started with --tls-cert.
    """
    port = free_port()
    args = [
        sys.executable,
        "-m",
        "conduit_engine.entrypoints.cli",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
    ]
    args += ["--port", str(port), *extra_args]
    process = ManagedProcess("engine", args, port, env)
    try:
        process.wait_ready(lambda: engine_serving(process.address, credentials=credentials), timeout_s)
    except BaseException:
        process.stop()
        raise
    return process


def _gateway_ready(url: str, healthy: bool, verify: ssl.SSLContext | bool) -> bool:
    status = gateway_health(url, verify=verify)
    return status == 200 if healthy else status is not None


def start_gateway(
    engine_addresses: str | Sequence[str],
    *extra_args: str,
    env: Mapping[str, str] | None = None,
    wait_healthy: bool = True,
    timeout_s: float = GATEWAY_START_TIMEOUT_S,
    https_ca: Path | None = None,
) -> ManagedProcess:
    """`python -m conduit_gateway.cli --engine A,B --host 127.0.0.1 --port <free> [extra_args]`.

    Waits for GET /health 200 (an engine is SERVING); with wait_healthy=False, for any answer.
    `https_ca`: the gateway serves HTTPS (--tls-cert) with a certificate this CA signed.
    """
    engines = engine_addresses if isinstance(engine_addresses, str) else ",".join(engine_addresses)
    port = free_port()
    args = [sys.executable, "-m", "conduit_gateway.cli", "--engine", engines, "--host", "127.0.0.1"]
    args += ["--port", str(port), *extra_args]
    process = ManagedProcess("gateway", args, port, env)
    verify: ssl.SSLContext | bool = True
    if https_ca is not None:
        process.scheme = "https"
        verify = ssl.create_default_context(cafile=str(https_ca))
    try:
        process.wait_ready(lambda: _gateway_ready(process.url, wait_healthy, verify), timeout_s)
    except BaseException:
        process.stop()
        raise
    return process
