"""A client that leaves mid-stream (closes the connection, presses stop) is charged exactly the tokens the
engine generated for it, not its worst case: the real engine on stories260K behind the real gateway app
with a keys file and a standing rate-limit clock, so the charge is read exactly from the key's
x-ratelimit headers, and what the engine generated from its own Prometheus counter."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.clock import ManualClock
from tests.support.gateway_thread import GatewayThread
from tests.support.polling import wait_for
from tests.support.processes import free_port
from tests.support.prometheus import scrape
from tests.support.stories import MODEL, PROMPT

pytestmark = pytest.mark.integration

METRICS_PORT = free_port()
ENGINE_ARGS = ("--metrics-port", str(METRICS_PORT))  # read by stories_engine
LIMIT = 100_000
PROMPT_TOKENS = 5  # PROMPT's tokens, the BOS included
# The context is 512: with these the engine is still generating when the client leaves.
MAX_TOKENS = 500
CHAT_MAX_TOKENS = 480  # the chat template's tokens come on top of the prompt's


@pytest.fixture(scope="module")
def gateway(stories_engine, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps([{"name": "team", "key": "sk-team", "limits": {"tokens_per_minute": LIMIT}}]))
    with GatewayThread([stories_engine.address], clock=ManualClock(0.0), api_keys_file=str(path)) as gw:
        yield gw


def engine_metric(name: str) -> float:
    return scrape(f"http://127.0.0.1:{METRICS_PORT}/metrics").value(name)


def generated() -> float:
    """Tokens the engine has sampled so far."""
    return engine_metric("conduit_engine_generation_tokens_total")


def charged(gateway) -> int:
    key = gateway.ctx.api_keys.keys[0]
    headers = gateway.ctx.rate_limiter.headers(key)
    return int(headers["x-ratelimit-limit-tokens"]) - int(headers["x-ratelimit-remaining-tokens"])


def settled(gateway) -> bool:
    return (
        gateway.ctx.limiter.active == 0
        and not gateway.ctx.drains
        and not any(node.in_flight for node in gateway.ctx.pool.engines)
    )


def leave_after(gateway, path: str, body: dict, chunks: int) -> tuple[int, float]:
    """Stream `body`, close the connection after `chunks` data events; (tokens charged, generated)."""
    spent, before = charged(gateway), generated()
    seen = 0
    with httpx.Client(base_url=gateway.url, timeout=60) as client:
        with client.stream(
            "POST", path, json={**body, "stream": True}, headers={"Authorization": "Bearer sk-team"}
        ) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    seen += 1
                    if seen == chunks:
                        break
    assert seen == chunks
    wait_for(lambda: settled(gateway), "the gateway to drain and settle the request")
    wait_for(lambda: engine_metric("conduit_engine_requests_running") == 0, "the engine to end the request")
    return charged(gateway) - spent, generated() - before


def test_a_completion_left_after_a_few_chunks_is_charged_what_the_engine_generated(gateway):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    used, made = leave_after(gateway, "/v1/completions", body, chunks=2)
    assert made >= 2
    assert used == PROMPT_TOKENS + made
    assert used < PROMPT_TOKENS + MAX_TOKENS  # the worst case it was charged before
    assert engine_metric("conduit_engine_kv_blocks_used") == 0


def test_a_chat_completion_left_mid_stream_is_charged_what_the_engine_generated(gateway):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": CHAT_MAX_TOKENS,
        "ignore_eos": True,
    }
    spent = charged(gateway)
    # The chat template adds tokens: the prompt's count is what the engine reports for a finished request.
    with httpx.Client(base_url=gateway.url, timeout=60) as client:
        done = client.post(
            "/v1/chat/completions",
            json={**body, "max_tokens": 1},
            headers={"Authorization": "Bearer sk-team"},
        ).json()
    prompt_tokens = done["usage"]["prompt_tokens"]
    assert charged(gateway) - spent == prompt_tokens + 1
    used, made = leave_after(gateway, "/v1/chat/completions", body, chunks=2)
    assert made >= 1
    assert used == prompt_tokens + made
    assert used < prompt_tokens + CHAT_MAX_TOKENS
    assert engine_metric("conduit_engine_kv_blocks_used") == 0


def test_n_2_left_mid_stream_is_charged_both_choices_tokens(gateway):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "n": 2, "ignore_eos": True}
    used, made = leave_after(gateway, "/v1/completions", body, chunks=2)
    assert made >= 2
    assert used == PROMPT_TOKENS + made
    assert used < PROMPT_TOKENS + 2 * MAX_TOKENS
    assert engine_metric("conduit_engine_kv_blocks_used") == 0


def test_two_prompts_left_mid_stream_are_charged_every_token_of_both(gateway):
    body = {"model": MODEL, "prompt": [PROMPT, PROMPT], "max_tokens": MAX_TOKENS, "ignore_eos": True}
    used, made = leave_after(gateway, "/v1/completions", body, chunks=2)
    assert used == 2 * PROMPT_TOKENS + made
    assert used < 2 * (PROMPT_TOKENS + MAX_TOKENS)
    assert engine_metric("conduit_engine_kv_blocks_used") == 0
