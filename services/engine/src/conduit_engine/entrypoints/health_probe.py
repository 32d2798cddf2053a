"""`python -m conduit_engine.entrypoints.health_probe`: exit 0 when the engine at --address says SERVING.

For probes that cannot speak TLS themselves (the kubelet's gRPC probes are plaintext): with --ca it
dials TLS, and with --cert/--key it presents a client certificate (an engine under mTLS). Health needs
no token. Exit 1 when NOT_SERVING or unreachable, with the reason on stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conduit_common.grpc_tls import ClientTlsFiles
from conduit_common.secret_files import SecretFileError


def probe(address: str, tls: ClientTlsFiles | None, timeout_s: float) -> str | None:
    """None when SERVING, else why not."""
    if tls is None:
        channel = grpc.insecure_channel(address)
    else:
        options = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []
        channel = grpc.secure_channel(address, tls.credentials(), options=options)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return None


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m conduit_engine.entrypoints.health_probe", description=__doc__
    )
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--ca", help="PEM CA of the engine's certificate: dial TLS")
    parser.add_argument("--cert", help="PEM client certificate (the engine requires one: mTLS)")
    parser.add_argument("--key", help="PEM private key of --cert")
    parser.add_argument("--server-name", help="name the engine's certificate carries")
    parser.add_argument("--timeout", type=float, default=4.0)
    args = parser.parse_args(argv)
    try:
        tls = ClientTlsFiles(args.ca, args.cert, args.key, args.server_name, "-") if args.ca else None
        problem = probe(args.address, tls, args.timeout)
    except SecretFileError as exc:
        problem = str(exc)
    if problem is not None:
        print(f"engine {args.address} is not SERVING: {problem}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
