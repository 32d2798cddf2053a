"""Every way a disaggregated request can fail, on real engine processes, each ending with no KV block, no
pending transfer and no request left on any engine (GetLoad).

- A prefill engine refuses (queue full) or is down (UNAVAILABLE): the request runs on another one. The
  refusing engine is a fake standing in the prefill pool with a real engine's role and KV layout.
- A decode engine has no room for the pull (RESOURCE_EXHAUSTED): the request goes to another decode engine
  with the same handle; when none is left the gateway releases the transfer and answers 429 (an error
  event once the first token was streamed). The decode engines are filled with transfers of their own.
- The client goes away between prefill and decode: the gateway releases the transfer (the lease is 30 s;
  it is freed at once).
- A decode engine dies mid-stream: another decode engine continues the stream (migration) and the client
  gets exactly the colocated text; with no decode engine left but a colocated one, that one continues it;
  with neither, the client gets an error event.
- The source dies before the pull, or the handle expires: the decode engine recomputes the prompt and the
  client's stream goes on with the tokens colocated serving gives.

The windows between prefill and decode are made by stopping the decode engine (SIGSTOP): the first token
reaches the client while it is stopped, so it comes from the prefill engine at once.
"""

from __future__ import annotations

import json

import grpc
import httpx
import pytest

from conduit.engine.v1 import engine_pb2, engine_pb2_grpc
from tests.disaggregation.conftest import Gateways
from tests.disaggregation.helpers import ADMIN_KEY, load, model_info, sdk, wait_idle
from tests.gateway.sse import parse_events
from tests.support.clock import ManualClock
from tests.support.engine_fleet import EngineFleet
from tests.support.fake_engine import FakeEngine, Script
from tests.support.polling import wait_for
from tests.support.processes import require_shared
from tests.support.stories import MODEL

pytestmark = pytest.mark.integration

# Two prefill engines (the second's leases last one second), two `both` engines as the decode pool with
# small caches (24 blocks of 16 tokens) that transfers of their own can fill, and a decode engine with a
# full-size cache, killed mid-stream.
P, P_SHORT, D1, D2, D_VICTIM = range(5)
FLAGS = [
    ("--role", "prefill"),
    ("--role", "prefill", "--kv-transfer-lease-seconds", "1"),
    ("--role", "both", "--kv-cache-blocks", "24"),
    ("--role", "both", "--kv-cache-blocks", "24"),
    ("--role", "decode"),
]
PROMPT = [1, *range(60, 119)]  # 60 tokens: 4 blocks


@pytest.fixture(scope="module")
def fleet():
    model = require_shared(f"models/{MODEL}")
    with EngineFleet(model, len(FLAGS), ("--max-num-seqs", "8"), per_engine=FLAGS) as engines:
        yield engines


@pytest.fixture
def gateways(fleet):
    started = Gateways(fleet)
    yield started
    started.stop_all()


@pytest.fixture
def healthy(fleet):
    """Resume or restart whatever a test stopped or killed, then check that every engine holds nothing."""
    yield
    for index, engine in enumerate(fleet.engines):
        if engine.process.poll() is not None:
            fleet.restart(index)
        else:
            fleet.resume(index)
    wait_idle(fleet)


def stub(fleet, index: int) -> engine_pb2_grpc.EngineStub:
    return fleet.stub(index)


def colocated_text(fleet, max_tokens: int) -> str:
    """The greedy text of PROMPT from one engine alone (a `both` decode engine serves whole requests)."""
    request = engine_pb2.GenerateRequest(
        token_ids=engine_pb2.TokenIds(ids=PROMPT),
        sampling=engine_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
    )
    return "".join(message.text for message in stub(fleet, D2).Generate(request, timeout=60))


def fill(fleet, index: int, blocks: int) -> list[str]:
    """Pin `blocks` of engine `index`'s cache under transfers of its own (7 blocks each), leaving the rest."""
    transfer_ids = []
    for n in range(blocks // 7):
        ids = [1, 400 + 10 * index + n, *range(100, 210)]  # 112 tokens (7 blocks), its own from the start
        request = engine_pb2.GenerateRequest(
            token_ids=engine_pb2.TokenIds(ids=ids),
            sampling=engine_pb2.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
            kv_transfer=engine_pb2.KvTransferParams(produce=engine_pb2.KvProduce()),
        )
        (message,) = stub(fleet, index).Generate(request, timeout=60)
        transfer_ids.append(message.kv_handle.transfer_id)
    assert load(fleet.addresses[index]).kv_blocks_pinned == blocks
    return transfer_ids


def release(fleet, index: int, transfer_ids: list[str]) -> None:
    for transfer_id in transfer_ids:
        reply = stub(fleet, index).ReleaseKv(engine_pb2.ReleaseKvRequest(transfer_id=transfer_id), timeout=10)
        assert reply.released


def _moved(fleet, index: int) -> int:
    """KV bytes the engine pulled, or did not need to pull (prefix-cache hits), since it started."""
    reply = load(fleet.addresses[index])
    return reply.kv_bytes_pulled + reply.kv_bytes_saved


def complete(url: str, max_tokens: int = 20, stream: bool = False):
    with sdk(url) as client:
        kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0, stream=stream)
        return client.completions.create(**kwargs, extra_body={"ignore_eos": True})


def retries(url: str, code: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(f'conduit_gateway_retries_total{{code="{code}"}}'):
            return float(line.split()[-1])
    return 0.0


class SseReader:
    """A streamed completion read event by event over raw HTTP (closing it is the client going away)."""

    def __init__(self, url: str, max_tokens: int, n: int = 1) -> None:
        body = {
            "model": MODEL,
            "prompt": PROMPT,
            "max_tokens": max_tokens,
            "n": n,
            "temperature": 0,
            "ignore_eos": True,
        }
        self._client = httpx.Client(base_url=url, timeout=60)
        self._response = self._client.send(
            self._client.build_request("POST", "/v1/completions", json={**body, "stream": True}), stream=True
        )
        assert self._response.status_code == 200
        self._lines = (line for line in self._response.iter_lines() if line)

    def next(self) -> dict | str:
        line = next(self._lines)
        return "[DONE]" if line == "data: [DONE]" else parse_events(line + "\n\n")[0]

    def rest(self) -> list[dict | str]:
        events = []
        while not events or events[-1] != "[DONE]":
            events.append(self.next())
        return events

    def close(self) -> None:
        self._response.close()
        self._client.close()


def text_of(events: list) -> str:
    return "".join(
        event["choices"][0]["text"] for event in events if isinstance(event, dict) and "choices" in event
    )


@pytest.mark.parametrize("code", [grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE])
def test_a_refusing_prefill_engine_is_retried_on_another(fleet, gateways, healthy, code):
    with FakeEngine(MODEL) as fake:
        fake.model_info = model_info(fleet.addresses[P])  # a prefill engine of the same KV layout
        fake.script = Script(error_before=code, error_message="refused by the fake")
        gateway = gateways(prefill=[fake.address, P], decode=[D1])  # round robin tries the fake first
        assert complete(gateway.url).choices[0].text == colocated_text(fleet, 20)
        assert len(fake.record.requests) == 1 and fake.record.requests[0].kv_transfer.HasField("produce")
        assert retries(gateway.url, code.name) == 1


def test_a_decode_engine_without_room_hands_the_same_transfer_to_another(fleet, gateways, healthy):
    expected = colocated_text(fleet, 20)
    fillers = fill(fleet, D1, 21)  # 3 blocks free: the prompt needs 4
    gateway = gateways(prefill=[P], decode=[D1, D2])  # round robin tries D1 first
    moved = [_moved(fleet, i) for i in (D1, D2)]
    assert complete(gateway.url).choices[0].text == expected
    assert retries(gateway.url, "RESOURCE_EXHAUSTED") == 1
    block_bytes = 2 * 5 * 16 * 4 * 8 * 4
    # D2 took the transfer D1 refused: its 4 blocks were pulled there (or already in D2's prefix cache).
    assert (_moved(fleet, D1), _moved(fleet, D2)) == (moved[0], moved[1] + 4 * block_bytes)
    assert load(fleet.addresses[P]).kv_transfers_pending == 0  # pulled by D2
    release(fleet, D1, fillers)


@pytest.mark.parametrize("stream", [False, True], ids=["response", "stream"])
def test_no_decode_engine_with_room_releases_the_transfer_and_answers_429(fleet, gateways, healthy, stream):
    first_text = colocated_text(fleet, 1)  # before the fill: D2 would queue it until the fillers' leases end
    fillers = {index: fill(fleet, index, 21) for index in (D1, D2)}
    gateway = gateways(prefill=[P], decode=[D1, D2])
    if stream:
        events = SseReader(gateway.url, 20)
        first = events.next()
        assert first["choices"][0]["text"] == first_text  # streamed before any decode engine took it
        error = events.rest()[-2]["error"]
        events.close()
    else:
        with pytest.raises(Exception) as caught:
            complete(gateway.url)
        assert caught.value.status_code == 429
        assert caught.value.response.headers["retry-after"] == "1"
        error = caught.value.body
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert "no room for the pulled prompt now (4 blocks, 3 free)" in error["message"]
    # Released by the gateway, long before its 30-second lease would have freed it.
    wait_for(lambda: load(fleet.addresses[P]).kv_transfers_pending == 0, "the gateway's ReleaseKv")
    for index, transfer_ids in fillers.items():
        release(fleet, index, transfer_ids)


def test_a_client_gone_between_prefill_and_decode_releases_the_transfer(fleet, gateways, healthy):
    gateway = gateways(prefill=[P], decode=[D1])
    fleet.pause(D1)
    events = SseReader(gateway.url, 20)
    assert events.next()["choices"][0]["text"] == colocated_text(fleet, 1)  # the decode engine is stopped
    assert load(fleet.addresses[P]).kv_transfers_pending == 1
    events.close()
    wait_for(lambda: load(fleet.addresses[P]).kv_transfers_pending == 0, "the gateway's ReleaseKv")
    assert load(fleet.addresses[P]).kv_blocks_used == 0


def test_a_client_gone_mid_decode_is_charged_what_the_engines_generated_not_its_worst_case(
    fleet, gateways, healthy, tmp_path
):
    path = tmp_path / "keys.json"
    path.write_text(
        json.dumps([{"name": "team", "key": "sk-team", "limits": {"tokens_per_minute": 100_000}}])
    )
    gateway = gateways(prefill=[P], decode=[D_VICTIM], clock=ManualClock(0.0), api_keys_file=str(path))
    key = gateway.ctx.api_keys.keys[0]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True}

    def charged() -> int:
        headers = gateway.ctx.rate_limiter.headers(key)
        return int(headers["x-ratelimit-limit-tokens"]) - int(headers["x-ratelimit-remaining-tokens"])

    # On a loaded machine the decode engine may generate all 400 tokens before this client has read its
    # third event (the gateway, a thread of this process, reads them meanwhile): then it is charged all
    # of them, rightly, and the leave is tried again.
    for _ in range(5):
        spent, received = charged(), 0
        with httpx.Client(base_url=gateway.url, timeout=60) as client:
            headers = {"Authorization": "Bearer sk-team"}
            with client.stream(
                "POST", "/v1/completions", json={**body, "stream": True}, headers=headers
            ) as got:
                for line in got.iter_lines():
                    if line.startswith("data: {"):
                        received += 1
                        if received == 3:  # the prefill's first token, then the decode engine's
                            break
        wait_for(lambda: not gateway.ctx.drains and gateway.ctx.limiter.active == 0, "the drain to settle")
        used = charged() - spent
        if used < len(PROMPT) + 400:
            break
    # Aborted on the decode engine and read to its end: the prompt and the tokens generated, not 60 + 400.
    assert len(PROMPT) + received <= used < len(PROMPT) + 400
    assert load(fleet.addresses[P]).kv_transfers_pending == 0


def test_a_decode_engine_dying_mid_stream_ends_the_stream_with_an_error_event(fleet, gateways, healthy):
    gateway = gateways(prefill=[P], decode=[D_VICTIM])
    # Four choices of 440 tokens keep the decode engine busy for about a second: it is still generating
    # when this client, however slow the machine, has read the first decode event.
    events = SseReader(gateway.url, 440, n=4)
    for _ in range(4 + 1):  # the prefill's four first tokens, then the decode engine's first event
        events.next()
    fleet.pause(D_VICTIM)
    fleet.kill(D_VICTIM)
    rest = events.rest()
    events.close()
    error = rest[-2]["error"]
    assert (error["type"], error["code"]) == ("server_error", "engine_unavailable")
    assert load(fleet.addresses[P]).kv_transfers_pending == 0  # it had been pulled


def _decode_serving(gateway_url: str, fleet, candidates: list[int]) -> int | None:
    """The one of `candidates` the gateway has the stream open on (None: not yet)."""
    view = httpx.get(
        f"{gateway_url}/admin/nodes", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30
    ).json()
    busy = {node["address"] for node in view["nodes"] if node["in_flight"]}
    serving = [i for i in candidates if fleet.addresses[i] in busy]
    return serving[0] if len(serving) == 1 else None


def _migrations(url: str) -> float:
    lines = httpx.get(f"{url}/metrics", timeout=30).text.splitlines()
    return sum(
        float(line.split()[-1]) for line in lines if line.startswith("conduit_gateway_migrations_total{")
    )


@pytest.mark.parametrize("replacement", ["decode", "colocated"])
def test_a_decode_engine_dying_mid_stream_is_replaced_and_the_stream_goes_on(
    fleet, gateways, healthy, replacement
):
    # D2 (a `both` engine) is a second decode engine, or the colocated pool the model falls back to.
    decode = [D_VICTIM, D2] if replacement == "decode" else [D_VICTIM]
    if replacement == "decode":
        gateway = gateways(prefill=[P], decode=decode)
    else:
        gateway = gateways(prefill=[P], decode=decode, engines=[D2])
    expected = colocated_text(fleet, 300)  # 360 tokens with the prompt: D2's 24 blocks hold them
    for _ in range(3):
        rest, migrations = _kill_the_decode_engine_mid_stream(fleet, gateway, decode)
        if migrations or not _finished(rest):
            break
        # The victim generated every token before SIGSTOP reached it (the test read its first event
        # late): nothing was cut, so nothing moved. Bring it back and try again.
        victim = next(i for i in decode if fleet.engines[i].process.poll() is not None)
        fleet.restart(victim)
        address = fleet.addresses[victim]
        wait_for(lambda a=address: _node_state(gateway.url, a) == "serving", "the victim back")
    assert not any(isinstance(event, dict) and "error" in event for event in rest)
    assert text_of(rest) == expected
    finishes = [e["choices"][0]["finish_reason"] for e in rest if isinstance(e, dict) and e.get("choices")]
    assert finishes[-1] == "length"
    assert migrations == 1


def _kill_the_decode_engine_mid_stream(fleet, gateway, decode: list[int]) -> tuple[list, float]:
    """Stream a completion whose decode engine is killed after its first event: every event, the
    migrations the gateway counted meanwhile."""
    before = _migrations(gateway.url)
    # The decode engines wait (SIGSTOP) until the test knows which one took the stream; that one then
    # runs until its first event and is killed mid-stream.
    for index in decode:
        fleet.pause(index)
    events = SseReader(gateway.url, 300)
    first = [events.next()]  # the prefill engine's first token
    wait_for(lambda: _decode_serving(gateway.url, fleet, decode) is not None, "the decode side opened")
    victim = _decode_serving(gateway.url, fleet, decode)
    fleet.resume(victim)
    first.append(events.next())  # the decode engine's first event
    fleet.pause(victim)
    fleet.kill(victim)
    for index in decode:
        if index != victim:
            fleet.resume(index)
    rest = events.rest()
    events.close()
    return first + rest, _migrations(gateway.url) - before


def _node_state(gateway_url: str, address: str) -> str | None:
    view = httpx.get(
        f"{gateway_url}/admin/nodes", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30
    ).json()
    return next((node["state"] for node in view["nodes"] if node["address"] == address), None)


def _finished(events: list) -> bool:
    """Whether the stream ended with its finish reason and no error."""
    return not any(isinstance(e, dict) and "error" in e for e in events) and any(
        isinstance(e, dict) and e.get("choices") and e["choices"][0].get("finish_reason") for e in events
    )


@pytest.mark.parametrize("gone", ["source killed", "lease expired"])
def test_a_transfer_gone_before_the_pull_is_recomputed_and_the_stream_goes_on(fleet, gateways, healthy, gone):
    source = P if gone == "source killed" else P_SHORT
    gateway = gateways(prefill=[source], decode=[D1])
    pulled = load(fleet.addresses[D1]).kv_bytes_pulled
    fleet.pause(D1)
    events = SseReader(gateway.url, 30)
    first = events.next()
    wait_for(lambda: load(fleet.addresses[source]).kv_transfers_pending == 1, "the produced transfer")
    if gone == "source killed":
        fleet.kill(source)
    else:
        wait_for(lambda: load(fleet.addresses[source]).kv_transfers_pending == 0, "the lease to end", 800)
    fleet.resume(D1)
    rest = events.rest()
    events.close()
    assert text_of([first, *rest]) == colocated_text(fleet, 30)
    assert rest[-2]["choices"][0]["finish_reason"] == "length"
    assert load(fleet.addresses[D1]).kv_bytes_pulled == pulled  # nothing came over: it recomputed
