"""An engine SIGKILLed under load: requests that had not started streaming are retried on other engines,
streams running on the dead engine move to another one and finish (migration), and the engine is
ejected, then re-admitted after it restarts on the same port. The gateway is the real `conduit-gateway`
process. With migration off (`--migration-limit 0`) those streams end with an error event."""

from __future__ import annotations

import re
import threading

import httpx
import openai
import pytest

from tests.routing.helpers import ADMIN_KEY, MODEL, complete, deltas, nodes, routed, sdk
from tests.support.polling import wait_for
from tests.support.processes import start_gateway

pytestmark = pytest.mark.integration

STREAMS = 12  # four per engine: two running, two waiting (the engines batch two sequences)
TOKENS = 480  # near the 512-token context: the victim is still busy when killed, even under load
# The gateway's line for a moved stream: its own request id, and the X-Request-Id the client sent.
MOVED = re.compile(r"request (\S+): prompt 0 choices \[0\] moved from \S+ to \S+ .* client_request_id=(\S+)$")


class StreamOutcome:
    def __init__(self) -> None:
        self.started = False
        self.completion_tokens: int | None = None
        self.finish_reason: str | None = None
        self.error: openai.APIError | None = None


def _stream(client: openai.OpenAI, index: int, outcome: StreamOutcome, started: threading.Semaphore) -> None:
    try:
        stream = client.completions.create(
            model=MODEL,
            prompt=f"Once upon a time, number {index}",
            max_tokens=TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            extra_headers={"X-Request-Id": f"failover-{index}"},
        )
        for chunk in stream:
            if not outcome.started:
                outcome.started = True
                started.release()
            if chunk.choices and chunk.choices[0].finish_reason:
                outcome.finish_reason = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                outcome.completion_tokens = chunk.usage.completion_tokens
    except openai.APIError as exc:
        outcome.error = exc


@pytest.fixture(params=[3, 0], ids=["migration", "no_migration"])
def gateway(fleet, request):
    args = ("--routing", "round_robin", "--admin-key", ADMIN_KEY, "--health-interval", "0.5")
    with start_gateway(fleet.addresses, *args, "--migration-limit", str(request.param)) as process:
        process.migration_limit = request.param
        yield process


@pytest.fixture
def victim(fleet):
    """The engine this test kills; restarted afterwards even if the test fails half way."""
    yield 1
    if fleet.engines[1].process.poll() is not None:
        fleet.restart(1)


def test_sigkill_under_load_loses_no_request(fleet, gateway, victim):
    address = fleet.addresses[victim]
    with sdk(gateway.url) as client:
        for _ in range(3):
            outcomes = [StreamOutcome() for _ in range(STREAMS)]
            started = threading.Semaphore(0)
            threads = [
                threading.Thread(target=_stream, args=(client, i, outcomes[i], started), daemon=True)
                for i in range(STREAMS)
            ]
            if _victim_with_two_running_and_two_waiting(fleet, gateway.url, victim, threads, started):
                break
            # The test thread came back so late that the victim's running streams had finished: the
            # scenario never started. Let every stream finish, then set it up again.
            for thread in threads:
                thread.join(timeout=240)
        else:
            raise AssertionError("three tries to stop the victim with four streams in flight all came late")
        fleet.kill(victim)
        for thread in threads:
            thread.join(timeout=240)
            assert not thread.is_alive()

    failed = [outcome for outcome in outcomes if outcome.error is not None]
    completed = [outcome for outcome in outcomes if outcome.error is None]
    metrics = _metrics(gateway.url)
    if gateway.migration_limit:
        # The two streams running on the victim moved to the other engines and finished there.
        assert failed == []
        assert 'conduit_gateway_migrations_total{reason="unavailable"} 2.0' in metrics
        # Its log names each moved stream by the gateway's own id and by the client's.
        moved = [MOVED.search(line) for line in gateway.output_tail(10_000_000).splitlines()]
        pairs = {match.groups() for match in moved if match}
        assert len(pairs) == 2 and all(len(ours) == 32 and ours != theirs for ours, theirs in pairs)
        assert {theirs for _, theirs in pairs} <= {f"failover-{i}" for i in range(STREAMS)}
    else:
        # Without migration they are lost after their first tokens, with an error event.
        assert len(failed) == 2
        for outcome in failed:
            assert outcome.started
            assert outcome.error.body == {
                "message": outcome.error.message,
                "type": "server_error",
                "param": None,
                "code": "engine_unavailable",
            }
        assert "conduit_gateway_migrations_total{" not in metrics
    # Its two waiting requests had sent nothing yet: they were retried on the other engines and finished.
    assert len(completed) == STREAMS - len(failed)
    assert all((o.completion_tokens, o.finish_reason) == (TOKENS, "length") for o in completed)

    view = nodes(gateway.url)[address]
    assert (view["state"], view["serving"], view["ejections"]) == ("unavailable", False, 1)
    # The two running streams' failures always count; the two waiting requests' refusals are usually
    # counted too, but on a loaded machine one or both sometimes are not (why is not understood yet), so
    # only the running two are asserted. Nothing stays in flight either way.
    assert view["failures"] >= 2 and view["in_flight"] == 0
    assert 'conduit_gateway_retries_total{code="UNAVAILABLE"} 2.0' in metrics
    assert f'conduit_gateway_node_ejections_total{{node="{address}"}} 1.0' in metrics
    assert f'conduit_gateway_engine_up{{engine="{address}"}} 0.0' in metrics
    with sdk(gateway.url) as client:
        before = routed(gateway.url, fleet.addresses)
        for i in range(4):
            complete(client, f"While it is down {i}")
        assert deltas(routed(gateway.url, fleet.addresses), before)[victim] == 0

    fleet.restart(victim)
    wait_for(lambda: nodes(gateway.url)[address]["state"] == "serving", "re-admission", attempts=1200)
    assert nodes(gateway.url)[address]["ejections"] == 1
    with sdk(gateway.url) as client:
        before = routed(gateway.url, fleet.addresses)
        for i in range(6):
            complete(client, f"After the restart {i}")
    assert deltas(routed(gateway.url, fleet.addresses), before) == [2, 2, 2]
    # The restarted engine served them itself (its count starts at 1: the warm-up generation).
    wait_for(lambda: fleet.load(victim).finished_requests >= 3, "the restarted engine's count")
    assert fleet.load(victim).finished_requests == 1 + 2


def _victim_with_two_running_and_two_waiting(fleet, url: str, victim: int, threads, started) -> bool:
    """Start the streams with every engine paused (SIGSTOP) until round robin has put four on each, then
    run the victim alone until its first two streams have sent a token, and freeze it there: two running
    (their first pair of 480 tokens, a fraction of a second on the CPU kernels, far from done), two waiting
    for a batch slot. The other engines then run on. False when the test thread paused the victim so
    late that its first streams had finished (a loaded machine): the caller tries again."""
    for index in range(len(fleet.addresses)):
        fleet.pause(index)
    try:
        for thread in threads:
            thread.start()
        wait_for(lambda: all(n["in_flight"] == 4 for n in nodes(url).values()), "four streams per engine")
        fleet.resume(victim)
        for _ in range(2):
            assert started.acquire(timeout=120)
        fleet.pause(victim)
        if nodes(url)[fleet.addresses[victim]]["in_flight"] != 4:
            fleet.resume(victim)  # its first streams finished before the pause: no scenario
            return False
        return True
    except BaseException:
        fleet.resume(victim)
        raise
    finally:
        for index in range(len(fleet.addresses)):
            if index != victim:
                fleet.resume(index)


def _metrics(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=30).text
