"""Engine to engine: each KV transport (gRPC bytes, shared memory, NIXL) pulls KV blocks through the
EngineDialer of a decode engine's --engine-tls-* / --engine-auth-token-file flags, from a source behind
mTLS and a token; without the token or the client certificate the pull is refused before it starts."""

from __future__ import annotations

import pytest
import torch

from conduit_engine.config import SecurityConfig
from conduit_engine.entrypoints.security import ServerSecurity, engine_dialer
from conduit_engine.kv_transfer.cache_io import CacheBlockWriter
from conduit_engine.kv_transfer.errors import KvSourceUnavailableError, KvTransferError
from conduit_engine.kv_transfer.grpc_transport import GrpcKvTransport
from conduit_engine.kv_transfer.nixl_transport import NixlKvTransport
from conduit_engine.kv_transfer.shm_transport import ShmKvTransport
from conduit_engine.ops.torch_ops import TorchOps
from tests.engine.test_kv_transfer_grpc import Source, assert_blocks_equal, caches
from tests.support.certs import make_pki
from tests.support.kv_blocks import LocalKvBlocks, layout_of, nixl_endpoint_or_skip, pull_spec_for

# Makes KV segments in /dev/shm: one such module at a time (tests/conftest.py).
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("kv_shm_exclusive")]

TOKEN = "engine-to-engine"


@pytest.fixture(params=["grpc", "shm", "nixl"])
async def secured(tmp_path, request):
    """A source behind mTLS and a token serving the transport of the parameter (its control path is the
    same PullKv call, so the same refusals hold, before any segment is written or NIXL metadata sent)."""
    pki = make_pki(tmp_path / "pki")
    (tmp_path / "token").write_text(TOKEN)
    security = ServerSecurity(
        SecurityConfig(
            tls_cert=str(pki.server.cert),
            tls_key=str(pki.server.key),
            tls_client_ca=str(pki.ca),
            auth_token_file=str(tmp_path / "token"),
        )
    )
    source = Source(torch.float32, security=security, transport=request.param)
    source.kind = request.param
    await source.server.start()
    yield source, pki, tmp_path
    await source.server.stop(None)
    source.registry.check_integrity()
    if source.nixl is not None:
        source.nixl.close()


async def _pull(source, dialer_config: SecurityConfig):
    transfer = source.produce(list(range(10, 22)))  # 12 tokens: 3 blocks
    spec = pull_spec_for(source.handle(transfer), source.layout, 0)
    dest = caches(torch.float32, seed=None)
    writer = CacheBlockWriter(LocalKvBlocks(TorchOps(), dest), layout_of("m", dest).block_bytes, [5, 6, 7], 0)
    options = {"timeout_s": 30, "dialer": engine_dialer(dialer_config)}
    endpoint = nixl_endpoint_or_skip(dest) if source.kind == "nixl" else None
    if endpoint is not None:
        transport = NixlKvTransport(endpoint, **options)
    else:
        transport = ShmKvTransport(**options) if source.kind == "shm" else GrpcKvTransport(**options)
    try:
        return await transport.pull(spec, writer), transfer, dest
    finally:
        await transport.close()
        if endpoint is not None:
            endpoint.close()


async def test_a_pull_over_mtls_with_the_token_copies_the_blocks(secured):
    source, pki, directory = secured
    config = SecurityConfig(
        engine_tls_ca=str(pki.ca),
        engine_tls_cert=str(pki.client.cert),
        engine_tls_key=str(pki.client.key),
        engine_auth_token_file=str(directory / "token"),
    )
    result, transfer, dest = await _pull(source, config)
    assert result.num_blocks == 3
    assert_blocks_equal(source.kv, transfer.block_ids, dest, [5, 6, 7])
    assert source.bm.stats().used == 0


async def test_a_pull_without_the_token_or_the_client_certificate_is_refused(secured):
    source, pki, directory = secured
    (directory / "wrong").write_text("wrong")
    no_token = SecurityConfig(
        engine_tls_ca=str(pki.ca), engine_tls_cert=str(pki.client.cert), engine_tls_key=str(pki.client.key)
    )
    with pytest.raises(KvTransferError, match="UNAUTHENTICATED: missing authorization metadata"):
        await _pull(source, no_token)
    no_cert = SecurityConfig(engine_tls_ca=str(pki.ca), engine_auth_token_file=str(directory / "token"))
    with pytest.raises(KvSourceUnavailableError, match="UNAVAILABLE"):
        await _pull(source, no_cert)
    # Refused pulls never started: both transfers still wait under their lease for a real puller.
    assert source.registry.num_pending == 2
