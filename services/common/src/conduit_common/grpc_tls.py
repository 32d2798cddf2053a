"""TLS for gRPC: server credentials that re-read their files on demand, and client channel credentials.

A server's certificate, key and client CA are checked with Python's ssl module when read (a key that
does not match its certificate fails here, naming the flag, rather than at the first handshake). The
server credentials are gRPC's dynamic ones: gRPC asks for the configuration at every new handshake,
so after `reload()` new connections get the new files while open connections (and their streams) keep
the ones they were made with.
"""

from __future__ import annotations

import ssl
import threading
from dataclasses import dataclass

import grpc

from conduit_common.secret_files import SecretFileError, read_secret_file


def _check_pair(cert_flag: str, cert: str, key: str) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as exc:
        raise SecretFileError(
            f"{cert_flag}: {cert} with its key {key} is not a usable certificate and private key ({exc})"
        ) from None


def _check_ca(flag: str, path: str, data: bytes) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(cadata=data.decode("ascii", errors="replace"))
    except (ssl.SSLError, ValueError) as exc:
        raise SecretFileError(f"{flag}: {path} holds no PEM CA certificate ({exc})") from None


@dataclass(frozen=True, slots=True)
class ServerTlsFiles:
    """--tls-cert, --tls-key, and --tls-client-ca (set: clients must present a certificate it signed)."""

    cert: str
    key: str
    client_ca: str | None = None


class ServerTls:
    """Dynamic gRPC server credentials over `files`; `reload()` re-reads them for new handshakes."""

    def __init__(self, files: ServerTlsFiles) -> None:
        self.files = files
        self._lock = threading.Lock()
        self._pending: grpc.ServerCertificateConfiguration | None = None
        self.credentials = grpc.dynamic_ssl_server_credentials(
            self._configuration(),
            self._fetch,
            require_client_authentication=files.client_ca is not None,
        )

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        files = self.files
        cert = read_secret_file("--tls-cert", files.cert)
        key = read_secret_file("--tls-key", files.key)
        _check_pair("--tls-cert", files.cert, files.key)
        client_ca = None
        if files.client_ca is not None:
            client_ca = read_secret_file("--tls-client-ca", files.client_ca)
            _check_ca("--tls-client-ca", files.client_ca, client_ca)
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=client_ca)

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        # Called by gRPC before each handshake: None keeps the configuration in use.
        with self._lock:
            pending, self._pending = self._pending, None
        return pending

    def reload(self) -> None:
        """Read the files again (SecretFileError, and the old ones stay, when they are not usable)."""
        configuration = self._configuration()
        with self._lock:
            self._pending = configuration


@dataclass(frozen=True, slots=True)
class ClientTlsFiles:
    """How a client checks a server (`ca`) and, for mTLS, proves itself (`cert` + `key`).

    `server_name` is the name the server's certificate must carry when it differs from the address's
    host (engines found by DNS are dialled by IP address).
    """

    ca: str
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None
    flag_prefix: str = "--engine-tls"

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise SecretFileError(
                f"{self.flag_prefix}-cert and {self.flag_prefix}-key: give both (a client certificate "
                "and its key) or neither"
            )

    def credentials(self) -> grpc.ChannelCredentials:
        """Channel credentials from the files (read now; SecretFileError naming the flag)."""
        prefix = self.flag_prefix
        ca = read_secret_file(f"{prefix}-ca", self.ca)
        _check_ca(f"{prefix}-ca", self.ca, ca)
        cert = key = None
        if self.cert is not None and self.key is not None:
            cert = read_secret_file(f"{prefix}-cert", self.cert)
            key = read_secret_file(f"{prefix}-key", self.key)
            _check_pair(f"{prefix}-cert", self.cert, self.key)
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
