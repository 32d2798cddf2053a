"""`make run`'s launcher: without a model it serves HuggingFaceTB/SmolLM2-135M-Instruct from the Hub cache,
or offline with nothing cached the demo model, saying why; engine + gateway serve it; SIGTERM stops both.

No network reaches the Hub here: the default model's cache entry holds stories260K (tests/support/hub.py),
which huggingface_hub finds offline exactly as it would find the real download.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import openai
import pytest

from conduit_engine.entrypoints.run_stack import DEFAULT_MODEL, choose_model
from conduit_engine.models.demo_model import write_demo_model
from tests.support.hub import lay_out_hub_cache
from tests.support.processes import free_port
from tests.support.stories import KNOWN_STORY

pytestmark = pytest.mark.integration


@pytest.fixture
def offline_hub(tmp_path, monkeypatch) -> dict[str, str]:
    """An offline Hub with an empty cache, in this process's environment (children inherit it)."""
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HOME": str(tmp_path / "home")}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


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


def _start_launcher(model, engine_port: int, gateway_port: int, *extra: str) -> subprocess.Popen[str]:
    """The launcher serving `model` (None: its own choice)."""
    args = [*(["--model", str(model)] if model is not None else []), *extra]
    args += ["--engine-port", str(engine_port), "--gateway-port", str(gateway_port)]
    return subprocess.Popen(
        [sys.executable, "-m", "conduit_engine.entrypoints.run_stack", *args],
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


def _serve_and_stop(model, completion_tokens: int = 5, *extra: str) -> str:
    """One full cycle: start, serve one completion, SIGTERM, everything gone, exit code 0. Returns the
    launcher's output up to its banner."""
    engine_port, gateway_port = free_port(), free_port()
    proc = _start_launcher(model, engine_port, gateway_port, *extra)
    pattern = f"[-]-port {engine_port}|[-]-port {gateway_port}"
    try:
        text = _read_banner(proc)
        assert f"http://127.0.0.1:{gateway_port}/v1" in text and "curl" in text, text
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway_port}/v1", api_key="none")
        reply = client.completions.create(
            model="demo-llama",
            prompt="Once upon a time",
            max_tokens=completion_tokens,
            extra_body={"ignore_eos": True},  # a sampled </s> (random weights) would end it early
        )
        assert reply.usage.completion_tokens == completion_tokens
        assert len(live_pids(pattern)) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        _wait_gone(pattern)
    finally:
        if proc.poll() is None:
            proc.kill()  # the children get SIGTERM from the kernel when their parent dies
    return text


def test_run_stack_serves_the_demo_model_and_stops_cleanly(tmp_path):
    model = write_demo_model(tmp_path / "demo-llama")
    assert write_demo_model(model) == model  # idempotent: a second run keeps the folder
    _serve_and_stop(model)


def test_offline_with_nothing_cached_the_launcher_serves_the_demo_model_and_says_why(offline_hub, tmp_path):
    model = tmp_path / "demo-llama"
    text = _serve_and_stop(None, 5, "--demo-dir", str(model))
    assert f"{DEFAULT_MODEL} is not available: model '{DEFAULT_MODEL}' is not in the cache" in text
    assert f"Serving the random demo model from {model} instead: its text is meaningless." in text


def test_the_default_model_is_chosen_from_the_cache(offline_hub, tmp_path, stories_path):
    lay_out_hub_cache(tmp_path / "hub", DEFAULT_MODEL, stories_path)
    assert choose_model(str(tmp_path / "demo")) == (DEFAULT_MODEL, None)
    assert not (tmp_path / "demo").exists()


def test_offline_with_nothing_cached_the_choice_is_the_demo_model(offline_hub, tmp_path):
    model, reason = choose_model(str(tmp_path / "demo"))
    assert model == str(tmp_path / "demo") and (tmp_path / "demo" / "model.safetensors").is_file()
    assert reason is not None
    assert reason.startswith(f"model '{DEFAULT_MODEL}' is not in the cache {tmp_path / 'hub'}")
    assert "the Hub is offline (HF_HUB_OFFLINE=1)" in reason


def test_a_hub_id_that_cannot_be_fetched_stops_the_launcher_with_the_reason(offline_hub):
    proc = _start_launcher("conduit-test/absent", free_port(), free_port())
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert output.strip() == (
        "cannot serve conduit-test/absent: model 'conduit-test/absent' is not in the cache "
        f"{offline_hub['HF_HUB_CACHE']} and the Hub is offline (HF_HUB_OFFLINE=1): fetch it once with "
        "network access (or unset HF_HUB_OFFLINE), or pass --model a local folder"
    )


def test_the_launcher_serves_the_cached_default_model(offline_hub, tmp_path, stories_path):
    lay_out_hub_cache(tmp_path / "hub", DEFAULT_MODEL, stories_path)
    engine_port, gateway_port = free_port(), free_port()
    proc = _start_launcher(None, engine_port, gateway_port, "--demo-dir", str(tmp_path / "demo"))
    try:
        text = _read_banner(proc)
        assert f"Conduit is serving {DEFAULT_MODEL!r}" in text and "demo" not in text
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway_port}/v1", api_key="none")
        reply = client.completions.create(model=DEFAULT_MODEL, prompt=[1], max_tokens=62, temperature=0)
        assert reply.choices[0].text.strip() == KNOWN_STORY
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_stack_starts_and_stops_five_times_in_a_row(tmp_path):
    # A first run once died with SIGABRT: the launcher had started gRPC (a health check) and then
    # forked the gateway, whose child side of gRPC's fork handling aborted on a closed epoll fd. The
    # cause is ruled out by test_the_launcher_never_starts_grpc; these starts catch what else may race.
    model = write_demo_model(tmp_path / "demo-llama")
    for _ in range(5):
        _serve_and_stop(model, completion_tokens=1)


def test_the_launcher_never_starts_grpc():
    # Forking (subprocess with preexec_fn) after gRPC has started threads can abort the child.
    code = "import sys, conduit_engine.entrypoints.run_stack; sys.exit('grpc' in sys.modules)"
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
