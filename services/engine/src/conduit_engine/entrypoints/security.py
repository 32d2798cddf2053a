"""Who may call the engine: TLS or mTLS on its port, a bearer token on every RPC (health exempt;
reflection exempt with --reflection-public), and re-reading those files on SIGHUP.

A reload affects what comes next: new connections get the new certificate, new calls are checked
against the new token. Open connections and the streams on them go on undisturbed.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

from conduit_common.engine_dialer import EngineDialer
from conduit_common.grpc_tls import ServerTls, ServerTlsFiles
from conduit_common.secret_files import SecretFileError, TokenFile
from conduit_engine.config import SecurityConfig

log = logging.getLogger(__name__)

HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_PREFIXES = ("/grpc.reflection.v1alpha.ServerReflection/", "/grpc.reflection.v1.ServerReflection/")
MISSING_TOKEN = "missing authorization metadata: send 'authorization: Bearer <token>'"
MALFORMED_TOKEN = "authorization metadata must read 'Bearer <token>'"
WRONG_TOKEN = "invalid bearer token"


def token_problem(token: TokenFile, metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    """Why the call's metadata does not present `token`, or None when it does."""
    values = [value for key, value in metadata or () if key == "authorization"]
    if not values:
        return MISSING_TOKEN
    scheme, _, presented = str(values[0]).partition(" ")
    if scheme.lower() != "bearer" or not presented.strip():
        return MALFORMED_TOKEN
    return None if token.matches(presented.strip()) else WRONG_TOKEN


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call that does not present the token with UNAUTHENTICATED, except `public` ones."""

    def __init__(self, token: TokenFile, public_prefixes: tuple[str, ...]) -> None:
        self._token = token
        self._public = public_prefixes

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        if method.startswith(self._public):
            return await continuation(handler_call_details)
        problem = token_problem(self._token, handler_call_details.invocation_metadata)
        if problem is None:
            return await continuation(handler_call_details)
        log.warning("refused %s: %s", method, problem)
        return _refusal(await continuation(handler_call_details), problem)


def _refusal(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that aborts UNAUTHENTICATED without reading the request
    (an unknown method gets UNAUTHENTICATED too: callers without the token learn nothing)."""

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - abort raises

    if handler is None or handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(deny)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(deny_stream)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(deny)
    return grpc.stream_stream_rpc_method_handler(deny_stream)


class ServerSecurity:
    """The engine port's TLS and token, from SecurityConfig (files read here: SecretFileError names the
    flag of a file that cannot be used)."""

    def __init__(self, config: SecurityConfig) -> None:
        self.tls: ServerTls | None = None
        if config.tls_cert is not None and config.tls_key is not None:
            self.tls = ServerTls(ServerTlsFiles(config.tls_cert, config.tls_key, config.tls_client_ca))
        self.token = (
            TokenFile("--auth-token-file", config.auth_token_file) if config.auth_token_file else None
        )
        self.reflection_public = config.reflection_public

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        if self.token is None:
            return []
        public = (HEALTH_PREFIX, *(REFLECTION_PREFIXES if self.reflection_public else ()))
        return [TokenAuthInterceptor(self.token, public)]

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        if self.tls is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, self.tls.credentials)

    def describe(self) -> str:
        transport = "plaintext"
        if self.tls is not None:
            transport = "mTLS" if self.tls.files.client_ca is not None else "TLS"
        return f"{transport}, {'bearer token required' if self.token is not None else 'no token'}"

    def reload(self) -> None:
        """SIGHUP: re-read the certificate files and the token; a file that fails keeps the old one."""
        for name, source in (("TLS certificate", self.tls), ("auth token", self.token)):
            if source is None:
                continue
            try:
                source.reload()
            except SecretFileError as exc:
                log.error("SIGHUP: keeping the previous %s: %s", name, exc)
            else:
                log.info("SIGHUP: re-read the %s", name)


def engine_dialer(config: SecurityConfig) -> EngineDialer:
    """How this engine dials other engines (PullKv), from its --engine-tls-* / --engine-auth-token-file."""
    return EngineDialer.from_flags(
        ca=config.engine_tls_ca,
        cert=config.engine_tls_cert,
        key=config.engine_tls_key,
        server_name=config.engine_tls_server_name,
        token_file=config.engine_auth_token_file,
    )
