"""A key is charged the tokens of a stream that moved to another engine, those its first engine generated
before it was SIGKILLed included: the real engines on stories260K behind the real gateway app with a keys
file and a standing rate-limit clock, so the charge is read exactly from the key's x-ratelimit headers."""

from __future__ import annotations

import json

import openai
import pytest

from tests.routing.helpers import MODEL, nodes
from tests.support.clock import ManualClock

pytestmark = pytest.mark.integration

TOKENS = 480
LIMIT = 100_000
ATTEMPTS = 5


def test_a_migrated_stream_is_charged_every_token_it_got_from_both_engines(fleet, make_gateway, tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps([{"name": "team", "key": "sk-team", "limits": {"tokens_per_minute": LIMIT}}]))
    gateway = make_gateway(fleet.addresses, clock=ManualClock(0.0), api_keys_file=str(path))
    key = gateway.ctx.api_keys.keys[0]
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="sk-team", max_retries=0)
    killed: list[int] = []
    try:
        for _ in range(ATTEMPTS):
            spent = LIMIT - int(gateway.ctx.rate_limiter.headers(key)["x-ratelimit-remaining-tokens"])
            routed = {address: view["routed"] for address, view in nodes(gateway.url).items()}
            stream = client.completions.create(
                model=MODEL,
                prompt="Once upon a time",
                max_tokens=TOKENS,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            usage, victim = None, None
            for chunk in stream:
                if victim is None:
                    # Its first token is here: stop the engine that serves it, then, if the stream is
                    # still open (the gateway, a thread of this process, may have read every token by
                    # now on a loaded machine), SIGKILL it mid-stream.
                    (address,) = [a for a, view in nodes(gateway.url).items() if view["routed"] > routed[a]]
                    victim = fleet.addresses.index(address)
                    fleet.pause(victim)
                    if nodes(gateway.url)[address]["in_flight"]:
                        fleet.kill(victim)
                        killed.append(victim)
                    else:
                        fleet.resume(victim)
                if chunk.usage is not None:
                    usage = chunk.usage
            assert usage is not None and usage.completion_tokens == TOKENS
            if killed:
                break
        assert killed, f"every stream of {ATTEMPTS} ended before its first token was read"
        assert gateway.ctx.metrics.migrations.labels("unavailable")._value.get() == 1
        headers = gateway.ctx.rate_limiter.headers(key)
        assert LIMIT - int(headers["x-ratelimit-remaining-tokens"]) - spent == usage.total_tokens
    finally:
        for victim in killed:
            fleet.restart(victim)
