"""Per-key limits through the real app and the official SDK: a keys file, a fake engine whose token
counts are exact, and a hand-set clock, so every x-ratelimit header and every 429 is exact."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.gateway.conftest import MODEL
from tests.support.clock import ManualClock
from tests.support.gateway_thread import GatewayThread

pytestmark = pytest.mark.integration

KEYS = [
    {"name": "team", "key": "sk-team", "limits": {"requests_per_minute": 2, "tokens_per_minute": 60}},
    {"name": "batch", "key": "sk-batch"},
    {"name": "ranked", "key": "sk-ranked", "priority": [-5, 5]},
]
PROMPT = [1, 2, 3, 4]  # four prompt tokens, as the fake engine counts them


@pytest.fixture(scope="module")
def limited(fake_engine_server, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps(KEYS))
    clock = ManualClock(0.0)
    settings = {"api_keys_file": str(path), "api_keys": ("sk-flag",)}
    with GatewayThread([fake_engine_server.address], clock=clock, **settings) as gateway:
        yield gateway, clock


def sdk(gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0)


def limit_headers(headers) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.startswith("x-ratelimit-") or k == "retry-after"}


def test_requests_and_tokens_are_counted_exactly_and_the_third_request_gets_429(limited, fake):
    gateway, clock = limited
    client = sdk(gateway, "sk-team")
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=6)
    assert raw.parse().usage.total_tokens == 10
    assert limit_headers(raw.headers) == {
        "x-ratelimit-limit-requests": "2",
        "x-ratelimit-remaining-requests": "1",
        "x-ratelimit-reset-requests": "30s",
        "x-ratelimit-limit-tokens": "60",
        "x-ratelimit-remaining-tokens": "50",
        "x-ratelimit-reset-tokens": "10s",
    }
    with client.completions.with_streaming_response.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, stream=True
    ) as streamed:
        # Headers leave with the first chunk: the prompt and the output's worst case (6) are held.
        assert limit_headers(streamed.headers) == {
            "x-ratelimit-limit-requests": "2",
            "x-ratelimit-remaining-requests": "0",
            "x-ratelimit-reset-requests": "1m0s",
            "x-ratelimit-limit-tokens": "60",
            "x-ratelimit-remaining-tokens": "40",
            "x-ratelimit-reset-tokens": "20s",
        }
        chunks = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
        assert len([c for c in chunks if c["choices"] and c["choices"][0]["text"]]) == 6
    with pytest.raises(openai.RateLimitError) as refused:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6)
    assert refused.value.status_code == 429
    assert refused.value.body == {
        "message": "Rate limit reached for API key 'team' on requests per min (RPM): Limit 2, Used 2, "
        "Requested 1. Please try again in 30s.",
        "type": "requests",
        "param": None,
        "code": "rate_limit_exceeded",
    }
    assert limit_headers(refused.value.response.headers) == {
        "retry-after": "30",
        "x-ratelimit-limit-requests": "2",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "1m0s",
        "x-ratelimit-limit-tokens": "60",
        "x-ratelimit-remaining-tokens": "40",
        "x-ratelimit-reset-tokens": "20s",
    }
    assert fake.record.completed == 2  # the refused request never reached the engine
    clock.now = 30.0
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=6)
    assert raw.headers["x-ratelimit-remaining-requests"] == "0"
    # Tokens: 40 + 30 s x 1/s = 70, capped at 60, less this request's 10.
    assert raw.headers["x-ratelimit-remaining-tokens"] == "50"


def test_a_key_without_limits_gets_no_rate_limit_headers_and_unknown_keys_get_401(limited, fake):
    gateway, _ = limited
    raw = sdk(gateway, "sk-batch").completions.with_raw_response.create(
        model=MODEL, prompt=PROMPT, max_tokens=2
    )
    assert limit_headers(raw.headers) == {}
    for key in ("sk-nobody", "sk-tea"):
        with pytest.raises(openai.AuthenticationError) as refused:
            sdk(gateway, key).models.list()
        assert refused.value.body["message"] == "Incorrect API key provided."
    response = httpx.get(f"{gateway.url}/v1/models")
    assert response.status_code == 401


def test_priority_is_honoured_only_inside_a_keys_range_and_ignored_for_other_keys(limited, fake, caplog):
    gateway, _ = limited
    ranked = sdk(gateway, "sk-ranked")
    ranked.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"priority": -5})
    assert fake.record.requests[-1].priority == -5
    with pytest.raises(openai.BadRequestError) as outside:
        ranked.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"priority": -6})
    assert outside.value.body["param"] == "priority"
    assert outside.value.body["message"] == "priority: must be between -5 and 5 for this API key, got -6"
    # A keys-file entry without a range, and an --api-key flag key: the request runs at the default
    # priority, and the key is named in the log once.
    for key, name in (("sk-batch", "batch"), ("sk-flag", "key-1")):
        for _ in range(2):
            sdk(gateway, key).completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"priority": -100}
            )
            assert not fake.record.requests[-1].HasField("priority")
        logged = [r.getMessage() for r in caplog.records if "set `priority`" in r.getMessage()]
        assert (
            logged.count(
                f"API key {name!r} set `priority`, which its keys-file entry does not allow "
                "(no `priority` range): ignored for this key from now on"
            )
            == 1
        )
