"""Reading deploy/envoy/envoy.yaml, rewriting it for loopback, and running `envoy --mode validate`."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

from tests.deploy import strict_yaml
from tests.deploy.paths import ENVOY_CONFIG, tool

HTTP_LISTENER = "http_ingress"
GRPC_LISTENER = "grpc_internal"
GATEWAY_CLUSTER = "gateway"
ENGINE_CLUSTER = "engine"
HCM_FILTER = "envoy.filters.network.http_connection_manager"


def load(path: Path = ENVOY_CONFIG) -> dict[str, Any]:
    config = strict_yaml.load(path.read_text())
    assert isinstance(config, dict), f"{path} is not a YAML mapping"
    return config


def listener(config: dict[str, Any], name: str) -> dict[str, Any]:
    found = [item for item in config["static_resources"]["listeners"] if item["name"] == name]
    assert len(found) == 1, f"expected one listener named {name!r}, found {len(found)}"
    return found[0]


def cluster(config: dict[str, Any], name: str) -> dict[str, Any]:
    found = [item for item in config["static_resources"]["clusters"] if item["name"] == name]
    assert len(found) == 1, f"expected one cluster named {name!r}, found {len(found)}"
    return found[0]


def connection_manager(listener_config: dict[str, Any]) -> dict[str, Any]:
    (chain,) = listener_config["filter_chains"]
    (network_filter,) = chain["filters"]
    assert network_filter["name"] == HCM_FILTER
    return network_filter["typed_config"]


def only_route(listener_config: dict[str, Any]) -> dict[str, Any]:
    (virtual_host,) = connection_manager(listener_config)["route_config"]["virtual_hosts"]
    (route,) = virtual_host["routes"]
    return route


def upstream_address(cluster_config: dict[str, Any]) -> dict[str, Any]:
    (locality,) = cluster_config["load_assignment"]["endpoints"]
    (endpoint,) = locality["lb_endpoints"]
    return endpoint["endpoint"]["address"]["socket_address"]


def loopback(
    config: dict[str, Any],
    *,
    admin_port: int,
    http_port: int,
    grpc_port: int,
    gateway_port: int,
    engine_port: int,
) -> dict[str, Any]:
    """The same config with every address on 127.0.0.1 and the given ports; nothing else changes."""
    local = copy.deepcopy(config)
    local["admin"]["address"]["socket_address"].update(address="127.0.0.1", port_value=admin_port)
    for name, port in ((HTTP_LISTENER, http_port), (GRPC_LISTENER, grpc_port)):
        listener(local, name)["address"]["socket_address"].update(address="127.0.0.1", port_value=port)
    for name, port in ((GATEWAY_CLUSTER, gateway_port), (ENGINE_CLUSTER, engine_port)):
        upstream_address(cluster(local, name)).update(address="127.0.0.1", port_value=port)
    return local


def validate(path: Path) -> subprocess.CompletedProcess[str]:
    """Run the real Envoy binary in validate mode on `path` (it parses and checks every typed config)."""
    return subprocess.run(
        [
            str(tool("envoy")),
            "--mode",
            "validate",
            "-c",
            str(path),
            "--disable-hot-restart",
            "--log-level",
            "warn",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
