"""`make run`'s launcher: the demo model is made offline, engine + gateway serve it, SIGTERM stops both."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import openai

from conduit_engine.demo_model import write_demo_model
from tests.support.processes import free_port


def test_run_stack_serves_the_demo_model_and_stops_cleanly(tmp_path):
    model = write_demo_model(tmp_path / "demo-llama")
    assert write_demo_model(model) == model  # idempotent: a second run keeps the folder
    engine_port, gateway_port = free_port(), free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "conduit_engine.run_stack",
            "--model",
            str(model),
            "--engine-port",
            str(engine_port),
            "--gateway-port",
            str(gateway_port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        banner = []
        for line in proc.stdout:
            banner.append(line)
            if "Ctrl-C stops both" in line:
                break
        text = "".join(banner)
        assert f"http://127.0.0.1:{gateway_port}/v1" in text and "curl" in text
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway_port}/v1", api_key="none")
        reply = client.completions.create(model="demo-llama", prompt="Once upon a time", max_tokens=5)
        assert reply.usage.completion_tokens == 5
        children = subprocess.run(
            ["pgrep", "-f", f"[-]-port {engine_port}|[-]-port {gateway_port}"], capture_output=True, text=True
        ).stdout.split()
        assert len(children) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        for _ in range(100):
            alive = subprocess.run(
                ["pgrep", "-f", f"[-]-port {engine_port}|[-]-port {gateway_port}"], capture_output=True
            )
            if alive.returncode != 0:
                break
            time.sleep(0.1)
        assert alive.returncode != 0, "engine or gateway outlived the launcher"
    finally:
        if proc.poll() is None:
            proc.kill()
