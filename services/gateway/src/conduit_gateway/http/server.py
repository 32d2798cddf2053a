"""Serving the gateway app: uvicorn with the bounded HTTP protocol, HTTPS whose certificate SIGHUP
re-reads, and one listener per port (--port, and --admin-port when set) on one server and event loop.
Under --workers every worker runs this with its own SO_REUSEPORT listeners on the same ports.
"""

from __future__ import annotations

import socket
import ssl

import uvicorn
from fastapi import FastAPI

from conduit_common.secret_files import SecretFileError
from conduit_gateway.config import GatewayConfig
from conduit_gateway.http.protocol import bounded_http_protocol


class HttpsCertificate:
    """The HTTPS server context; `load()` (at start and on SIGHUP) swaps the certificate for new
    connections, after checking the files on a scratch context so that a bad pair changes nothing."""

    def __init__(self, cert: str, key: str) -> None:
        self.cert, self.key = cert, key
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self.context.set_alpn_protocols(["http/1.1"])
        self.load()

    def load(self) -> None:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(self.cert, self.key)
        except (ssl.SSLError, OSError) as exc:
            raise SecretFileError(
                f"--tls-cert: {self.cert} with --tls-key {self.key} is not a usable certificate and key "
                f"({exc})"
            ) from None
        self.context.load_cert_chain(self.cert, self.key)


def bind_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to host:port (SystemExit naming it when it cannot be); `reuse_port`: the
    workers of --workers each bind the port (SO_REUSEPORT), and the kernel spreads connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"conduit-gateway: cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def check_server_files(config: GatewayConfig) -> None:
    """SecretFileError unless the HTTPS certificate and key (when given) are usable."""
    if config.tls_cert is not None and config.tls_key is not None:
        HttpsCertificate(config.tls_cert, config.tls_key)


def build_server(
    config: GatewayConfig, app: FastAPI, reuse_port: bool = False
) -> tuple[uvicorn.Server, list[socket.socket]]:
    """The uvicorn server for `app` and its bound sockets (the API port, then the admin port)."""
    options: dict[str, object] = {}
    if config.tls_cert is not None and config.tls_key is not None:
        certificate = HttpsCertificate(config.tls_cert, config.tls_key)
        app.state.ctx.reload_hooks.append(certificate.load)
        options["ssl_context_factory"] = lambda _config, _default: certificate.context
    server_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        # grpc.aio runs on the standard asyncio loop; uvloop is not a supported grpc.aio loop.
        loop="asyncio",
        timeout_graceful_shutdown=config.shutdown_grace_s,
        http=bounded_http_protocol(config.max_header_bytes, config.header_timeout_s),
        # uvicorn's loggers go to the root handler, in --log-format like every other line.
        log_config=None,
        **options,  # type: ignore[arg-type]
    )
    ports = [config.port, *([config.admin_port] if config.admin_port is not None else [])]
    return uvicorn.Server(server_config), [bind_socket(config.host, port, reuse_port) for port in ports]


def serve(config: GatewayConfig, app: FastAPI, reuse_port: bool = False) -> None:
    server, sockets = build_server(config, app, reuse_port)
    server.run(sockets=sockets)
