"""Disaggregated serving over each KV transport besides gRPC, on real engine processes behind a real
gateway: a prefill and a decode engine both started with `--kv-transport shm`, and a pair with
`--kv-transport nixl` (gRPC, the default, is what test_pd_serving and test_pd_failures run).

Per transport: the stream gives exactly the colocated text, the decode engine's GetLoad counts the pull
under that transport (not a fallback to gRPC), and every engine ends holding no block, no transfer and no
request, with no pull's segment left in /dev/shm (only the one made ahead for the next pull, unlinked
when the engine stops; these in-process engines' shm pulls copy straight out of the source's shared
cache and make none); when the source dies or the handle's lease ends before the pull, the decode
engine recomputes and the stream goes on with the same text. The NIXL pair skips where
NIXL cannot start (the engine falls back to gRPC and says so in GetModelInfo.kv_transport), except in CI.
"""

from __future__ import annotations

import os

import pytest

from tests.disaggregation.helpers import load, model_info, wait_idle
from tests.disaggregation.test_pd_failures import PROMPT, SseReader, complete, text_of
from tests.support.engine_fleet import EngineFleet
from tests.support.kv_blocks import shm_segments
from tests.support.polling import wait_for
from tests.support.processes import require_shared
from tests.support.stories import MODEL

# Makes KV segments in /dev/shm: one such module at a time (tests/conftest.py).
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("kv_shm_exclusive")]

TRANSPORTS = ["shm", "nixl"]
LEASE = "3"  # seconds: room for a pull, short enough to wait out
FLAGS = [
    flags
    for kind in TRANSPORTS
    for flags in (
        ("--role", "prefill", "--kv-transport", kind, "--kv-transfer-lease-seconds", LEASE),
        ("--role", "both", "--kv-transport", kind),
    )
]


def engines_of(kind: str) -> tuple[int, int]:
    """Fleet indices of the transport's prefill and decode engines."""
    first = 2 * TRANSPORTS.index(kind)
    return first, first + 1


@pytest.fixture(scope="module")
def fleet():
    model = require_shared(f"models/{MODEL}")
    before = shm_segments()
    with EngineFleet(model, len(FLAGS), ("--max-num-seqs", "8"), per_engine=FLAGS) as engines:
        yield engines
    # A stopped decode engine unlinks the segment it made ahead for its next pull.
    assert shm_segments() - before == set(), "an engine left a shared-memory segment behind"


@pytest.fixture(params=TRANSPORTS)
def kind(request, fleet):
    prefill, decode = engines_of(request.param)
    started = {model_info(fleet.addresses[i]).kv_transport for i in (prefill, decode)}
    if started != {request.param}:
        why = f"the engines run {sorted(started)}: {request.param} could not start here (see their log)"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return request.param


@pytest.fixture
def healthy(fleet):
    before = shm_segments()
    yield
    for index, engine in enumerate(fleet.engines):
        if engine.process.poll() is not None:
            fleet.restart(index)
        else:
            fleet.resume(index)
    wait_idle(fleet)
    # Pull segments are gone; the shm decode engine keeps at most the one made ahead for its next pull.
    assert len(shm_segments() - before) <= 1, "a pull left its shared-memory segment behind"


def colocated_text(fleet, decode: int, max_tokens: int) -> str:
    from conduit.engine.v1 import engine_pb2

    request = engine_pb2.GenerateRequest(
        token_ids=engine_pb2.TokenIds(ids=PROMPT),
        sampling=engine_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
    )
    return "".join(message.text for message in fleet.stub(decode).Generate(request, timeout=60))


def pulls(fleet, index: int) -> dict[str, int]:
    return dict(load(fleet.addresses[index]).kv_pulls_by_transport)


def test_a_disaggregated_request_moves_its_kv_over_the_transport(fleet, make_gateway, healthy, kind):
    prefill, decode = engines_of(kind)
    gateway = make_gateway(prefill=[prefill], decode=[decode])
    before, pulled = pulls(fleet, decode), load(fleet.addresses[decode]).kv_bytes_pulled
    segments = shm_segments()
    reply = complete(gateway.url, max_tokens=20)
    assert reply.choices[0].text == colocated_text(fleet, decode, 20)
    assert reply.usage.completion_tokens == 20
    after = pulls(fleet, decode)
    assert after.get(kind, 0) == before.get(kind, 0) + 1 and after.get("grpc", 0) == before.get("grpc", 0)
    assert load(fleet.addresses[decode]).kv_bytes_pulled > pulled
    # Both caches live in their engine's process: shm copies straight out of the prefill engine's
    # shared cache, so no pull made a segment (not even the one made ahead after a segment pull).
    assert shm_segments() - segments == set()
    wait_idle(fleet, [prefill, decode])


@pytest.mark.parametrize("gone", ["source killed", "lease expired"])
def test_a_transfer_gone_before_the_pull_is_recomputed_and_the_stream_goes_on(
    fleet, make_gateway, healthy, kind, gone
):
    prefill, decode = engines_of(kind)
    gateway = make_gateway(prefill=[prefill], decode=[decode])
    expected = colocated_text(fleet, decode, 30)
    before, pulled = pulls(fleet, decode), load(fleet.addresses[decode]).kv_bytes_pulled
    fleet.pause(decode)
    events = SseReader(gateway.url, 30)
    first = events.next()
    wait_for(lambda: load(fleet.addresses[prefill]).kv_transfers_pending == 1, "the produced transfer")
    if gone == "source killed":
        fleet.kill(prefill)
    else:
        wait_for(lambda: load(fleet.addresses[prefill]).kv_transfers_pending == 0, "the lease to end", 800)
    fleet.resume(decode)
    rest = events.rest()
    events.close()
    assert text_of([first, *rest]) == expected
    assert rest[-2]["choices"][0]["finish_reason"] == "length"
    assert load(fleet.addresses[decode]).kv_bytes_pulled == pulled  # nothing came over: it recomputed
    assert pulls(fleet, decode) == before


def test_a_client_gone_mid_pull_frees_the_decode_engines_blocks_and_the_transfer(
    fleet, make_gateway, healthy, kind
):
    """The pull is held open by stopping the source (SIGSTOP) once the decode engine started it: the
    decode engine has planned its blocks (and, for shm, made its segment). The client leaving cancels the
    pull: the decode engine frees its blocks, the segment is gone, and the transfer ends on the source."""
    prefill, decode = engines_of(kind)
    gateway = make_gateway(prefill=[prefill], decode=[decode])
    fleet.pause(decode)
    events = SseReader(gateway.url, 30)
    events.next()  # the first token, from the prefill engine
    wait_for(lambda: load(fleet.addresses[prefill]).kv_transfers_pending == 1, "the produced transfer")
    fleet.pause(prefill)
    fleet.resume(decode)
    wait_for(lambda: load(fleet.addresses[decode]).kv_blocks_used > 0, "the decode engine to plan its pull")
    events.close()
    wait_idle(fleet, [decode])
    fleet.resume(prefill)
    wait_idle(fleet, [prefill])  # released by the gateway, or by its lease
