"""Test PKI made with `cryptography`: a CA, certificates it signs (server, client, expired), and an
unrelated CA, written as PEM files for the services under test. Nothing is committed; every test run
makes its own."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["CertPair", "TestPki", "bearer", "make_pki", "tls_channel"]

_NOW = datetime.datetime.now(datetime.UTC)


@dataclass(frozen=True)
class CertPair:
    """A certificate and its private key, as PEM files."""

    cert: Path
    key: Path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


class _Authority:
    def __init__(self, name: str) -> None:
        self.key = _key()
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(self.name)
            .issuer_name(self.name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(_NOW - datetime.timedelta(days=1))
            .not_valid_after(_NOW + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
            )
            .sign(self.key, hashes.SHA256())
        )

    def issue(
        self, common_name: str, *, server: bool, expired: bool = False, names: Sequence[str] = ()
    ) -> tuple[bytes, bytes]:
        key = _key()
        before, after = _NOW - datetime.timedelta(days=1), _NOW + datetime.timedelta(days=30)
        if expired:
            before, after = _NOW - datetime.timedelta(days=30), _NOW - datetime.timedelta(days=1)
        alt_names: list[x509.GeneralName] = [x509.DNSName(common_name), *map(x509.DNSName, names)]
        if server:
            alt_names += [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self.name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(before)
            .not_valid_after(after)
            .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


@dataclass(frozen=True)
class TestPki:
    """ca: the trusted CA; server/client: valid certificates it signed (the server's names: localhost,
    127.0.0.1 and conduit-engine); expired_server/expired_client: its certificates past their end;
    other_ca and rogue_client: an unrelated CA and a client certificate it signed."""

    ca: Path
    server: CertPair
    client: CertPair
    expired_server: CertPair
    expired_client: CertPair
    other_ca: Path
    rogue_client: CertPair
    other_server: CertPair


def make_pki(directory: Path, server_names: Sequence[str] = ()) -> TestPki:
    """A fresh PKI in `directory`; `server_names`: more DNS names of the valid server certificate."""
    directory.mkdir(parents=True, exist_ok=True)
    ca, other = _Authority("conduit test CA"), _Authority("some other CA")

    def pair(name: str, issued: tuple[bytes, bytes]) -> CertPair:
        cert, key = issued
        return CertPair(_write(directory / f"{name}.crt", cert), _write(directory / f"{name}.key", key))

    return TestPki(
        ca=_write(directory / "ca.crt", ca.cert.public_bytes(serialization.Encoding.PEM)),
        server=pair("server", ca.issue("conduit-engine", server=True, names=server_names)),
        client=pair("client", ca.issue("conduit-gateway", server=False)),
        expired_server=pair("expired-server", ca.issue("conduit-engine", server=True, expired=True)),
        expired_client=pair("expired-client", ca.issue("conduit-gateway", server=False, expired=True)),
        other_ca=_write(directory / "other-ca.crt", other.cert.public_bytes(serialization.Encoding.PEM)),
        rogue_client=pair("rogue-client", other.issue("intruder", server=False)),
        other_server=pair("other-server", other.issue("conduit-engine", server=True)),
    )


def tls_channel(address: str, ca: Path, client: CertPair | None = None) -> grpc.Channel:
    """A blocking gRPC channel that trusts `ca` and, given `client`, presents that certificate."""
    credentials = grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes(),
        private_key=client.key.read_bytes() if client is not None else None,
        certificate_chain=client.cert.read_bytes() if client is not None else None,
    )
    return grpc.secure_channel(address, credentials)


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)
