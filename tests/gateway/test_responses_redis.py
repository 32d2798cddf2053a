"""The Redis response store with a real redis-server (started here on a free port): two gateway apps
share it in front of one real engine (stories260K), so a response created on one replica is retrieved,
chained, listed, resumed, cancelled and deleted on the other; the store's cost per request is counted in
round trips; and with Redis stopped, unstored requests go on while stored ones get a clear 503."""

from __future__ import annotations

import os
import signal

import httpx
import openai
import pytest
import redis

from tests.support.gateway_thread import GatewayThread
from tests.support.polling import wait_for
from tests.support.redis_server import start_redis
from tests.support.stories import MODEL

pytestmark = pytest.mark.integration

STORY = "Tell me a story"


@pytest.fixture(scope="module")
def redis_server():
    with start_redis() as server:
        yield server


@pytest.fixture(scope="module")
def replicas(stories_engine, redis_server):
    """Two gateways on one Redis store: (a, b)."""
    url = f"redis://127.0.0.1:{redis_server.port}/0"
    with (
        GatewayThread([stories_engine.address], response_store=url) as a,
        GatewayThread([stories_engine.address], response_store=url) as b,
    ):
        yield a, b


def client(gateway: GatewayThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)


def create(sdk: openai.OpenAI, **kwargs):
    return sdk.responses.create(**{"model": MODEL, "temperature": 0, "max_output_tokens": 12, **kwargs})


def test_a_response_made_on_one_replica_serves_the_other(replicas):
    a, b = (client(gateway) for gateway in replicas)
    first = create(a, input=STORY)
    assert b.responses.retrieve(first.id).model_dump() == a.responses.retrieve(first.id).model_dump()
    assert [item.content[0].text for item in b.responses.input_items.list(first.id).data] == [STORY]
    second = create(b, previous_response_id=first.id, input="What next?")
    conversation = [
        {"role": "user", "content": STORY},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What next?"},
    ]
    counted = httpx.post(f"{replicas[0].url}/tokenize", json={"messages": conversation}).json()["count"]
    assert second.usage.input_tokens == counted
    assert a.responses.retrieve(second.id).previous_response_id == first.id
    b.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(first.id)


def test_background_on_one_replica_resumes_on_the_other(replicas):
    a, b = (client(gateway) for gateway in replicas)
    queued = create(a, input=STORY, background=True)
    resumed = list(b.responses.retrieve(queued.id, stream=True, starting_after=2))
    everything = list(a.responses.retrieve(queued.id, stream=True))
    assert [e.sequence_number for e in everything] == list(range(len(everything)))
    assert [e.model_dump() for e in resumed] == [e.model_dump() for e in everything[3:]]
    final = b.responses.retrieve(queued.id)
    assert (
        final.status in ("completed", "incomplete")
        and final.output_text == everything[-1].response.output_text
    )


def test_cancel_on_the_other_replica_reaches_the_one_running_it(replicas, stories_engine):
    a, b = (client(gateway) for gateway in replicas)
    os.kill(stories_engine.process.pid, signal.SIGSTOP)  # the run on `a` waits for the engine
    try:
        queued = create(a, input=STORY, background=True)
        cancelled = b.responses.cancel(queued.id)
    finally:
        os.kill(stories_engine.process.pid, signal.SIGCONT)
    assert cancelled.status == "cancelled"
    assert a.responses.retrieve(queued.id).status == "cancelled"


def test_round_trips_per_request(replicas, redis_server):
    a_gateway, _ = replicas
    store = a_gateway.app.state.responses.store
    a = client(a_gateway)

    def trips(**kwargs) -> tuple[int, object]:
        before = store.round_trips
        response = create(a, **kwargs)
        if kwargs.get("stream"):
            response = list(response)[-1].response  # read to its end (the final record is written first)
        return store.round_trips - before, response

    stored_trips, stored = trips(input=STORY)
    assert stored_trips == 2  # the in_progress record, then the final one
    assert trips(input=STORY, store=False)[0] == 0
    assert trips(input=STORY, stream=True)[0] == 2
    assert trips(input="More", previous_response_id=stored.id)[0] == 3  # + reading the earlier turn
    keys = redis.Redis(port=redis_server.port)
    # One key per foreground response, with the TTL; events are kept only for background ones.
    assert keys.exists(f"conduit:responses:resp:{stored.id}") == 1
    assert 3590 <= keys.ttl(f"conduit:responses:resp:{stored.id}") <= 3600
    assert keys.exists(f"conduit:responses:events:{stored.id}") == 0
    keys.close()


def test_a_background_response_whose_replica_died_ends_failed_for_its_followers(
    replicas, stories_engine, redis_server
):
    a_gateway, b_gateway = replicas
    a, b = client(a_gateway), client(b_gateway)
    store = a_gateway.app.state.responses.store
    os.kill(stories_engine.process.pid, signal.SIGSTOP)  # the run on `a` waits for the engine
    try:
        queued = create(a, input=STORY, background=True)
        # `a` stops beating as a dead replica would (its run, held by the engine, is still there).
        for task in store._tasks:
            task.get_loop().call_soon_threadsafe(task.cancel)
        wait_for(lambda: all(task.done() for task in store._tasks), "a's heartbeat to stop")
        keys = redis.Redis(port=redis_server.port)
        assert keys.delete(f"conduit:responses:replica:{store.replica}") == 1  # as if its TTL ran out
        keys.close()
        events = list(b.responses.retrieve(queued.id, stream=True))
        assert [event.type for event in events] == ["response.queued"]  # then the stream ends
        failed = b.responses.retrieve(queued.id)
        assert failed.status == "failed" and failed.error.code == "replica_gone"
    finally:
        os.kill(stories_engine.process.pid, signal.SIGCONT)
    # The run was alive after all: it finishes and its final record replaces the verdict.
    wait_for(lambda: a.responses.retrieve(queued.id).status in ("completed", "incomplete"), "the run to end")


def test_with_redis_stopped_unstored_requests_go_on_and_stored_ones_get_503(stories_engine):
    server = start_redis()
    try:
        gateway = GatewayThread(
            [stories_engine.address], response_store=f"redis://127.0.0.1:{server.port}/0"
        ).start()
        sdk = client(gateway)
        kept = create(sdk, input=STORY)
        os.kill(stories_engine.process.pid, signal.SIGSTOP)  # a background run waits for the engine
        try:
            following = iter(create(sdk, input=STORY, background=True, stream=True))
            assert next(following).type == "response.queued"
            server.stop()  # Redis goes away mid-run
        finally:
            os.kill(stories_engine.process.pid, signal.SIGCONT)
        (error,) = list(following)  # the follower's read fails: one error event ends its stream
        assert (error.type, error.code, error.sequence_number) == ("error", "response_store_unavailable", 1)
        # The run cannot store its events: it is abandoned and gives back its slot and engine stream.
        wait_for(
            lambda: "conduit_gateway_generations_in_flight 0.0" in httpx.get(f"{gateway.url}/metrics").text,
            "the abandoned run to give back its slot",
        )
        assert create(sdk, input=STORY, store=False).status in ("completed", "incomplete")
        for call in (
            lambda: create(sdk, input=STORY),
            lambda: create(sdk, input=STORY, stream=True),
            lambda: create(sdk, input=STORY, background=True),
            lambda: sdk.responses.retrieve(kept.id),
            lambda: create(sdk, input="More", previous_response_id=kept.id, store=False),
        ):
            with pytest.raises(openai.APIStatusError) as caught:
                call()
            assert caught.value.status_code == 503
            assert caught.value.body["code"] == "response_store_unavailable"
        gateway.stop()
    finally:
        server.stop()


def test_a_password_protected_redis_needs_the_password_file(stories_engine, tmp_path):
    (tmp_path / "password").write_text("s3cret\n")
    with start_redis(password="s3cret") as server:
        url = f"redis://127.0.0.1:{server.port}/0"
        with (
            GatewayThread(
                [stories_engine.address],
                response_store=url,
                response_store_password_file=str(tmp_path / "password"),
            ) as allowed,
            GatewayThread([stories_engine.address], response_store=url) as refused,
        ):
            made = create(client(allowed), input=STORY)
            assert client(allowed).responses.retrieve(made.id).id == made.id
            with pytest.raises(openai.APIStatusError) as caught:
                client(refused).responses.retrieve(made.id)
            assert caught.value.status_code == 503
            assert caught.value.body["code"] == "response_store_unavailable"
