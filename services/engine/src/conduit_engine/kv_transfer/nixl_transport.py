"""KvTransport over NIXL one-sided reads (--kv-transport nixl).

The control path is a PullKv call with transport KV_TRANSPORT_NIXL: the source pins the pull as usual
and answers one chunk whose `nixl` describes where the blocks lie in its registered cache (with its
agent metadata the first time). The puller reads them straight into its destination cache blocks
(`NixlEndpoint.read`: this process's agent, or every worker's for tensor parallelism, each reading the
KV heads of its shard from the source ranks holding them; the sink names the blocks: a DirectKvBlockSink),
then calls ReleaseKv: released means the blocks stayed pinned through the read, so what was read is the
transfer; anything else (the lease ran out meanwhile) is a failed pull and the prompt is recomputed. A
source without NIXL answers UNIMPLEMENTED, and a source agent this one cannot load is
KvTransportUnavailableError: the puller pulls over gRPC instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from conduit.engine.v1 import engine_pb2 as pb
from conduit_engine.kv_transfer.errors import KvTransportUnavailableError
from conduit_engine.kv_transfer.grpc_transport import GrpcKvTransport, pull_request
from conduit_engine.kv_transfer.nixl_agent import NixlEndpoint
from conduit_engine.kv_transfer.transport import KvBlockSink, KvPullResult, KvPullSpec


class NixlKvTransport(GrpcKvTransport):
    """Pulls by NIXL reads into `endpoint`'s registered cache (other options as GrpcKvTransport)."""

    def __init__(self, endpoint: NixlEndpoint, **options: object) -> None:
        super().__init__(**options)  # type: ignore[arg-type]
        self._endpoint = endpoint

    async def pull(
        self, spec: KvPullSpec, sink: KvBlockSink, metadata: Sequence[tuple[str, str]] = ()
    ) -> KvPullResult:
        if spec.num_blocks == 0:
            return await super().pull(spec, sink, metadata)
        destination = getattr(sink, "destination_blocks", None)
        if destination is None:
            raise KvTransportUnavailableError("NIXL reads need a sink that names its cache blocks")
        known = self._endpoint.known_agents(spec.source_address)
        request = pull_request(spec, pb.KV_TRANSPORT_NIXL, nixl_known_agents=known)
        blocks: pb.KvNixlBlocks = await self.described(spec, request, metadata, "nixl")
        num_bytes = await self._endpoint.read(spec.source_address, blocks, destination(), spec.layout)
        sink.written_directly(spec.num_blocks)  # type: ignore[attr-defined]
        await self.release_after(spec, "the NIXL read")
        return KvPullResult(num_blocks=spec.num_blocks, num_bytes=num_bytes)
