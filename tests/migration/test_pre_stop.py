"""The engine pod's preStop hook (the chart runs it before SIGTERM) on a real engine process: the engine
leaves rotation (NOT_SERVING) yet still serves, and the SIGTERM that follows drains it to a clean exit."""

from __future__ import annotations

import signal
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2

from conduit.engine.v1 import engine_pb2, engine_pb2_grpc
from tests.support.health import engine_health
from tests.support.polling import wait_for
from tests.support.processes import require_shared, start_engine
from tests.support.stories import MODEL, PROMPT

pytestmark = pytest.mark.integration

HOOK = [sys.executable, "-m", "conduit_engine.entrypoints.pre_stop"]


def test_the_pre_stop_hook_takes_the_engine_out_of_rotation_and_sigterm_then_drains_it():
    model = require_shared(f"models/{MODEL}")
    with start_engine(model, "--drain-seconds", "5") as engine:
        hook = subprocess.run([*HOOK, "--pid", str(engine.process.pid), "--sleep", "0"], timeout=60)
        assert hook.returncode == 0
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        wait_for(lambda: engine_health(engine.address) == not_serving, "NOT_SERVING after the hook")
        # Out of rotation, but whatever still reaches it is served until SIGTERM.
        with grpc.insecure_channel(engine.address) as channel:
            request = engine_pb2.GenerateRequest(request_id="late", model=MODEL, text=PROMPT)
            request.sampling.max_tokens = 4
            request.sampling.temperature = 0
            messages = list(engine_pb2_grpc.EngineStub(channel).Generate(request, timeout=60))
        assert messages[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH
        engine.process.send_signal(signal.SIGTERM)
        assert engine.process.wait(timeout=60) == 0


def test_the_pre_stop_hook_refuses_a_negative_sleep_and_tolerates_a_gone_engine():
    refused = subprocess.run([*HOOK, "--sleep", "-1"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2
    assert "--sleep must be >= 0, got -1.0" in refused.stderr
    gone = subprocess.run(
        [*HOOK, "--pid", "999999999", "--sleep", "0"], capture_output=True, text=True, timeout=60
    )
    assert gone.returncode == 0
    assert "no process 999999999" in gone.stderr
