"""How a service dials engines: plaintext or TLS (with a client certificate for mTLS), plus the bearer
token every call carries.

The gateway (towards its engines) and an engine (towards other engines: disaggregation's PullKv) both
use it, configured by the same flags: --engine-tls-ca, --engine-tls-cert, --engine-tls-key,
--engine-tls-server-name and --engine-auth-token-file.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from conduit_common.grpc_tls import ClientTlsFiles
from conduit_common.secret_files import SecretFileError, TokenFile

Metadata = tuple[tuple[str, str], ...]


class EngineDialer:
    """Channels to engines and the metadata that authenticates calls on them.

    Certificates are read once, here (a new client certificate needs a restart); the token is re-read
    by `reload()` (SIGHUP), and every call made after it presents the new one.
    """

    def __init__(self, tls: ClientTlsFiles | None = None, token: TokenFile | None = None) -> None:
        self.tls = tls
        self.token = token
        self._credentials = tls.credentials() if tls is not None else None

    @classmethod
    def from_flags(
        cls,
        *,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        server_name: str | None = None,
        token_file: str | None = None,
    ) -> EngineDialer:
        """From the --engine-tls-* and --engine-auth-token-file values (None: not given)."""
        if ca is None:
            given = [
                flag for flag, value in (("cert", cert), ("key", key), ("server-name", server_name)) if value
            ]
            if given:
                raise SecretFileError(
                    f"--engine-tls-{given[0]}: needs --engine-tls-ca (TLS towards the engines)"
                )
        tls = ClientTlsFiles(ca, cert, key, server_name) if ca is not None else None
        token = TokenFile("--engine-auth-token-file", token_file) if token_file is not None else None
        return cls(tls, token)

    @property
    def secure(self) -> bool:
        return self._credentials is not None

    def dial(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        """A grpc.aio channel to `address` (on the running event loop)."""
        if self._credentials is None:
            return grpc.aio.insecure_channel(address, options=list(options))
        extra: list[tuple[str, Any]] = []
        if self.tls is not None and self.tls.server_name:
            extra.append(("grpc.ssl_target_name_override", self.tls.server_name))
        return grpc.aio.secure_channel(address, self._credentials, options=[*options, *extra])

    def metadata(self, *extra: tuple[str, str]) -> Metadata:
        """`extra` plus the authorization entry (when a token is configured)."""
        return (*extra, *(self.token.metadata() if self.token is not None else ()))

    def reload(self) -> bool:
        """Re-read the token file; True when the token changed."""
        return self.token.reload() if self.token is not None else False


PLAINTEXT = EngineDialer()
