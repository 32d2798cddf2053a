"""`make run`'s launcher: the demo model is made offline, engine + gateway serve it, SIGTERM stops both."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import openai
import pytest

from conduit_engine.demo_model import write_demo_model
from tests.support.processes import free_port

pytestmark = pytest.mark.integration


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


def _start_launcher(model, engine_port: int, gateway_port: int) -> subprocess.Popen[str]:
    args = ["--model", str(model), "--engine-port", str(engine_port), "--gateway-port", str(gateway_port)]
    return subprocess.Popen(
        [sys.executable, "-m", "conduit_engine.run_stack", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _read_banner(proc: subprocess.Popen[str]) -> str:
    """The launcher's output up to its banner (which it prints once both services are up)."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "Ctrl-C stops both" in line:
            break
    return "".join(lines)


def _wait_gone(pattern: str) -> None:
    for _ in range(300):
        if not live_pids(pattern):
            break
        time.sleep(0.1)
    assert not live_pids(pattern), "engine or gateway outlived the launcher"


def _serve_and_stop(model, completion_tokens: int = 5) -> None:
    """One full cycle: start, serve one completion, SIGTERM, everything gone, exit code 0."""
    engine_port, gateway_port = free_port(), free_port()
    proc = _start_launcher(model, engine_port, gateway_port)
    pattern = f"[-]-port {engine_port}|[-]-port {gateway_port}"
    try:
        text = _read_banner(proc)
        assert f"http://127.0.0.1:{gateway_port}/v1" in text and "curl" in text, text
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway_port}/v1", api_key="none")
        reply = client.completions.create(
            model="demo-llama", prompt="Once upon a time", max_tokens=completion_tokens
        )
        assert reply.usage.completion_tokens == completion_tokens
        assert len(live_pids(pattern)) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        _wait_gone(pattern)
    finally:
        if proc.poll() is None:
            proc.kill()  # the children get SIGTERM from the kernel when their parent dies


def test_run_stack_serves_the_demo_model_and_stops_cleanly(tmp_path):
    model = write_demo_model(tmp_path / "demo-llama")
    assert write_demo_model(model) == model  # idempotent: a second run keeps the folder
    _serve_and_stop(model)


def test_the_stack_starts_and_stops_twenty_times_in_a_row(tmp_path):
    # A first run once died with SIGABRT: the launcher had started gRPC (a health check) and then
    # forked the gateway, whose child side of gRPC's fork handling aborted on a closed epoll fd.
    model = write_demo_model(tmp_path / "demo-llama")
    for _ in range(20):
        _serve_and_stop(model, completion_tokens=1)


def test_the_launcher_never_starts_grpc():
    # Forking (subprocess with preexec_fn) after gRPC has started threads can abort the child.
    code = "import sys, conduit_engine.run_stack; sys.exit('grpc' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_children_die_with_a_killed_launcher(tmp_path):
    model = write_demo_model(tmp_path / "demo-llama")
    engine_port, gateway_port = free_port(), free_port()
    proc = _start_launcher(model, engine_port, gateway_port)
    pattern = f"[-]-port {engine_port}|[-]-port {gateway_port}"
    try:
        _read_banner(proc)
        proc.kill()  # SIGKILL: the launcher cannot clean up itself
        proc.wait(timeout=30)
        _wait_gone(pattern)
    finally:
        subprocess.run(["pkill", "-f", pattern], capture_output=True)
