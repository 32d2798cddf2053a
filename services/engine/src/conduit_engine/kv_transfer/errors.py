"""What a KV transfer can fail with; each error names the gRPC status code it travels as."""

from __future__ import annotations

from conduit_engine.errors import EngineError


class KvTransferError(EngineError):
    """A KV transfer failed. A decode engine that sees one recomputes the prompt itself."""

    grpc_code = "INTERNAL"  # a grpc.StatusCode name; errors.py stays free of grpc


class KvTransferNotFoundError(KvTransferError):
    """The transfer id is unknown here, or was already pulled, released or expired (→ NOT_FOUND)."""

    grpc_code = "NOT_FOUND"


class KvLayoutMismatchError(KvTransferError):
    """The puller's KV layout fingerprint differs from the source's (→ FAILED_PRECONDITION)."""

    grpc_code = "FAILED_PRECONDITION"


class KvSourceUnavailableError(KvTransferError):
    """The source engine cannot be reached or did not answer in time (→ UNAVAILABLE)."""

    grpc_code = "UNAVAILABLE"


class KvTransportUnavailableError(KvTransferError):
    """The source (or this engine) cannot move this pull's blocks the way asked: no shared memory with
    it, NIXL not initialised, a segment it cannot open (→ UNIMPLEMENTED). The puller pulls over gRPC."""

    grpc_code = "UNIMPLEMENTED"
