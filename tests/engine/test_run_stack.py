"""`make run`'s launcher: the demo model is made offline, engine + gateway serve it, SIGTERM stops both."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import openai

from conduit_engine.demo_model import write_demo_model
from tests.support.processes import free_port


def live_pids(pattern: str) -> list[str]:
    """Processes matching `pattern` that have not exited (zombies awaiting their reaper do not count)."""
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    live = []
    for pid in found:
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, IndexError):
            continue
        if state != "Z":
            live.append(pid)
    return live


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
        pattern = f"[-]-port {engine_port}|[-]-port {gateway_port}"
        assert len(live_pids(pattern)) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        for _ in range(300):
            if not live_pids(pattern):
                break
            time.sleep(0.1)
        assert not live_pids(pattern), "engine or gateway outlived the launcher"
    finally:
        if proc.poll() is None:
            proc.kill()  # the children get SIGTERM from the kernel when their parent dies


def test_children_die_with_a_killed_launcher(tmp_path):
    model = write_demo_model(tmp_path / "demo-llama")
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
    pattern = f"[-]-port {engine_port}|[-]-port {gateway_port}"
    try:
        for line in proc.stdout:
            if "Ctrl-C stops both" in line:
                break
        proc.kill()  # SIGKILL: the launcher cannot clean up itself
        proc.wait(timeout=30)
        for _ in range(300):
            if not live_pids(pattern):
                break
            time.sleep(0.1)
        assert not live_pids(pattern), "engine or gateway outlived a SIGKILLed launcher"
    finally:
        subprocess.run(["pkill", "-f", pattern], capture_output=True)
