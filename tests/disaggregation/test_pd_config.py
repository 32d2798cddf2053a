"""Disaggregation settings and rules without servers: the engine's and the gateway's flags and CONDUIT_*
variables, their validation naming the field, which engines may join a prefill or decode pool, and when
the gateway disaggregates a model's requests."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from conduit.engine.v1 import engine_pb2
from conduit_engine.config import DisaggregationConfig
from conduit_engine.entrypoints import cli as engine_cli
from conduit_gateway.cli import config_from_args
from conduit_gateway.config import ConfigError, GatewayConfig
from conduit_gateway.handlers.disaggregated import uses_disaggregation
from conduit_gateway.routing.roles import NodeRole, admission_problem

pytestmark = pytest.mark.unit

LAYOUT = engine_pb2.KvLayout(
    model="m", dtype="float32", block_size=16, num_layers=5, num_kv_heads=4, head_dim=8, fingerprint="a" * 64
)


def engine_config(argv: list[str], environ: dict[str, str] | None = None) -> DisaggregationConfig:
    args = engine_cli.build_parser(environ or {}).parse_args(["--model", "m", *argv])
    return engine_cli.config_from_args(args).disaggregation


def test_engine_flags_and_environment_map_onto_the_config():
    assert engine_config([]) == DisaggregationConfig()
    config = engine_config(
        [
            "--role",
            "prefill",
            "--advertise-address",
            "engine-0.engines:50051",
            "--kv-transfer-lease-seconds",
            "5",
        ],
        {"CONDUIT_KV_TRANSFER_CHUNK_BYTES": "65536", "CONDUIT_KV_TRANSFER_TIMEOUT": "9"},
    )
    assert config == DisaggregationConfig("prefill", "engine-0.engines:50051", 5.0, 65536, 9.0)
    assert (config.produces, config.consumes) == (True, False)
    assert engine_config([], {"CONDUIT_ROLE": "decode"}).role == "decode"
    assert engine_config([]).kv_transport == "grpc"
    assert engine_config(["--kv-transport", "nixl"]).kv_transport == "nixl"
    assert engine_config([], {"CONDUIT_KV_TRANSPORT": "shm"}).kv_transport == "shm"
    assert (DisaggregationConfig("both").produces, DisaggregationConfig("both").consumes) == (True, True)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"role": "middle"}, "--role must be both, prefill or decode, got 'middle'"),
        ({"advertise_address": "engine-0"}, "--advertise-address must be HOST:PORT, got 'engine-0'"),
        ({"advertise_address": "engine-0:0"}, "--advertise-address must be HOST:PORT"),
        ({"lease_seconds": 0}, "--kv-transfer-lease-seconds must be > 0, got 0"),
        ({"chunk_bytes": 0}, "--kv-transfer-chunk-bytes must be >= 1, got 0"),
        ({"pull_timeout_seconds": -1}, "--kv-transfer-timeout must be > 0, got -1"),
        ({"kv_transport": "rdma"}, "--kv-transport must be grpc, shm or nixl, got 'rdma'"),
    ],
)
def test_engine_settings_that_cannot_work_name_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DisaggregationConfig(**kwargs)


def test_gateway_flags_and_environment_map_onto_the_config():
    config = config_from_args(
        ["--prefill-engine", "p0:1,p1:1", "--prefill-engine", "p2:1", "--decode-engine-dns", "decode:50051"],
        {"CONDUIT_DECODE_ENGINE": "d0:1", "CONDUIT_PREFILL_ENGINE_DNS": "prefill:50051"},
    )
    assert (config.engines, config.prefill_engines, config.decode_engines) == (
        (),
        ("p0:1", "p1:1", "p2:1"),
        ("d0:1",),
    )
    assert (config.prefill_engine_dns, config.decode_engine_dns) == ("prefill:50051", "decode:50051")
    assert config.disaggregated
    assert not GatewayConfig(engines=("e:1",)).disaggregated


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prefill_engines": ("p:1",)}, "decode_engine: --prefill-engine needs decode engines too"),
        ({"decode_engine_dns": "d:1"}, "prefill_engine: --decode-engine needs prefill engines too"),
        ({"prefill_engines": ("p",), "decode_engines": ("d:1",)}, "prefill_engine: expected HOST:PORT"),
        ({"prefill_engines": ("x:1",), "decode_engines": ("x:1",)}, "decode_engine: x:1 is also given as "),
        (
            {"engines": ("x:1",), "prefill_engines": ("x:1",), "decode_engines": ("d:1",)},
            "is also given as engine",
        ),
        ({"prefill_engine_dns": "p", "decode_engines": ("d:1",)}, "prefill_engine_dns: expected HOST:PORT"),
    ],
)
def test_gateway_pools_that_cannot_work_name_the_field(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        GatewayConfig(engines=kwargs.pop("engines", ()), **kwargs)


def test_one_pool_alone_is_allowed_when_the_admin_api_can_add_the_other():
    config = GatewayConfig(engines=(), prefill_engines=("p:1",), admin_keys=("k",))
    assert not config.disaggregated


def info(role: int, fingerprint: str = "a" * 64, model: str = "m") -> engine_pb2.GetModelInfoResponse:
    layout = engine_pb2.KvLayout()
    layout.CopyFrom(LAYOUT)
    layout.fingerprint = fingerprint
    return engine_pb2.GetModelInfoResponse(model=model, role=role, kv_layout=layout)


def peer(role: NodeRole, model_info: engine_pb2.GetModelInfoResponse, address: str = "peer:1"):
    return SimpleNamespace(address=address, role=role, model_info=model_info)


def test_engine_roles_that_may_join_each_pool():
    both, prefill, decode = (
        engine_pb2.ENGINE_ROLE_BOTH,
        engine_pb2.ENGINE_ROLE_PREFILL,
        engine_pb2.ENGINE_ROLE_DECODE,
    )
    for role, allowed in [(NodeRole.PREFILL, {both, prefill}), (NodeRole.DECODE, {both, decode})]:
        for engine_role in (both, prefill, decode, engine_pb2.ENGINE_ROLE_UNSPECIFIED):
            problem = admission_problem(role, info(engine_role), [])
            assert (problem is None) == (engine_role in allowed), (role, engine_role)
    assert admission_problem(NodeRole.DECODE, info(prefill), []) == (
        "its engine's role is prefill; a decode node needs an engine started with --role decode or "
        "--role both"
    )
    # Colocated nodes serve whole requests: any engine may join.
    assert admission_problem(NodeRole.COLOCATED, info(engine_pb2.ENGINE_ROLE_UNSPECIFIED), []) is None


def test_a_kv_layout_other_than_the_peers_of_its_model_is_refused():
    prefill = engine_pb2.ENGINE_ROLE_PREFILL
    decode_peer = peer(NodeRole.DECODE, info(engine_pb2.ENGINE_ROLE_DECODE), "d0:1")
    assert admission_problem(NodeRole.PREFILL, info(prefill), [decode_peer]) is None
    problem = admission_problem(NodeRole.PREFILL, info(prefill, "b" * 64), [decode_peer])
    assert problem == (
        "its KV layout (fingerprint bbbbbbbbbbbb: model m, float32, block size 16, 5 layers, 4 KV heads, "
        "head dim 8) differs from decode engine d0:1's (fingerprint aaaaaaaaaaaa: model m, float32, block "
        "size 16, 5 layers, 4 KV heads, head dim 8): engines whose KV layouts differ cannot exchange KV "
        "blocks"
    )
    # Other models and colocated nodes are not its peers.
    other_model = peer(NodeRole.DECODE, info(engine_pb2.ENGINE_ROLE_DECODE, "c" * 64, model="other"))
    colocated = peer(NodeRole.COLOCATED, info(engine_pb2.ENGINE_ROLE_BOTH, "c" * 64))
    assert admission_problem(NodeRole.PREFILL, info(prefill, "b" * 64), [other_model, colocated]) is None
    no_layout = engine_pb2.GetModelInfoResponse(model="m", role=prefill)
    assert admission_problem(NodeRole.PREFILL, no_layout, []) == "its engine reports no KV layout"


class Pool:
    """What uses_disaggregation reads of a pool: members and routable nodes per role."""

    def __init__(self, nodes: list[tuple[NodeRole, str | None, bool]]) -> None:
        self.nodes = [
            SimpleNamespace(role=role, model=model, routable=routable) for role, model, routable in nodes
        ]

    def members(self, role: NodeRole) -> list:
        return [node for node in self.nodes if node.role is role]

    def routable(self, role: NodeRole) -> list:
        return [node for node in self.members(role) if node.routable]


def test_requests_disaggregate_with_both_pools_and_fall_back_to_colocated_engines():
    prefill, decode, colocated = NodeRole.PREFILL, NodeRole.DECODE, NodeRole.COLOCATED
    assert not uses_disaggregation(Pool([(colocated, "m", True)]), "m")
    assert not uses_disaggregation(Pool([(prefill, "m", True), (colocated, "m", True)]), "m")
    # Only the two pools: always disaggregated (a pool with nothing ready answers 503 as usual).
    assert uses_disaggregation(Pool([(prefill, "m", False), (decode, "m", True)]), "m")
    mixed = [(prefill, "m", True), (decode, "m", True), (colocated, "m", True)]
    assert uses_disaggregation(Pool(mixed), "m")
    # With colocated engines too, a model whose pair is not ready goes to them.
    assert not uses_disaggregation(
        Pool([(prefill, "m", True), (decode, "m", False), (colocated, "m", True)]), "m"
    )
    assert not uses_disaggregation(Pool(mixed), "other")
