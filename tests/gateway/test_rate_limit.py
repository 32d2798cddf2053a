"""Per-key token buckets and OpenAI's rate-limit headers, driven by a hand-set clock: every header and
every 429 is exact for scripted request and token sequences. Also the keys file format."""

from __future__ import annotations

import hashlib
import json

import pytest

from conduit_gateway.keys.keys_file import ApiKey, KeyLimits, KeysFileError, key_digest, load_keys_file
from conduit_gateway.keys.rate_limit import RateLimited, RateLimiter, go_duration
from conduit_gateway.keys.store import ApiKeyStore
from tests.support.clock import ManualClock

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.0004, "1ms"),
        (0.017, "17ms"),
        (0.999, "999ms"),
        (1, "1s"),
        (8.64, "8.64s"),
        (20.000000000000004, "20s"),
        (59.5, "59.5s"),
        (60, "1m0s"),
        (105, "1m45s"),
        (360, "6m0s"),
        (3600, "1h0m0s"),
        (3723.25, "1h2m3.25s"),
    ],
)
def test_durations_read_as_openai_sends_them(seconds, text):
    assert go_duration(seconds) == text


def key(name: str, rpm: int | None = None, tpm: int | None = None) -> ApiKey:
    return ApiKey(name, key_digest(f"sk-{name}"), KeyLimits(rpm, tpm))


def test_a_scripted_sequence_of_requests_and_tokens_gets_exact_headers_and_429s():
    clock = ManualClock(0.0)
    limiter = RateLimiter(clock)
    team = key("team-a", rpm=3, tpm=100)
    seen = []
    for tokens in (15, 15, 15):
        admission = limiter.admit(team)
        admission.charge_total(5)  # the prompt, when the engine admits it
        admission.charge_total(tokens)  # prompt + output so far
        seen.append(admission.headers())
    assert seen == [
        {
            "x-ratelimit-limit-requests": "3",
            "x-ratelimit-remaining-requests": str(remaining),
            "x-ratelimit-reset-requests": reset_requests,
            "x-ratelimit-limit-tokens": "100",
            "x-ratelimit-remaining-tokens": str(tokens_left),
            "x-ratelimit-reset-tokens": reset_tokens,
        }
        for remaining, reset_requests, tokens_left, reset_tokens in (
            (2, "20s", 85, "9s"),
            (1, "40s", 70, "18s"),
            (0, "1m0s", 55, "27s"),
        )
    ]
    with pytest.raises(RateLimited) as refused:
        limiter.admit(team)
    error = refused.value
    assert (error.status, error.type, error.code) == (429, "requests", "rate_limit_exceeded")
    assert error.message == (
        "Rate limit reached for API key 'team-a' on requests per min (RPM): Limit 3, Used 3, Requested 1. "
        "Please try again in 20s."
    )
    assert error.headers == {
        "Retry-After": "20",
        "x-ratelimit-limit-requests": "3",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "1m0s",
        "x-ratelimit-limit-tokens": "100",
        "x-ratelimit-remaining-tokens": "55",
        "x-ratelimit-reset-tokens": "27s",
    }
    clock.now = 19.999
    with pytest.raises(RateLimited) as still:
        limiter.admit(team)
    assert still.value.headers["Retry-After"] == "1"
    assert still.value.message.endswith("Please try again in 1ms.")
    clock.now = 20.0
    headers = limiter.admit(team).headers()
    # 20 s refilled one request and 20 * 100/60 tokens: 55 + 33.33 = 88.33, 88 whole ones.
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-remaining-tokens"] == "88"
    assert headers["x-ratelimit-reset-tokens"] == "7s"


def test_output_tokens_can_overdraw_and_the_next_request_waits_for_the_refill():
    clock = ManualClock(0.0)
    limiter = RateLimiter(clock)
    team = key("team-b", tpm=20)
    admission = limiter.admit(team)
    admission.charge_total(5)
    assert admission.headers() == {
        "x-ratelimit-limit-tokens": "20",
        "x-ratelimit-remaining-tokens": "15",
        "x-ratelimit-reset-tokens": "15s",
    }
    for total in range(6, 36):  # thirty output tokens stream in
        admission.charge_total(total)
    with pytest.raises(RateLimited) as refused:
        limiter.admit(team)
    assert refused.value.type == "tokens"
    assert refused.value.message == (
        "Rate limit reached for API key 'team-b' on tokens per min (TPM): Limit 20, Used 20. "
        "Please try again in 48s."
    )
    assert refused.value.headers == {
        "Retry-After": "48",
        "x-ratelimit-limit-tokens": "20",
        "x-ratelimit-remaining-tokens": "0",
        "x-ratelimit-reset-tokens": "1m45s",
    }
    clock.now = 48.0
    assert limiter.admit(team).headers()["x-ratelimit-remaining-tokens"] == "1"


def test_a_refusal_takes_nothing_and_keys_do_not_share_buckets():
    clock = ManualClock(0.0)
    limiter = RateLimiter(clock)
    spent, other = key("spent", rpm=1, tpm=10), key("other", rpm=1)
    admission = limiter.admit(spent)
    admission.charge_total(50)
    for _ in range(3):
        with pytest.raises(RateLimited):
            limiter.admit(spent)
    assert limiter.admit(other).headers()["x-ratelimit-remaining-requests"] == "0"
    assert limiter.admit(key("free")).headers() == {}  # no limits: no headers, never refused


def test_a_reloaded_limit_keeps_what_was_used():
    clock = ManualClock(0.0)
    limiter = RateLimiter(clock)
    limiter.admit(key("team", rpm=10))
    limiter.admit(key("team", rpm=10))
    headers = limiter.admit(key("team", rpm=4)).headers()  # the file now says 4 per minute
    assert headers["x-ratelimit-remaining-requests"] == "1"
    limiter.forget_others(set())
    assert limiter.admit(key("team", rpm=4)).headers()["x-ratelimit-remaining-requests"] == "3"


def write(tmp_path, document, name="keys.yaml") -> str:
    path = tmp_path / name
    path.write_text(document if isinstance(document, str) else json.dumps(document))
    return str(path)


def test_keys_file_in_yaml_and_json(tmp_path):
    hashed = hashlib.sha256(b"sk-hashed").hexdigest()
    yaml_path = write(
        tmp_path,
        f"""
keys:
  - name: team-a
    key: sk-team-a
    limits: {{requests_per_minute: 60, tokens_per_minute: 40000}}
  - name: hashed
    key_sha256: {hashed}
""",
    )
    json_path = write(tmp_path, [{"name": "team-a", "key": "sk-team-a", "limits": {}}], "keys.json")
    assert load_keys_file(yaml_path) == [
        ApiKey("team-a", key_digest("sk-team-a"), KeyLimits(60, 40000)),
        ApiKey("hashed", key_digest("sk-hashed"), KeyLimits()),
    ]
    assert load_keys_file(json_path) == [ApiKey("team-a", key_digest("sk-team-a"), KeyLimits())]
    store = ApiKeyStore(("sk-flag",), yaml_path)
    assert store.lookup("sk-hashed").name == "hashed"
    assert store.lookup("sk-flag").name == "key-1"
    assert store.lookup("sk-team-") is None
    assert "sk-team-a" not in repr(store.keys)


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ("keys: [", "is not valid YAML or JSON at line 1"),
        ({"keys": {"name": "x"}}, "must hold a list of keys"),
        ([{"name": "a"}], "keys[0]: give exactly one of key and key_sha256"),
        ([{"name": "a", "key": "k", "key_sha256": "00" * 32}], "keys[0]: give exactly one of key"),
        ([{"key": "k"}], "keys[0].name: must be a non-empty string"),
        ([{"name": "a", "key": "two words"}], "keys[0].key: must be a non-empty string without spaces"),
        ([{"name": "a", "key_sha256": "xyz"}], "keys[0].key_sha256: must be 64 hexadecimal digits"),
        ([{"name": "a", "key": "k", "limits": {"requests_per_minute": 0}}], "keys[0].limits.requests_per_"),
        ([{"name": "a", "key": "k", "limits": {"rpm": 5}}], "keys[0].limits: unknown field 'rpm'"),
        ([{"name": "a", "key": "k", "owner": "x"}], "keys[0]: unknown field 'owner'"),
        ([{"name": "a", "key": "k"}, {"name": "a", "key": "j"}], "keys[1].name: 'a' is used twice"),
        ([{"name": "a", "key": "k"}, {"name": "b", "key": "k"}], "keys[1]: the same key as 'a'"),
    ],
)
def test_a_wrong_keys_file_names_the_entry_and_never_the_key(tmp_path, document, message):
    path = write(tmp_path, document)
    with pytest.raises(KeysFileError) as failed:
        load_keys_file(path)
    assert str(failed.value).startswith(f"--api-keys-file: {path}")
    assert message in str(failed.value)
    assert "'k'" not in str(failed.value) and "two words" not in str(failed.value)


def test_a_reload_that_fails_keeps_the_keys_in_force(tmp_path):
    path = write(tmp_path, [{"name": "a", "key": "sk-a"}])
    store = ApiKeyStore(keys_file=path)
    write(tmp_path, "keys: [")
    assert store.reload() is False
    assert store.lookup("sk-a").name == "a"
    write(tmp_path, [{"name": "b", "key": "sk-b"}])
    assert store.reload() is True
    assert store.lookup("sk-a") is None and store.lookup("sk-b").name == "b"
