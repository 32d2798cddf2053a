"""Per-key token buckets and OpenAI's rate-limit headers, driven by a hand-set clock: every header and
every 429 is exact for scripted request and token sequences. Also the keys file format."""

from __future__ import annotations

import hashlib
import json

import pytest

from conduit_gateway.keys.keys_file import ApiKey, KeyLimits, KeysFileError, key_digest, load_keys_file
from conduit_gateway.keys.rate_limit import RateLimited, RateLimiter, go_duration
from conduit_gateway.keys.shared_limits import LimitTableFull, SharedLimitStates
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


@pytest.fixture(params=["local", "shared"])
def make_limiter(request, tmp_path):
    """A RateLimiter on this process's states, or on a --workers table (the same rules must hold)."""
    opened = []

    def make(clock):
        if request.param == "local":
            return RateLimiter(clock)
        path = str(tmp_path / "key-limits")
        SharedLimitStates.create(path, workers=2, slots=64)
        opened.append(SharedLimitStates(path, worker=0))
        return RateLimiter(clock, opened[-1])

    yield make
    for states in opened:
        states.close()


def key(name: str, rpm: int | None = None, tpm: int | None = None) -> ApiKey:
    return ApiKey(name, key_digest(f"sk-{name}"), KeyLimits(rpm, tpm))


def admit(limiter: RateLimiter, api_key: ApiKey, worst: int = 0):
    """A request as the gateway admits it: one request when it arrives, then its worst case in tokens."""
    limiter.arrive(api_key)
    reservation = limiter.reserve(api_key, worst)
    limiter.leave(api_key)
    return reservation


def test_a_scripted_sequence_of_requests_and_tokens_gets_exact_headers_and_429s(make_limiter):
    clock = ManualClock(0.0)
    limiter = make_limiter(clock)
    team = key("team-a", rpm=3, tpm=100)
    seen = []
    for _ in range(3):
        reservation = admit(limiter, team, 10)  # max_tokens 10, the prompt not yet counted
        reservation.hold(15)  # the engine counted a 5-token prompt
        reservation.settle(8)  # 5 + 3 output tokens: 7 given back
        seen.append(reservation.headers())
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
            (2, "20s", 92, "4.8s"),
            (1, "40s", 84, "9.6s"),
            (0, "1m0s", 76, "14.4s"),
        )
    ]
    with pytest.raises(RateLimited) as refused:
        limiter.arrive(team)
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
        "x-ratelimit-remaining-tokens": "76",
        "x-ratelimit-reset-tokens": "14.4s",
    }
    clock.now = 19.999
    with pytest.raises(RateLimited) as still:
        limiter.arrive(team)
    assert still.value.headers["Retry-After"] == "1"
    assert still.value.message.endswith("Please try again in 1ms.")
    clock.now = 20.0
    headers = admit(limiter, team).headers()
    # 20 s refilled one request and 20 * 100/60 tokens: 76 + 33.33, capped at 100.
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-remaining-tokens"] == "100"


def test_a_worst_case_above_the_limit_is_too_large_and_one_above_what_is_left_waits(make_limiter):
    clock = ManualClock(0.0)
    limiter = make_limiter(clock)
    team = key("team-b", tpm=200)
    with pytest.raises(RateLimited) as too_large:
        limiter.reserve(team, 40_002)
    assert (too_large.value.status, too_large.value.type, too_large.value.code) == (
        429,
        "tokens",
        "rate_limit_exceeded",
    )
    assert too_large.value.message == (
        "Request too large for API key 'team-b' on tokens per min (TPM): Limit 200, Requested 40002: the "
        "prompt plus every choice's max_tokens (without max_tokens, the rest of the model's context). The "
        "input or output tokens must be reduced in order to run successfully."
    )
    assert "Retry-After" not in too_large.value.headers  # waiting does not help
    held = limiter.reserve(team, 150)
    with pytest.raises(RateLimited) as refused:
        limiter.reserve(team, 60)
    assert refused.value.message == (
        "Rate limit reached for API key 'team-b' on tokens per min (TPM): Limit 200, Used 150, "
        "Requested 60. Please try again in 3s."
    )
    assert refused.value.headers["Retry-After"] == "3"
    held.settle(20)  # it used 20: 130 come back
    assert limiter.reserve(team, 60).headers()["x-ratelimit-remaining-tokens"] == "120"
    held.settle(200)  # settled once: later calls change nothing
    assert limiter.headers(team)["x-ratelimit-remaining-tokens"] == "120"


def test_settling_above_the_reservation_overdraws_and_the_next_request_waits(make_limiter):
    clock = ManualClock(0.0)
    limiter = make_limiter(clock)
    team = key("team-c", tpm=20)
    reservation = admit(limiter, team, 10)
    reservation.hold(30)  # a prompt of 20 tokens, counted by the engine
    reservation.settle(30)
    with pytest.raises(RateLimited) as refused:
        limiter.reserve(team, 1)
    assert refused.value.headers["x-ratelimit-remaining-tokens"] == "0"
    assert refused.value.headers["Retry-After"] == "33"  # -10 back to 1: 11 tokens at 1 per 3 s
    clock.now = 33.0
    assert limiter.reserve(team, 1).headers()["x-ratelimit-remaining-tokens"] == "0"


def test_a_refusal_takes_nothing_and_keys_do_not_share_buckets(make_limiter):
    clock = ManualClock(0.0)
    limiter = make_limiter(clock)
    spent, other = key("spent", rpm=1, tpm=10), key("other", rpm=1)
    admit(limiter, spent, 10)
    for _ in range(3):
        with pytest.raises(RateLimited):
            limiter.arrive(spent)
    assert admit(limiter, other, 10).headers()["x-ratelimit-remaining-requests"] == "0"
    assert admit(limiter, key("free"), 10**9).headers() == {}  # no limits: no headers, never refused


def test_concurrent_requests_of_a_key_are_bounded_and_a_slot_comes_back_when_one_leaves(make_limiter):
    limiter = make_limiter(ManualClock(0.0))
    team = ApiKey("team", key_digest("sk-team"), KeyLimits(max_concurrent_requests=2))
    limiter.arrive(team)
    limiter.arrive(team)
    with pytest.raises(RateLimited) as refused:
        limiter.arrive(team)
    assert (refused.value.status, refused.value.type, refused.value.code) == (
        429,
        "requests",
        "rate_limit_exceeded",
    )
    assert refused.value.message == (
        "Too many concurrent requests for API key 'team': Limit 2, In progress 2. Wait for one to finish."
    )
    limiter.leave(team)
    limiter.arrive(team)
    assert limiter.in_progress(team) == 2


def test_a_reloaded_limit_keeps_what_was_used(make_limiter):
    clock = ManualClock(0.0)
    limiter = make_limiter(clock)
    admit(limiter, key("team", rpm=10))
    admit(limiter, key("team", rpm=10))
    headers = admit(limiter, key("team", rpm=4)).headers()  # the file now says 4 per minute
    assert headers["x-ratelimit-remaining-requests"] == "1"
    limiter.forget_others(set())
    assert admit(limiter, key("team", rpm=4)).headers()["x-ratelimit-remaining-requests"] == "3"


@pytest.fixture
def two_workers(tmp_path):
    """The limiters of two --workers processes on one table, with one clock."""
    path = str(tmp_path / "key-limits")
    SharedLimitStates.create(path, workers=2, slots=64)
    clock = ManualClock(0.0)
    states = [SharedLimitStates(path, worker) for worker in (0, 1)]
    yield clock, [RateLimiter(clock, state) for state in states], states
    for state in states:
        state.close()


def test_two_workers_share_a_keys_requests_and_tokens(two_workers):
    clock, (first, second), _ = two_workers
    team = key("team", rpm=3, tpm=100)
    admit(first, team, 40)
    admit(second, team, 40)
    admit(first, team)
    with pytest.raises(RateLimited) as refused:
        second.arrive(team)  # 3 per minute for the pod, not per worker
    assert refused.value.message.startswith("Rate limit reached for API key 'team' on requests per min")
    assert "Limit 3, Used 3" in refused.value.message
    with pytest.raises(RateLimited) as no_tokens:
        first.reserve(team, 21)  # 80 of 100 reserved by the two workers
    assert "Used 80, Requested 21" in no_tokens.value.message
    clock.now = 20.0  # one request and 33 tokens refilled, seen by both
    assert second.headers(team)["x-ratelimit-remaining-requests"] == "1"
    assert first.headers(team)["x-ratelimit-remaining-tokens"] == "53"


def test_two_workers_share_a_keys_concurrent_requests_and_a_restarted_worker_frees_its_own(two_workers):
    _, (first, second), states = two_workers
    team = ApiKey("team", key_digest("sk-team"), KeyLimits(max_concurrent_requests=2))
    first.arrive(team)
    second.arrive(team)
    with pytest.raises(RateLimited, match="In progress 2"):
        first.arrive(team)
    assert second.in_progress(team) == 2
    states[1].clear_worker()  # worker 1 died holding its request; its replacement starts
    assert first.in_progress(team) == 1
    second.arrive(team)
    first.leave(team)
    assert second.in_progress(team) == 1


def test_forgetting_a_removed_key_refills_it_for_every_worker(two_workers):
    _, (first, second), _ = two_workers
    team = key("team", rpm=2)
    admit(first, team)
    admit(second, team)
    first.forget_others({"someone-else"})
    assert second.headers(team)["x-ratelimit-remaining-requests"] == "2"


def test_a_full_table_says_so(tmp_path):
    path = str(tmp_path / "key-limits")
    SharedLimitStates.create(path, workers=1, slots=2)
    states = SharedLimitStates(path, 0)
    limiter = RateLimiter(ManualClock(0.0), states)
    admit(limiter, key("a", rpm=1))
    admit(limiter, key("b", rpm=1))
    with pytest.raises(LimitTableFull, match="holds 2 keys"):
        admit(limiter, key("c", rpm=1))
    states.close()


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
        ([{"name": "a", "key": "k", "limits": {"max_concurrent_requests": 0}}], "limits.max_concurrent_"),
        ([{"name": "a", "key": "k", "priority": 5}], "keys[0].priority: must be a range [low, high]"),
        ([{"name": "a", "key": "k", "priority": [0, 2**31]}], "keys[0].priority: must be a range"),
        ([{"name": "a", "key": "k", "priority": [3, -3]}], "keys[0].priority: the low end 3 is above"),
    ],
)
def test_a_wrong_keys_file_names_the_entry_and_never_the_key(tmp_path, document, message):
    path = write(tmp_path, document)
    with pytest.raises(KeysFileError) as failed:
        load_keys_file(path)
    assert str(failed.value).startswith(f"--api-keys-file: {path}")
    assert message in str(failed.value)
    assert "'k'" not in str(failed.value) and "two words" not in str(failed.value)


def test_keys_file_limits_concurrency_and_a_priority_range(tmp_path):
    path = write(
        tmp_path,
        """
- name: batch
  key: sk-batch
  limits: {max_concurrent_requests: 2}
  priority: [-10, 10]
- name: plain
  key: sk-plain
""",
    )
    assert load_keys_file(path) == [
        ApiKey("batch", key_digest("sk-batch"), KeyLimits(max_concurrent_requests=2), priority=(-10, 10)),
        ApiKey("plain", key_digest("sk-plain"), KeyLimits()),
    ]


def test_a_non_ascii_key_is_refused_at_load_with_its_line_and_never_shown(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(
        "keys:\n  - name: ok\n    key: sk-ok\n  - name: accented\n    key: sk-caf\u00e9-key\n",
        encoding="utf-8",
    )
    with pytest.raises(KeysFileError) as failed:
        load_keys_file(str(path))
    assert str(failed.value) == (
        f"--api-keys-file: {path}: keys[1].key at line 5: must be ASCII (HTTP headers cannot carry other "
        "characters, so this key could never match)"
    )


def test_a_reload_that_fails_keeps_the_keys_in_force(tmp_path):
    path = write(tmp_path, [{"name": "a", "key": "sk-a"}])
    store = ApiKeyStore(keys_file=path)
    write(tmp_path, "keys: [")
    assert store.reload() is False
    assert store.lookup("sk-a").name == "a"
    write(tmp_path, [{"name": "b", "key": "sk-b"}])
    assert store.reload() is True
    assert store.lookup("sk-a") is None and store.lookup("sk-b").name == "b"
