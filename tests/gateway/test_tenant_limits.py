"""Tenants cannot spend more than their keys allow, written as the attacks: the real engine on stories260K
(one sequence at a time, so later prompts of a request queue) behind the real gateway app with a keys
file, driven with the official openai and anthropic SDKs and httpx. The rate limits' clock stands still,
so what a key was charged is read exactly from its x-ratelimit headers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys

import anthropic
import httpx
import openai
import pytest

from tests.support.clock import ManualClock
from tests.support.gateway_thread import GatewayThread
from tests.support.polling import wait_for
from tests.support.processes import free_port
from tests.support.prometheus import scrape
from tests.support.stories import MODEL, PROMPT

pytestmark = pytest.mark.integration

METRICS_PORT = free_port()
ENGINE_ARGS = ("--max-num-seqs", "1", "--metrics-port", str(METRICS_PORT))  # read by stories_engine
CONTEXT = 512  # stories260K's max_model_len

KEYS = [
    {"name": "small", "key": "sk-small", "limits": {"tokens_per_minute": 200}},
    {"name": "roomy", "key": "sk-roomy", "limits": {"tokens_per_minute": 5000}},
    {"name": "counted", "key": "sk-counted", "limits": {"requests_per_minute": 3}},
    {"name": "single", "key": "sk-single", "limits": {"max_concurrent_requests": 1}},
    {"name": "leaver", "key": "sk-leaver", "limits": {"tokens_per_minute": 100_000}},
]


@pytest.fixture(scope="module")
def gateway(stories_engine, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps(KEYS))
    with GatewayThread([stories_engine.address], clock=ManualClock(0.0), api_keys_file=str(path)) as gw:
        yield gw


def sdk(gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0)


def generated() -> float:
    """Tokens the engine has sampled so far (its Prometheus counter)."""
    return scrape(f"http://127.0.0.1:{METRICS_PORT}/metrics").value("conduit_engine_generation_tokens_total")


def engine_idle() -> bool:
    metrics = scrape(f"http://127.0.0.1:{METRICS_PORT}/metrics")
    return (
        metrics.value("conduit_engine_requests_running") + metrics.value("conduit_engine_requests_waiting")
        == 0
    )


def charged(gateway, name: str) -> int:
    """Tokens the key has been charged: its limit less what its x-ratelimit headers say remains."""
    key = next(key for key in gateway.ctx.api_keys.keys if key.name == name)
    headers = gateway.ctx.rate_limiter.headers(key)
    return int(headers["x-ratelimit-limit-tokens"]) - int(headers["x-ratelimit-remaining-tokens"])


def too_large(requested: int) -> str:
    return (
        f"Request too large for API key 'small' on tokens per min (TPM): Limit 200, Requested {requested}: "
        "the prompt plus every choice's max_tokens (without max_tokens, the rest of the model's context). "
        "The input or output tokens must be reduced in order to run successfully."
    )


def test_n_100_on_a_200_tpm_key_is_refused_before_any_token_is_generated(gateway):
    before = generated()
    with pytest.raises(openai.RateLimitError) as refused:
        sdk(gateway, "sk-small").completions.create(model=MODEL, prompt=PROMPT, n=100, max_tokens=400)
    assert refused.value.status_code == 429
    assert refused.value.body == {
        "message": too_large(40_000),
        "type": "tokens",
        "param": None,
        "code": "rate_limit_exceeded",
    }
    # Without max_tokens a chat choice may fill the context: n x 512 is reserved.
    with pytest.raises(openai.RateLimitError) as chat:
        sdk(gateway, "sk-small").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], n=100
        )
    assert chat.value.body["message"] == too_large(100 * CONTEXT)
    assert generated() == before
    assert charged(gateway, "small") == 0


def test_50_prompts_times_n_20_is_refused_and_so_are_the_responses_and_messages_apis(gateway):
    before = generated()
    with pytest.raises(openai.RateLimitError) as refused:
        sdk(gateway, "sk-small").completions.create(model=MODEL, prompt=[PROMPT] * 50, n=20, max_tokens=50)
    assert refused.value.body["message"] == too_large(50_000)
    assert refused.value.body["code"] == "rate_limit_exceeded"
    with pytest.raises(openai.RateLimitError) as responses:
        sdk(gateway, "sk-small").responses.create(model=MODEL, input=PROMPT, max_output_tokens=400)
    assert responses.value.body["message"] == too_large(400)
    claude = anthropic.Anthropic(base_url=gateway.url, api_key="sk-small", max_retries=0)
    with pytest.raises(anthropic.RateLimitError) as messages:
        claude.messages.create(model=MODEL, max_tokens=400, messages=[{"role": "user", "content": PROMPT}])
    assert messages.value.status_code == 429
    assert messages.value.body["type"] == "error"
    assert messages.value.body["error"] == {"type": "rate_limit_error", "message": too_large(400)}
    assert generated() == before


def test_a_request_within_the_limit_is_charged_what_it_used_and_gets_the_rest_back(gateway):
    client = sdk(gateway, "sk-roomy")
    spent = charged(gateway, "roomy")
    # 5 + 2 x 300 tokens are reserved; the choices stop at their first full stop, far sooner.
    reply = client.completions.create(model=MODEL, prompt=PROMPT, n=2, max_tokens=300, stop=["."])
    assert charged(gateway, "roomy") - spent == reply.usage.total_tokens < 5 + 2 * 300


async def _leave_while_generating(gateway, engine, body: dict) -> None:
    """Send `body` and leave (close the connection) once the gateway has its first prompt's stream open
    (the key's charge then holds that prompt's exact tokens) and the engine has sampled a token of it.
    The engine is held (SIGSTOP) from then until the gateway has taken the leaving in hand, so that the
    prompt is still generating when its Abort reaches the engine, however slow this machine is."""
    start, spent = generated(), charged(gateway, "roomy")
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
        request = asyncio.create_task(
            client.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-roomy"})
        )
        # Admission reserves 3 x max_tokens (a text prompt's tokens are not known before its stream
        # opens); the first prompt's opening adds its 5 prompt tokens.
        while generated() == start or charged(gateway, "roomy") - spent <= 3 * body["max_tokens"]:
            assert not request.done(), "the request ended before the client could leave"
            await asyncio.sleep(0.005)
        os.kill(engine.process.pid, signal.SIGSTOP)
        try:
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request
            # The gateway hands the left stream to a drain, which sends the Abort (within its 2 s limit).
            for _ in range(1000):
                if gateway.ctx.drains:
                    break
                await asyncio.sleep(0.005)
            else:
                raise AssertionError("the gateway did not drain the stream the client left")
        finally:
            os.kill(engine.process.pid, signal.SIGCONT)


async def _send_and_leave_after(url: str, body: dict, seconds: float) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        request = asyncio.create_task(
            client.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-leaver"})
        )
        await asyncio.sleep(seconds)
        request.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await request


def prompt_tokens() -> float:
    """Prompt tokens of the engine's requests that got a first token (its Prometheus counter)."""
    return scrape(f"http://127.0.0.1:{METRICS_PORT}/metrics").value("conduit_engine_prompt_tokens_total")


@pytest.mark.parametrize("seconds", [0.0, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03])
def test_a_client_leaving_at_any_moment_of_the_opening_is_charged_what_the_engine_generated(gateway, seconds):
    # Whether the client leaves before the engine has the request, while the engine generates its first
    # tokens but before the first message reaches the gateway (once charged nothing), or later, the key
    # pays the prompt and every token of each request the engine generated for, and nothing for one it
    # did not. (A request left so early that it reaches the gateway late counts where it runs: the engine's
    # counters and the charge both see it.)
    wait_for(engine_idle, "the engine to finish earlier requests")
    spent, before, prompts_before = charged(gateway, "leaver"), generated(), prompt_tokens()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 300, "ignore_eos": True}
    asyncio.run(_send_and_leave_after(gateway.url, body, seconds))
    wait_for(lambda: gateway.ctx.limiter.active == 0, "the gateway to let the request go")
    wait_for(engine_idle, "the engine to end the request")
    wait_for(lambda: not gateway.ctx.drains, "the gateway to drain what it left")
    made, prompted = generated() - before, prompt_tokens() - prompts_before
    assert charged(gateway, "leaver") - spent == prompted + made


def test_a_multi_prompt_request_left_while_its_last_prompt_queues_is_charged_every_token(
    gateway, stories_engine
):
    spent = charged(gateway, "roomy")
    before = generated()
    # One sequence at a time: the first prompt runs while the other two wait in the engine's queue.
    body = {"model": MODEL, "prompt": [PROMPT] * 3, "max_tokens": 500, "ignore_eos": True}
    asyncio.run(_leave_while_generating(gateway, stories_engine, body))
    wait_for(lambda: gateway.ctx.limiter.active == 0, "the gateway to let the request go")
    wait_for(engine_idle, "the engine to abort the request's prompts")
    wait_for(lambda: not gateway.ctx.drains, "the gateway to drain the prompt that had opened")
    made = generated() - before
    used = charged(gateway, "roomy") - spent
    assert made > 0
    # The first prompt's stream opened and was left running: it is aborted and read to its end, so the
    # key pays its prompt and every token the engine generated for it; the queued prompts never ran.
    assert used == 5 + made
    assert used < 5 + 500


def test_a_refused_request_counts_against_the_requests_per_minute(gateway):
    client = sdk(gateway, "sk-counted")
    with pytest.raises(openai.BadRequestError) as too_long:  # the engine refuses it: past the context
        client.completions.create(model=MODEL, prompt=PROMPT * 200, max_tokens=4)
    assert too_long.value.status_code == 400
    # The gateway's validation refuses this one before any handler runs.
    invalid = httpx.post(
        f"{gateway.url}/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": "many"},
        headers={"Authorization": "Bearer sk-counted"},
    )
    assert invalid.status_code == 400
    assert invalid.json()["error"]["param"] == "max_tokens"
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.RateLimitError) as refused:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert refused.value.body["type"] == "requests"
    assert refused.value.body["message"].startswith(
        "Rate limit reached for API key 'counted' on requests per min (RPM): Limit 3, Used 3, Requested 1."
    )


def test_max_concurrent_requests_refuses_a_second_and_a_client_leaving_mid_stream_frees_the_slot(
    gateway, stories_engine
):
    client = sdk(gateway, "sk-single")
    key = next(key for key in gateway.ctx.api_keys.keys if key.name == "single")
    with client.completions.with_streaming_response.create(
        model=MODEL, prompt=PROMPT, max_tokens=400, stream=True, extra_body={"ignore_eos": True}
    ) as streamed:
        lines = streamed.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        os.kill(stories_engine.process.pid, signal.SIGSTOP)  # the stream is held mid-way
        try:
            with pytest.raises(openai.RateLimitError) as refused:
                client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
            assert refused.value.body == {
                "message": "Too many concurrent requests for API key 'single': Limit 1, In progress 1. "
                "Wait for one to finish.",
                "type": "requests",
                "param": None,
                "code": "rate_limit_exceeded",
            }
        finally:
            os.kill(stories_engine.process.pid, signal.SIGCONT)
    # The client left mid-stream (the context closed the response): the slot comes back.
    wait_for(lambda: gateway.ctx.rate_limiter.in_progress(key) == 0, "the key's slot to come back")
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_a_non_ascii_key_stops_the_gateway_at_start_up_naming_the_line(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(
        "keys:\n  - name: fine\n    key: sk-fine\n  - name: accented\n    key: sk-caf\u00e9\n",
        encoding="utf-8",
    )
    args = [sys.executable, "-m", "conduit_gateway.cli", "--engine", "127.0.0.1:9", "--api-keys-file"]
    done = subprocess.run([*args, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"--api-keys-file: {path}: keys[1].key at line 5: must be ASCII" in done.stderr
    assert "caf\u00e9" not in done.stderr
