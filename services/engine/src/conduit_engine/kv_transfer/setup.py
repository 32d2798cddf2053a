"""Which KV transports this engine serves and pulls with (--kv-transport), decided once at start.

- grpc: KvChunk bytes only.
- shm: also shared memory with engines on this host (the same boot id and /dev/shm mount); pulls from
  other hosts stay gRPC. An engine whose cache lives in its process on the CPU allocated it in a memfd
  (shm_cache): pullers copy straight out of it; otherwise blocks go through a segment per pull.
- nixl: also NIXL one-sided reads, when the NIXL wheel imports and its UCX backend starts: one agent
  over the KV cache in the engine process, or with worker processes (tensor parallelism) one agent in
  each worker over its shard (every rank must start it).

Whatever cannot be set up is logged once as a warning naming the reason, and the engine runs with gRPC.
gRPC is every pull's fallback: a source that does not serve the transport asked for, or a segment or
agent that cannot be used, makes the puller pull that transfer over gRPC.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from conduit_engine.kv_transfer.params import SourceTransports
from conduit_engine.kv_transfer.shm_cache import SharedKvCacheFile
from conduit_engine.kv_transfer.shm_segment import shm_host_id

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KvTransports:
    """What an engine offers in its handles, and its NIXL agent (None unless nixl is up)."""

    kind: str  # the transport in use: grpc, shm or nixl (after any fallback)
    offered: SourceTransports
    nixl: Any = None  # nixl_agent.NixlEndpoint
    # shm: the memfd this engine's cache lives in (sources serve direct pulls out of it), and this
    # engine's cache tensors when they live in its process (direct pulls copy into them); else None.
    shm_cache: SharedKvCacheFile | None = None
    caches: Sequence[Any] | None = None

    def describe(self) -> str:
        if self.kind == "shm":
            how = "its KV cache shared" if self.shm_cache is not None else "through segments"
            return f"shared memory with engines on this host ({self.offered.shm_host}; {how}), gRPC otherwise"
        if self.kind == "nixl":
            return f"NIXL agent(s) {self.nixl.name} over UCX ({self.nixl.memory}), gRPC otherwise"
        return "gRPC"


def start_transports(kind: str, executor: object, timeout_s: float) -> KvTransports:
    """Set up `kind` over `executor`'s KV cache; falls back to gRPC (logged) when it cannot."""
    if kind == "shm":
        host = shm_host_id()
        if host is not None:
            pairs = getattr(executor, "kv_caches", None)
            caches = None
            if pairs is not None and pairs[0][0].device.type == "cpu":
                caches = [cache for pair in pairs for cache in pair]
            shared = getattr(executor, "kv_cache_file", None)
            return _started(KvTransports("shm", SourceTransports(shm_host=host), None, shared, caches))
        return _fallback(kind, "no /dev/shm or no boot id on this host")
    if kind == "nixl":
        caches = getattr(executor, "kv_caches", None)
        start_nixl = getattr(executor, "start_nixl", None)  # the cache lives in worker processes
        if caches is None and start_nixl is None:
            return _fallback(kind, "this executor exposes no KV cache to register")
        try:
            if caches is not None:
                from conduit_engine.kv_transfer.nixl_agent import NixlKvEndpoint

                endpoint: Any = NixlKvEndpoint(caches, timeout_s)
            else:  # an agent in each worker (executor.nixl_workers.WorkerNixlEndpoint)
                endpoint = start_nixl(timeout_s)
        except Exception as exc:  # ImportError, a backend that does not start, a registration refused
            return _fallback(kind, f"NIXL cannot start here: {exc}")
        return _started(KvTransports("nixl", SourceTransports(nixl=True), endpoint))
    return KvTransports("grpc", SourceTransports())


def _started(transports: KvTransports) -> KvTransports:
    log.info("KV transport: %s", transports.describe())
    return transports


def _fallback(kind: str, why: str) -> KvTransports:
    log.warning("--kv-transport %s: %s; KV transfers use gRPC", kind, why)
    return KvTransports("grpc", SourceTransports())
