"""GatewayConfig validation, flags and CONDUIT_* variables, and the real `conduit-gateway` process."""

from __future__ import annotations

import signal

import httpx
import openai
import pytest

from conduit_gateway.cli import config_from_args
from conduit_gateway.config import ConfigError, GatewayConfig
from tests.gateway.conftest import MODEL
from tests.support.processes import ProcessStartError, start_gateway


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
        ({"log_level": "loud"}, "log_level"),
        ({"tool_call_parser": "pythonic"}, "tool_call_parser"),
        ({"reasoning_parser": "o1"}, "reasoning_parser"),
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


def test_gateway_process_from_environment(fake):
    """The real CLI process, configured only through CONDUIT_* variables."""
    env = {"CONDUIT_ENGINE": fake.address, "CONDUIT_API_KEY": "sekret", "CONDUIT_LOG_LEVEL": "warning"}
    with start_gateway(fake.address, env=env) as gateway:
        with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="sekret", max_retries=0) as sdk:
            assert (
                sdk.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text == "Once upon"
            )
        assert httpx.post(f"{gateway.url}/v1/completions", json={"model": MODEL}).status_code == 401
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it: no SIGKILL was needed.
    assert gateway.process.returncode == -signal.SIGTERM


def test_start_gateway_reports_the_process_output():
    with pytest.raises(ProcessStartError, match="engine: expected HOST:PORT"):
        start_gateway("not-an-address")


def test_gateway_imports_neither_torch_nor_the_engine():
    import subprocess
    import sys

    code = (
        "import sys, conduit_gateway.cli, conduit_gateway.http.app; "
        "bad = [m for m in ('torch', 'conduit_engine', 'transformers') if m in sys.modules]; "
        "sys.exit(f'imported {bad}' if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
