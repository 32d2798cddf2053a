"""NIXL KV transfers between engines of different tensor-parallel sizes, on real engine processes with
real worker processes behind a real gateway: a prefill engine and a decode engine of each size (1 and 2),
every one started with `--kv-transport nixl`, paired 1→2, 2→1 and 2→2.

A TP=2 engine's KV cache lives in its two workers, each rank holding half of the KV heads under its own
NIXL agent: the source describes each rank's shard, and each destination rank reads the heads it holds
from the source ranks holding them. Per pair: the stream gives exactly the decode engine's colocated
greedy text, the decode engine's GetLoad counts the pull under nixl (not a fallback to gRPC) and more
bytes pulled, and both engines end holding no block, no transfer and no request. A TP=2 source killed
before the pull or a lease ended before it is recomputed, and a client gone mid-pull frees both sides'
blocks, as with one rank. Skips where NIXL cannot
start (the engines say so in GetModelInfo.kv_transport), except in CI.
"""

from __future__ import annotations

import os

import pytest

from conduit.engine.v1 import engine_pb2
from tests.disaggregation.helpers import load, model_info, sdk, wait_idle
from tests.support.engine_fleet import EngineFleet
from tests.support.polling import wait_for
from tests.support.processes import require_shared
from tests.support.stories import MODEL

pytestmark = pytest.mark.integration

NIXL = ("--kv-transport", "nixl")
LEASE = "3"  # seconds (the TP=2 source's): room for a pull, short enough to wait out
# Fleet indices: prefill TP=1, prefill TP=2, decode TP=1, decode TP=2.
FLAGS = [
    ("--role", "prefill", *NIXL),
    ("--role", "prefill", *NIXL, "--tensor-parallel-size", "2", "--kv-transfer-lease-seconds", LEASE),
    ("--role", "both", *NIXL),
    ("--role", "both", *NIXL, "--tensor-parallel-size", "2"),
]
PAIRS = {"1to2": (0, 3), "2to1": (1, 2), "2to2": (1, 3)}


def prompt_of(pair: str, n: int = 0) -> list[int]:
    """60 tokens (4 blocks) whose first block no other case shares: every case pulls its whole prompt."""
    first = 10 + 40 * (4 * list(PAIRS).index(pair) + n)  # at most 10 + 40 * 11 + 59 < 512
    return [1, *range(first, first + 59)]


@pytest.fixture(scope="module")
def fleet():
    model = require_shared(f"models/{MODEL}")
    with EngineFleet(model, len(FLAGS), ("--max-num-seqs", "8"), per_engine=FLAGS) as engines:
        started = {model_info(address).kv_transport for address in engines.addresses}
        if started != {"nixl"}:
            why = f"the engines run {sorted(started)}: NIXL could not start here (see their log)"
            if os.environ.get("CI") == "true":
                pytest.fail(why)
            pytest.skip(why)
        yield engines


@pytest.fixture
def healthy(fleet):
    """Every engine up and running (one a test killed is restarted first); after the test, stopped
    engines resume. A killed engine waits for the next test to restart it: the module's last test kills
    one, and nothing then pays for a TP=2 start nobody uses."""
    for index, engine in enumerate(fleet.engines):
        if engine.process.poll() is not None:
            fleet.restart(index)
    yield
    alive = [index for index, engine in enumerate(fleet.engines) if engine.process.poll() is None]
    for index in alive:
        fleet.resume(index)
    wait_idle(fleet, alive)


def colocated_text(fleet, decode: int, prompt: list[int], max_tokens: int) -> str:
    request = engine_pb2.GenerateRequest(
        token_ids=engine_pb2.TokenIds(ids=prompt),
        sampling=engine_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
    )
    return "".join(message.text for message in fleet.stub(decode).Generate(request, timeout=60))


def complete(url: str, prompt: list[int], max_tokens: int):
    with sdk(url) as client:
        return client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
        )


def pulls(fleet, index: int) -> dict[str, int]:
    return dict(load(fleet.addresses[index]).kv_pulls_by_transport)


@pytest.mark.parametrize("pair", list(PAIRS))
def test_kv_moves_over_nixl_between_tensor_parallel_sizes(fleet, make_gateway, healthy, pair):
    prefill, decode = PAIRS[pair]
    gateway = make_gateway(prefill=[prefill], decode=[decode])
    prompt = prompt_of(pair)
    before, pulled = pulls(fleet, decode), load(fleet.addresses[decode]).kv_bytes_pulled
    reply = complete(gateway.url, prompt, 20)
    after = pulls(fleet, decode)
    assert after.get("nixl", 0) == before.get("nixl", 0) + 1 and after.get("grpc", 0) == before.get("grpc", 0)
    # The whole prompt came over: 4 blocks of 5 layers' K and V, 4 heads of 8 floats, 16 tokens each.
    assert load(fleet.addresses[decode]).kv_bytes_pulled - pulled == 4 * 2 * 5 * 16 * 4 * 8 * 4
    wait_idle(fleet, [prefill, decode])
    assert reply.choices[0].text == colocated_text(fleet, decode, prompt, 20)
    assert reply.usage.completion_tokens == 20
    wait_idle(fleet, [prefill, decode])


def test_a_client_gone_mid_pull_frees_the_tensor_parallel_engines_blocks(fleet, make_gateway, healthy):
    """The pull is held open by stopping the source engine (SIGSTOP) once the decode engine planned its
    blocks; the client leaving cancels it, and both engines end holding nothing."""
    prefill, decode = PAIRS["2to2"]
    gateway = make_gateway(prefill=[prefill], decode=[decode])
    fleet.pause(decode)
    with sdk(gateway.url) as client:
        stream = client.completions.create(
            model=MODEL,
            prompt=prompt_of("2to2", 3),
            max_tokens=30,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(stream))
        wait_for(lambda: load(fleet.addresses[prefill]).kv_transfers_pending == 1, "the produced transfer")
        fleet.pause(prefill)
        fleet.resume(decode)
        wait_for(
            lambda: load(fleet.addresses[decode]).kv_blocks_used > 0, "the decode engine to plan its pull"
        )
        stream.close()
    wait_idle(fleet, [decode])
    fleet.resume(prefill)
    wait_idle(fleet, [prefill])


# The kill last: nothing restarts the killed TP=2 source after it (see healthy).
@pytest.mark.parametrize("gone", ["lease expired", "source killed"])
def test_a_tensor_parallel_transfer_gone_before_the_pull_is_recomputed(fleet, make_gateway, healthy, gone):
    prefill, decode = PAIRS["2to2"]
    gateway = make_gateway(prefill=[prefill], decode=[decode])
    prompt = prompt_of("2to2", 1 if gone == "source killed" else 2)
    before, pulled = pulls(fleet, decode), load(fleet.addresses[decode]).kv_bytes_pulled
    fleet.pause(decode)
    with sdk(gateway.url) as client:
        stream = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=30,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        first = next(chunks)  # the first token, from the prefill engine
        wait_for(lambda: load(fleet.addresses[prefill]).kv_transfers_pending == 1, "the produced transfer")
        if gone == "source killed":
            fleet.kill(prefill)
        else:
            wait_for(
                lambda: load(fleet.addresses[prefill]).kv_transfers_pending == 0, "the lease to end", 800
            )
        fleet.resume(decode)
        text = first.choices[0].text + "".join(c.choices[0].text for c in chunks if c.choices)
    assert load(fleet.addresses[decode]).kv_bytes_pulled == pulled  # nothing came over: it recomputed
    assert pulls(fleet, decode) == before
    wait_idle(fleet, [decode])
    assert text == colocated_text(fleet, decode, prompt, 30)
