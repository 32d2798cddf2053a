"""A client that leaves mid-stream (closes the connection, presses stop) is charged exactly the tokens the
engine generated for it, not its worst case: the real engine on stories260K behind the real gateway app
with a keys file and a standing rate-limit clock, so the charge is read exactly from the key's
x-ratelimit headers, and what the engine generated from its own Prometheus counter."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal

import grpc
import httpx
import pytest

from tests.gateway.conftest import MODEL as FAKE_MODEL
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


def leave_after(gateway, engine, path: str, body: dict, chunks: int, most: int) -> tuple[int, float]:
    """Stream `body`, close the connection after `chunks` data events; (tokens charged, generated).

    The engine process is stopped (SIGSTOP) from the last read event until the gateway has seen the
    client leave and begun draining. On a loaded machine the engine may still have generated all `most`
    tokens before this client read its events (the gateway, a thread of this process, reads them
    meanwhile): the request is then charged all of them, rightly, and the leave is tried again."""
    for _ in range(5):
        spent, before = charged(gateway), generated()
        seen = 0
        try:
            with httpx.Client(base_url=gateway.url, timeout=60) as client:
                with client.stream(
                    "POST", path, json={**body, "stream": True}, headers={"Authorization": "Bearer sk-team"}
                ) as response:
                    assert response.status_code == 200
                    for line in response.iter_lines():
                        if line.startswith("data: {"):
                            seen += 1
                            if seen == chunks:
                                os.kill(engine.process.pid, signal.SIGSTOP)
                                break
            if seen == chunks:
                wait_for(lambda: bool(gateway.ctx.drains), "the gateway to see the client leave")
        finally:
            os.kill(engine.process.pid, signal.SIGCONT)
        assert seen == chunks
        wait_for(lambda: settled(gateway), "the gateway to drain and settle the request")
        wait_for(
            lambda: engine_metric("conduit_engine_requests_running") == 0, "the engine to end the request"
        )
        used, made = charged(gateway) - spent, generated() - before
        if made < most:
            break
    return used, made


def test_a_completion_left_after_a_few_chunks_is_charged_what_the_engine_generated(gateway, stories_engine):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    used, made = leave_after(gateway, stories_engine, "/v1/completions", body, chunks=2, most=MAX_TOKENS)
    assert made >= 2
    assert used == PROMPT_TOKENS + made
    assert used < PROMPT_TOKENS + MAX_TOKENS  # the worst case it was charged before
    assert engine_metric("conduit_engine_kv_blocks_used") == 0


def test_a_chat_completion_left_mid_stream_is_charged_what_the_engine_generated(gateway, stories_engine):
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
    used, made = leave_after(
        gateway, stories_engine, "/v1/chat/completions", body, chunks=2, most=CHAT_MAX_TOKENS
    )
    assert made >= 1
    assert used == prompt_tokens + made
    assert used < prompt_tokens + CHAT_MAX_TOKENS
    assert engine_metric("conduit_engine_kv_blocks_used") == 0


def test_an_anthropic_message_stream_left_mid_way_is_charged_what_the_engine_generated(
    gateway, stories_engine
):
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": CHAT_MAX_TOKENS}
    spent = charged(gateway)
    with httpx.Client(base_url=gateway.url, timeout=60) as client:
        done = client.post(
            "/v1/messages", json={**body, "max_tokens": 1}, headers={"x-api-key": "sk-team"}
        ).json()
    # Anthropic's input_tokens leaves out the prompt's cached tokens (cache_read_input_tokens).
    prompt_tokens = done["usage"]["input_tokens"] + done["usage"].get("cache_read_input_tokens", 0)
    assert charged(gateway) - spent == prompt_tokens + 1
    # message_start and content_block_start come first: leave at the second text delta. (The Messages
    # API has no ignore_eos: the story may end first, and is then charged its usage all the same.)
    used, made = leave_after(gateway, stories_engine, "/v1/messages", body, chunks=4, most=CHAT_MAX_TOKENS)
    assert made >= 1
    assert used == prompt_tokens + made
    assert used < prompt_tokens + CHAT_MAX_TOKENS
    assert engine_metric("conduit_engine_kv_blocks_used") == 0


def test_n_2_left_mid_stream_is_charged_both_choices_tokens(gateway, stories_engine):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "n": 2, "ignore_eos": True}
    used, made = leave_after(gateway, stories_engine, "/v1/completions", body, chunks=2, most=2 * MAX_TOKENS)
    assert made >= 2
    assert used == PROMPT_TOKENS + made
    assert used < PROMPT_TOKENS + 2 * MAX_TOKENS
    assert engine_metric("conduit_engine_kv_blocks_used") == 0


def test_two_prompts_left_mid_stream_are_charged_every_token_of_both(gateway, stories_engine):
    body = {"model": MODEL, "prompt": [PROMPT, PROMPT], "max_tokens": MAX_TOKENS, "ignore_eos": True}
    used, made = leave_after(gateway, stories_engine, "/v1/completions", body, chunks=2, most=2 * MAX_TOKENS)
    assert used == 2 * PROMPT_TOKENS + made
    assert used < 2 * (PROMPT_TOKENS + MAX_TOKENS)
    assert engine_metric("conduit_engine_kv_blocks_used") == 0


# -- faults (the scriptable fake engine) ------------------------------------------------------------

FAKE_PROMPT = "a b c"
FAKE_PROMPT_TOKENS = 4  # what the fake counts for it
FAKE_MAX_TOKENS = 40


@pytest.fixture
def fake_gateway(fake, tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps([{"name": "team", "key": "sk-team", "limits": {"tokens_per_minute": LIMIT}}]))
    gateway = GatewayThread([fake.address], clock=ManualClock(0.0), api_keys_file=str(path)).start()
    try:
        yield gateway
    finally:
        gateway.stop()


def leave_held_stream(gateway, fake) -> None:
    """Stream a completion the fake holds after 3 tokens, and leave once 2 have arrived."""
    body = {"model": FAKE_MODEL, "prompt": FAKE_PROMPT, "max_tokens": FAKE_MAX_TOKENS, "stream": True}
    seen = 0
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        with client.stream(
            "POST", "/v1/completions", json=body, headers={"Authorization": "Bearer sk-team"}
        ) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    seen += 1
                    if seen == 2:
                        break
    wait_for(lambda: len(fake.record.aborted) == 1, "the gateway to abort the left request")


def test_an_engine_that_fails_the_abort_leaves_the_worst_case_charged(fake, fake_gateway):
    fake.script.hold_after = 3
    fake.script.abort_error = grpc.StatusCode.UNAVAILABLE
    leave_held_stream(fake_gateway, fake)
    wait_for(lambda: settled(fake_gateway), "the gateway to give up the drain and settle")
    # What the engine generated past the gateway's last read is unknown: the prompt's worst case stays.
    assert charged(fake_gateway) == FAKE_PROMPT_TOKENS + FAKE_MAX_TOKENS
    assert fake.record.aborted == [fake.record.requests[0].request_id]
    wait_for(lambda: fake.record.cancelled == 1, "the call to be cancelled")


def test_a_gateway_stopping_mid_drain_charges_the_worst_case_and_leaks_nothing(fake, fake_gateway):
    fake.script.hold_after = 3
    fake.script.abort_held = True  # the drain waits on the Abort when the gateway stops
    leave_held_stream(fake_gateway, fake)
    assert len(fake_gateway.ctx.drains) == 1
    fake_gateway.stop()
    assert not fake_gateway.ctx.drains
    assert charged(fake_gateway) == FAKE_PROMPT_TOKENS + FAKE_MAX_TOKENS
    assert fake_gateway.ctx.limiter.active == 0
    assert all(node.in_flight == 0 for node in fake_gateway.ctx.pool.engines)


def test_a_stream_that_does_not_end_after_the_abort_is_given_up_with_the_worst_case(fake, fake_gateway):
    fake.script.hold_after = 3  # the fake's Abort answers but the held stream goes on holding
    leave_held_stream(fake_gateway, fake)
    wait_for(lambda: settled(fake_gateway), "the drain to time out and settle")
    assert charged(fake_gateway) == FAKE_PROMPT_TOKENS + FAKE_MAX_TOKENS
    wait_for(lambda: fake.record.cancelled == 1, "the call to be cancelled")


async def _leave_while_the_fake_holds(gateway, fake, body: dict) -> None:
    """Send `body` and leave once the fake has the request (it holds its first message)."""
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        request = asyncio.create_task(
            client.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-team"})
        )
        while not fake.record.requests:
            await asyncio.sleep(0.005)
        request.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await request


def test_a_request_left_while_opening_whose_first_message_is_its_last_is_charged_that_message(
    fake, fake_gateway
):
    # The engine merges a slow reader's waiting outputs (a token, then the end the Abort made): the first
    # message the gateway reads of a request the client left while it opened can be its last one, and its
    # usage is all there is to charge.
    fake.script.hold_after = 0
    body = {"model": FAKE_MODEL, "prompt": FAKE_PROMPT, "max_tokens": 1}
    asyncio.run(_leave_while_the_fake_holds(fake_gateway, fake, body))
    wait_for(lambda: bool(fake.record.aborted), "the gateway to abort the request it left opening")
    fake.release()
    wait_for(lambda: settled(fake_gateway), "the gateway to drain and settle the request")
    assert charged(fake_gateway) == FAKE_PROMPT_TOKENS + 1
