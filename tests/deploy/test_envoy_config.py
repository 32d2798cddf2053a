"""deploy/envoy/envoy.yaml: the real Envoy accepts it; it holds what long SSE and gRPC streams need."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.deploy import envoy_config, strict_yaml
from tests.deploy.paths import CHART, ENVOY_CONFIG

pytestmark = pytest.mark.deploy


def _seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)s", duration)
    assert match, f"expected a duration like '300s', got {duration!r}"
    return float(match.group(1))


@pytest.fixture(scope="module")
def config():
    return envoy_config.load()


def test_envoy_validates_the_config():
    result = envoy_config.validate(ENVOY_CONFIG)
    assert result.returncode == 0, result.stderr + result.stdout
    assert f"configuration '{ENVOY_CONFIG}' OK" in result.stdout


def test_envoy_validate_catches_a_broken_config(tmp_path, config):
    # Proves the check above has teeth: a misspelt field fails validation.
    broken = envoy_config.loopback(
        config, admin_port=9901, http_port=8080, grpc_port=50050, gateway_port=8000, engine_port=50051
    )
    envoy_config.cluster(broken, "engine")["lb_polcy"] = "LEAST_REQUEST"
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(broken))
    result = envoy_config.validate(path)
    assert result.returncode != 0
    assert "lb_polcy" in result.stderr + result.stdout


def test_loopback_rewrite_changes_only_addresses_and_still_validates(tmp_path, config):
    local = envoy_config.loopback(
        config, admin_port=19901, http_port=18080, grpc_port=15050, gateway_port=18000, engine_port=15051
    )
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(local))
    result = envoy_config.validate(path)
    assert result.returncode == 0, result.stderr + result.stdout
    assert envoy_config.upstream_address(envoy_config.cluster(local, "engine")) == {
        "address": "127.0.0.1",
        "port_value": 15051,
    }
    # Put the original addresses back: then the two configs are identical.
    restored = envoy_config.loopback(
        local, admin_port=9901, http_port=8080, grpc_port=50050, gateway_port=8000, engine_port=50051
    )
    envoy_config.listener(restored, "http_ingress")["address"]["socket_address"]["address"] = "0.0.0.0"
    envoy_config.listener(restored, "grpc_internal")["address"]["socket_address"]["address"] = "0.0.0.0"
    envoy_config.upstream_address(envoy_config.cluster(restored, "gateway"))["address"] = "gateway"
    envoy_config.upstream_address(envoy_config.cluster(restored, "engine"))["address"] = "engine"
    assert restored == config


def test_admin_listens_on_localhost_only(config):
    assert config["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"


def test_http_listener_streams_sse_without_buffering_or_short_timeouts(config):
    http = envoy_config.listener(config, "http_ingress")
    manager = envoy_config.connection_manager(http)
    # Only the router: no buffer, compressor or other filter that could hold back events.
    assert [f["name"] for f in manager["http_filters"]] == ["envoy.filters.http.router"]
    assert _seconds(manager["stream_idle_timeout"]) >= 60
    route = envoy_config.only_route(http)["route"]
    assert route["cluster"] == "gateway"
    # Envoy's default route timeout is 15 s; a generation needs far longer.
    assert _seconds(route["timeout"]) >= 600
    assert _seconds(route["idle_timeout"]) >= 60
    # A POST that reached a gateway is never retried (it could generate twice).
    assert set(route["retry_policy"]["retry_on"].split(",")) <= {
        "connect-failure",
        "refused-stream",
        "reset-before-request",
    }
    assert manager["generate_request_id"] is True


def test_grpc_listener_balances_engines_over_http2_with_health_checks_and_budgeted_retries(config):
    grpc_listener = envoy_config.listener(config, "grpc_internal")
    manager = envoy_config.connection_manager(grpc_listener)
    assert manager["codec_type"] == "HTTP2"
    assert [f["name"] for f in manager["http_filters"]] == ["envoy.filters.http.router"]
    route = envoy_config.only_route(grpc_listener)
    assert route["match"]["grpc"] == {}
    assert route["route"]["cluster"] == "engine"
    assert _seconds(route["route"]["timeout"]) >= 600
    assert "unavailable" in route["route"]["retry_policy"]["retry_on"].split(",")

    engine = envoy_config.cluster(config, "engine")
    assert engine["lb_policy"] == "LEAST_REQUEST"
    options = engine["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    assert "http2_protocol_options" in options["explicit_http_config"]
    (health_check,) = engine["health_checks"]
    assert health_check["grpc_health_check"] == {"service_name": ""}
    # Without traffic Envoy would otherwise probe only once a minute.
    assert _seconds(health_check["no_traffic_interval"]) <= 10
    (thresholds,) = engine["circuit_breakers"]["thresholds"]
    budget = thresholds["retry_budget"]
    assert 0 < budget["budget_percent"]["value"] <= 50
    assert budget["min_retry_concurrency"] >= 1


def test_gateway_cluster_is_health_checked_on_its_health_endpoint(config):
    gateway = envoy_config.cluster(config, "gateway")
    (health_check,) = gateway["health_checks"]
    assert health_check["http_health_check"]["path"] == "/health"
    assert envoy_config.upstream_address(gateway) == {"address": "gateway", "port_value": 8000}
    assert envoy_config.upstream_address(envoy_config.cluster(config, "engine")) == {
        "address": "engine",
        "port_value": 50051,
    }


@pytest.mark.parametrize("name", ["http_ingress", "grpc_internal"])
def test_access_logs_carry_the_request_id(config, name):
    manager = envoy_config.connection_manager(envoy_config.listener(config, name))
    (access_log,) = manager["access_log"]
    fields = access_log["typed_config"]["log_format"]["json_format"]
    assert fields["request_id"] == "%REQ(X-REQUEST-ID)%"


def test_chart_ships_the_same_envoy_config():
    # The chart cannot read files outside itself; it carries a byte-for-byte copy that this test keeps honest.
    copy = CHART / "files" / "envoy.yaml"
    assert copy.read_bytes() == ENVOY_CONFIG.read_bytes(), (
        f"{copy} differs from {ENVOY_CONFIG}: copy deploy/envoy/envoy.yaml over it"
    )


def test_strict_loader_rejects_duplicate_keys():
    with pytest.raises(strict_yaml.DuplicateKeyError, match="duplicate key 'timeout'"):
        strict_yaml.load("route:\n  timeout: 15s\n  timeout: 3600s\n")
    # A key overriding a `<<` merge is not a duplicate.
    assert strict_yaml.load("base: &b {a: 1}\nitem:\n  <<: *b\n  a: 2\n")["item"] == {"a": 2}
