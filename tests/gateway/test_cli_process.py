"""The real `conduit-gateway` process: configured from CONDUIT_* variables, failing with its output, and
importing neither torch nor the engine."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import openai
import pytest

from tests.gateway.conftest import MODEL
from tests.support.processes import ProcessStartError, start_gateway

pytestmark = pytest.mark.integration


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
    code = (
        "import sys, conduit_gateway.cli, conduit_gateway.http.app; "
        "bad = [m for m in ('torch', 'conduit_engine', 'transformers') if m in sys.modules]; "
        "sys.exit(f'imported {bad}' if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
