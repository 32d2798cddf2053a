"""A real redis-server on 127.0.0.1 and a free port, without persistence, for the response store tests
(`make test` installs Debian's redis-server when it is missing)."""

from __future__ import annotations

import socket
import tempfile

from tests.support.processes import ManagedProcess, free_port
from tests.support.shared import require_executable

START_TIMEOUT_S = 30.0


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            # Without the password Redis answers -NOAUTH: it is up all the same.
            return sock.recv(64).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


def start_redis(port: int | None = None, password: str | None = None) -> ManagedProcess:
    """redis-server on `port` (a free one by default), answering PING (with `password`: requiring it)."""
    binary = require_executable("redis-server", "the Redis response store tests run a real Redis")
    port = port or free_port()
    folder = tempfile.mkdtemp(prefix="conduit-redis-")
    args = [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]
    args += ["--dir", folder, "--protected-mode", "no"]
    if password is not None:
        args += ["--requirepass", password]
    process = ManagedProcess("redis", args, port)
    try:
        process.wait_ready(lambda: _answers_ping(port), START_TIMEOUT_S)
    except BaseException:
        process.stop()
        raise
    return process
