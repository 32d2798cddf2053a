"""`make run`'s launcher: without a model it serves HuggingFaceTB/SmolLM2-135M-Instruct from the Hub cache,
or offline with nothing cached the demo model, saying why; engine + gateway serve it; SIGTERM stops both.

No network reaches the Hub here: the default model's cache entry holds stories260K (tests/support/hub.py),
which huggingface_hub finds offline exactly as it would find the real download.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import openai
import pytest

from conduit_engine.demo_model import write_demo_model
from conduit_engine.run_stack import DEFAULT_MODEL, choose_model
from tests.engine.test_parity import KNOWN_STORY
from tests.support.hub import lay_out_hub_cache
from tests.support.processes import free_port


@pytest.fixture
def offline_hub(tmp_path, monkeypatch) -> dict[str, str]:
    """An offline Hub with an empty cache, in this process's environment (children inherit it)."""
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HOME": str(tmp_path / "home")}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


def launch(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "conduit_engine.run_stack", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ),
    )


def read_banner(proc: subprocess.Popen[str]) -> str:
    lines = []
    for line in proc.stdout:  # type: ignore[union-attr]
        lines.append(line)
        if "Ctrl-C stops both" in line:
            break
    return "".join(lines)


def test_the_default_model_is_served_from_the_cache(offline_hub, tmp_path, stories_path):
    lay_out_hub_cache(tmp_path / "hub", DEFAULT_MODEL, stories_path)
    assert choose_model(str(tmp_path / "demo")) == (DEFAULT_MODEL, None)
    assert not (tmp_path / "demo").exists()


def test_offline_with_nothing_cached_falls_back_to_the_demo_model(offline_hub, tmp_path):
    model, reason = choose_model(str(tmp_path / "demo"))
    assert model == str(tmp_path / "demo") and (tmp_path / "demo" / "model.safetensors").is_file()
    assert reason is not None
    assert reason.startswith(f"model '{DEFAULT_MODEL}' is not in the cache {tmp_path / 'hub'}")
    assert "the Hub is offline (HF_HUB_OFFLINE=1)" in reason


def test_a_hub_id_that_cannot_be_fetched_stops_the_launcher_with_the_reason(offline_hub):
    proc = launch("--model", "conduit-test/absent")
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert output.strip() == (
        "cannot serve conduit-test/absent: model 'conduit-test/absent' is not in the cache "
        f"{offline_hub['HF_HUB_CACHE']} and the Hub is offline (HF_HUB_OFFLINE=1): fetch it once with "
        "network access (or unset HF_HUB_OFFLINE), or pass --model a local folder"
    )


def test_run_stack_serves_the_cached_default_model(offline_hub, tmp_path, stories_path):
    lay_out_hub_cache(tmp_path / "hub", DEFAULT_MODEL, stories_path)
    engine_port, gateway_port = free_port(), free_port()
    proc = launch(
        "--demo-dir",
        str(tmp_path / "demo"),
        "--engine-port",
        str(engine_port),
        "--gateway-port",
        str(gateway_port),
    )
    try:
        text = read_banner(proc)
        assert f"Conduit is serving {DEFAULT_MODEL!r}" in text and "demo" not in text
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway_port}/v1", api_key="none")
        reply = client.completions.create(model=DEFAULT_MODEL, prompt=[1], max_tokens=62, temperature=0)
        assert reply.choices[0].text.strip() == KNOWN_STORY
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


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


def test_run_stack_offline_serves_the_demo_model_says_why_and_stops_cleanly(offline_hub, tmp_path):
    model = tmp_path / "demo-llama"
    engine_port, gateway_port = free_port(), free_port()
    proc = launch(
        "--demo-dir", str(model), "--engine-port", str(engine_port), "--gateway-port", str(gateway_port)
    )
    try:
        text = read_banner(proc)
        assert f"{DEFAULT_MODEL} is not available: model '{DEFAULT_MODEL}' is not in the cache" in text
        assert f"Serving the random demo model from {model} instead: its text is meaningless." in text
        assert write_demo_model(model) == model  # idempotent: a second run keeps the folder
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
