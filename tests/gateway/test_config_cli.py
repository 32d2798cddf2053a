"""GatewayConfig validation, flags and CONDUIT_* variables, and the engine channel options they set."""

from __future__ import annotations

import pytest

from conduit_gateway.cli import config_from_args
from conduit_gateway.config import ConfigError, GatewayConfig
from conduit_gateway.routing.client import channel_options

pytestmark = pytest.mark.unit


def test_flags_map_onto_config():
    config = config_from_args(
        [
            "--engine",
            "a:1,b:2",
            "--engine",
            "c:3",
            "--port",
            "9000",
            "--api-key",
            "k1,k2",
            "--api-key",
            "k3",
            "--max-concurrent-requests",
            "5",
            "--request-timeout",
            "2.5",
        ],
        {},
    )
    assert config.engines == ("a:1", "b:2", "c:3")
    assert config.port == 9000 and config.host == "0.0.0.0"
    assert config.api_keys == ("k1", "k2", "k3")
    assert config.max_concurrent_requests == 5
    assert config.request_timeout_s == 2.5


def test_environment_fills_flags_and_command_line_wins():
    env = {
        "CONDUIT_ENGINE": "e:1,f:2",
        "CONDUIT_PORT": "7000",
        "CONDUIT_API_KEY": "secret",
        "CONDUIT_RETRY_AFTER": "4",
    }
    config = config_from_args([], env)
    assert config.engines == ("e:1", "f:2")
    assert (config.port, config.api_keys, config.retry_after_s) == (7000, ("secret",), 4)
    config = config_from_args(["--engine", "g:3", "--port", "7001"], env)
    assert config.engines == ("g:3",)
    assert config.port == 7001 and config.api_keys == ("secret",)


def test_parser_flags_and_environment():
    assert (
        GatewayConfig(engines=("a:1",)).tool_call_parser,
        GatewayConfig(engines=("a:1",)).reasoning_parser,
    ) == (
        None,
        None,
    )
    config = config_from_args(
        ["--engine", "a:1", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"], {}
    )
    assert (config.tool_call_parser, config.reasoning_parser) == ("hermes", "qwen3")
    env = {
        "CONDUIT_ENGINE": "a:1",
        "CONDUIT_TOOL_CALL_PARSER": "mistral",
        "CONDUIT_REASONING_PARSER": "deepseek_r1",
    }
    config = config_from_args([], env)
    assert (config.tool_call_parser, config.reasoning_parser) == ("mistral", "deepseek_r1")


def test_unknown_parser_is_a_usage_error_listing_the_choices(capsys):
    with pytest.raises(SystemExit):
        config_from_args(["--engine", "a:1", "--tool-call-parser", "pythonic"], {})
    assert "choose from 'hermes', 'llama3_json', 'mistral'" in capsys.readouterr().err


def test_workers_come_from_the_flag_or_the_environment():
    assert config_from_args(["--engine", "a:1"], {}).workers == 1
    assert config_from_args(["--engine", "a:1"], {"CONDUIT_WORKERS": "3"}).workers == 3
    assert config_from_args(["--engine", "a:1", "--workers", "2"], {"CONDUIT_WORKERS": "3"}).workers == 2


def test_bad_environment_value_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        config_from_args([], {"CONDUIT_ENGINE": "a:1", "CONDUIT_PORT": "eighty"})
    assert "--port" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"engines": ()}, "engine"),
        ({"engines": ("nohost",)}, "engine"),
        ({"engines": ("h:99999",)}, "engine"),
        ({"port": 70000}, "port"),
        ({"api_keys": ("",)}, "api_key"),
        ({"routing": "random"}, "routing"),
        ({"max_concurrent_requests": 0}, "max_concurrent_requests"),
        ({"max_body_bytes": -1}, "max_body_bytes"),
        ({"retry_after_s": -1}, "retry_after"),
        ({"health_interval_s": 0}, "health_interval"),
        ({"request_timeout_s": 0}, "request_timeout"),
        ({"health_check_timeout_s": 0}, "health_check_timeout"),
        ({"load_timeout_s": -1}, "load_timeout"),
        ({"model_info_timeout_s": float("inf")}, "model_info_timeout"),
        ({"grpc_keepalive_timeout_s": 0}, "grpc_keepalive_timeout"),
        ({"reconnect_backoff_s": 0}, "reconnect_backoff"),
        ({"max_reconnect_backoff_s": 0.1}, "max_reconnect_backoff"),
        ({"shutdown_grace_s": 0}, "shutdown_grace"),
        ({"workers": 0}, "workers"),
        ({"log_level": "loud"}, "log_level"),
        ({"tool_call_parser": "pythonic"}, "tool_call_parser"),
        ({"reasoning_parser": "o1"}, "reasoning_parser"),
        ({"log_format": "xml"}, "log_format"),
        ({"otlp_endpoint": "collector:4317"}, "otlp_endpoint"),
        ({"otlp_endpoint": "grpc://collector:4317"}, "otlp_endpoint"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
    values = {"engines": ("127.0.0.1:50051",), **kwargs}
    with pytest.raises(ConfigError, match=f"^{field}: "):
        GatewayConfig(**values)


def test_missing_engine_is_a_usage_error(capsys):
    from conduit_gateway.cli import main

    with pytest.raises(SystemExit) as exited:
        main([])
    assert exited.value.code == 2
    assert "engine: at least one HOST:PORT is required" in capsys.readouterr().err


def test_server_settings_map_onto_config_and_the_engine_channels():
    argv = ["--engine", "a:1", "--grpc-keepalive", "20", "--grpc-keepalive-timeout", "5"]
    argv += ["--reconnect-backoff", "0.5", "--max-reconnect-backoff", "4", "--health-check-timeout", "3"]
    argv += ["--load-timeout", "2", "--model-info-timeout", "6"]
    config = config_from_args(
        argv, {"CONDUIT_SHUTDOWN_GRACE": "20", "CONDUIT_GRPC_MAX_MESSAGE_BYTES": "1024"}
    )
    assert (config.grpc_keepalive_s, config.grpc_keepalive_timeout_s) == (20.0, 5.0)
    assert (config.reconnect_backoff_s, config.max_reconnect_backoff_s) == (0.5, 4.0)
    assert (config.health_check_timeout_s, config.load_timeout_s, config.model_info_timeout_s) == (3, 2, 6)
    assert (config.shutdown_grace_s, config.grpc_max_message_bytes) == (20.0, 1024)
    options = dict(channel_options(config))
    assert options["grpc.max_send_message_length"] == options["grpc.max_receive_message_length"] == 1024
    assert (options["grpc.keepalive_time_ms"], options["grpc.keepalive_timeout_ms"]) == (20_000, 5_000)
    assert (options["grpc.initial_reconnect_backoff_ms"], options["grpc.max_reconnect_backoff_ms"]) == (
        500,
        4_000,
    )


def test_default_channel_options():
    options = dict(channel_options(GatewayConfig(engines=("a:1",))))
    assert options == {
        "grpc.max_send_message_length": 64 * 1024 * 1024,
        "grpc.max_receive_message_length": 64 * 1024 * 1024,
        "grpc.keepalive_time_ms": 30_000,
        "grpc.keepalive_timeout_ms": 10_000,
        "grpc.keepalive_permit_without_calls": 0,
        "grpc.http2.max_pings_without_data": 0,
        "grpc.initial_reconnect_backoff_ms": 200,
        "grpc.max_reconnect_backoff_ms": 2_000,
    }
    # The ping timeout never exceeds the ping period.
    short = dict(channel_options(GatewayConfig(engines=("a:1",), grpc_keepalive_s=2.0)))
    assert short["grpc.keepalive_timeout_ms"] == 2_000
