"""The routing options: flags, CONDUIT_* variables and validation naming the field."""

from __future__ import annotations

import pytest

from conduit_gateway.cli import config_from_args
from conduit_gateway.config import ConfigError, GatewayConfig

pytestmark = pytest.mark.unit


def test_routing_flags_map_onto_config():
    config = config_from_args(
        [
            "--engine-dns",
            "conduit-engine.default.svc.cluster.local:50051",
            "--dns-interval",
            "5",
            "--admin-key",
            "a1,a2",
            "--routing",
            "prefix_affinity",
            "--load-interval",
            "0.5",
            "--retries",
            "2",
            "--affinity-prefix-chars",
            "512",
            "--affinity-load-factor",
            "1.5",
        ],
        {},
    )
    assert config.engines == ()
    assert config.engine_dns == "conduit-engine.default.svc.cluster.local:50051"
    assert (config.dns_interval_s, config.admin_keys, config.routing) == (
        5.0,
        ("a1", "a2"),
        "prefix_affinity",
    )
    assert (config.load_interval_s, config.retries) == (0.5, 2)
    assert (config.affinity_prefix_chars, config.affinity_load_factor) == (512, 1.5)


def test_routing_environment_variables():
    env = {
        "CONDUIT_ENGINE_DNS": "engines:50051",
        "CONDUIT_ADMIN_KEY": "k1,k2",
        "CONDUIT_ROUTING": "least_load",
        "CONDUIT_RETRIES": "0",
    }
    config = config_from_args([], env)
    assert (config.engine_dns, config.admin_keys, config.routing, config.retries) == (
        "engines:50051",
        ("k1", "k2"),
        "least_load",
        0,
    )


def test_kv_aware_flags_map_onto_config():
    args = ["--engine", "a:1", "--routing", "kv_aware", "--kv-overlap-weight", "4", "--router-temperature"]
    config = config_from_args([*args, "0.5", "--kv-index-max-blocks", "4096"], {})
    assert (config.routing, config.kv_overlap_weight, config.router_temperature) == ("kv_aware", 4.0, 0.5)
    assert config.kv_index_max_blocks == 4096


def test_unknown_routing_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        config_from_args(["--engine", "a:1", "--routing", "random"], {})
    assert "--routing" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"engines": (), "engine_dns": None}, "engine"),
        ({"engine_dns": "no-port"}, "engine_dns"),
        ({"dns_interval_s": 0}, "dns_interval"),
        ({"admin_keys": ("",)}, "admin_key"),
        ({"admin_keys": ("same",), "api_keys": ("same",)}, "admin_key"),
        ({"load_interval_s": -1}, "load_interval"),
        ({"retries": -1}, "retries"),
        ({"affinity_prefix_chars": 0}, "affinity_prefix_chars"),
        ({"affinity_load_factor": 0.5}, "affinity_load_factor"),
        ({"routing": "fastest"}, "routing"),
        ({"kv_overlap_weight": -1}, "kv_overlap_weight"),
        ({"router_temperature": float("inf")}, "router_temperature"),
        ({"kv_index_max_blocks": 0}, "kv_index_max_blocks"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
    values = {"engines": ("127.0.0.1:50051",), **kwargs}
    with pytest.raises(ConfigError, match=f"^{field}: "):
        GatewayConfig(**values)


def test_engines_may_come_only_from_dns_or_the_admin_api():
    assert GatewayConfig(engines=(), engine_dns="engines:50051").engines == ()
    assert GatewayConfig(engines=(), admin_keys=("k",)).admin_keys == ("k",)
