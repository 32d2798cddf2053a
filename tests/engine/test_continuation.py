"""Continuations (request migration) on a real engine over stories260K: a request continued from any cut of
an unbroken run's output produces exactly the rest of that run (tokens, text, logprobs, finish, usage) for
greedy, seeded n=2, stop strings with text held back, penalties, min_tokens and a JSON schema; bad
continuations are INVALID_ARGUMENT naming the field; and a drain's end hands streams back with MIGRATE."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading

import grpc
import pytest

from conduit.engine.v1 import engine_pb2 as pb
from conduit_engine.core.sequence import FinishReason
from conduit_engine.engine.continuation import Continuation, ContinuedChoice
from conduit_engine.engine.llm_engine import LLMEngine
from conduit_engine.engine.request import GenerationRequest, RequestOutput
from conduit_engine.entrypoints.proto_mapping import request_from_pb
from conduit_engine.errors import InvalidRequestError
from conduit_engine.sampling_params import SamplingParams
from conduit_engine.structured.spec import StructuredKind, StructuredSpec
from tests.engine.support.harness import make_engine, run_to_completion
from tests.engine.support.server_thread import ServerThread, engine_config, wait_until
from tests.support.stories import PROMPT_IDS

pytestmark = pytest.mark.integration

_SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
)

CASES = {
    "greedy": SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    "seeded_n2_logprobs": SamplingParams(max_tokens=20, temperature=0.9, seed=7, n=2, logprobs=2),
    # Greedy from BOS writes "... little girl named Lily. She loved to play outside in the park.": the
    # stop string is held back token by token before it matches.
    "stop_string": SamplingParams(max_tokens=40, temperature=0.0, stop=["in the park"]),
    "penalties": SamplingParams(
        max_tokens=24,
        temperature=0.7,
        seed=3,
        presence_penalty=0.8,
        frequency_penalty=0.5,
        repetition_penalty=1.3,
        min_tokens=20,
    ),
    "json_schema": SamplingParams(
        max_tokens=40,
        temperature=0.8,
        seed=11,
        structured=StructuredSpec(kind=StructuredKind.JSON_SCHEMA, text=_SCHEMA),
    ),
}


@pytest.fixture(scope="module")
def engine(stories_path):
    # One token per step: every message is one token, so every position is a place a stream can break.
    eng = make_engine(stories_path, max_decode_steps=1)
    yield eng
    eng.shutdown()


def _run(engine: LLMEngine, req: GenerationRequest) -> dict[int, list[RequestOutput]]:
    engine.add_request(req)
    results = run_to_completion(engine)
    return {index: c.outputs for (rid, index), c in results.items() if rid == req.request_id}


def _request(rid: str, params: SamplingParams, continuation: Continuation | None = None) -> GenerationRequest:
    return GenerationRequest(
        rid, dataclasses.replace(params), token_ids=list(PROMPT_IDS[:1]), continuation=continuation
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_continuation_from_every_cut_finishes_exactly_as_the_unbroken_run(engine, case):
    params = CASES[case]
    unbroken = _run(engine, _request(f"{case}-whole", params))
    assert sorted(unbroken) == list(range(params.n))
    final_usage = max((outs[-1] for outs in unbroken.values()), key=lambda o: o.usage.completion_tokens).usage
    longest = max(len(outs) for outs in unbroken.values())
    for cut in range(longest - 1):
        # Every choice still running at the cut continues from its first `cut` messages.
        running = {i: outs for i, outs in unbroken.items() if len(outs) > cut + 1}
        continuation = Continuation(
            tuple(
                ContinuedChoice(
                    index,
                    tuple(t for o in outs[:cut] for t in o.token_ids),
                    "".join(o.text for o in outs[:cut]),
                )
                for index, outs in sorted(running.items())
            )
        )
        continued = _run(engine, _request(f"{case}-cut{cut}", params, continuation))
        assert sorted(continued) == sorted(running)
        for index, outs in running.items():
            rest, again = outs[cut:], continued[index]
            assert [t for o in again for t in o.token_ids] == [t for o in rest for t in o.token_ids]
            assert "".join(o.text for o in again) == "".join(o.text for o in rest)
            assert again[-1].finish_reason == rest[-1].finish_reason
            assert again[-1].stop_string == rest[-1].stop_string
            logprobs = [lp for o in again for lp in o.logprobs]
            expected = [lp for o in rest for lp in o.logprobs]
            assert [lp.token_id for lp in logprobs] == [lp.token_id for lp in expected]
            assert [lp.top_ids for lp in logprobs] == [lp.top_ids for lp in expected]
            for got, want in zip(logprobs, expected, strict=True):
                assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        if len(running) == params.n:
            # The continued tokens count as output: the same usage as the unbroken run.
            last = max((outs[-1] for outs in continued.values()), key=lambda o: o.usage.completion_tokens)
            assert last.usage.completion_tokens == final_usage.completion_tokens
            assert last.usage.prompt_tokens == final_usage.prompt_tokens


def test_the_held_back_stop_text_is_not_in_the_continuation_and_comes_out_right(engine):
    params = CASES["stop_string"]
    outs = _run(engine, _request("held-whole", params))[0]
    texts = [o.text for o in outs]
    # Some message released nothing: its token's text was held back as a partial match of the stop string.
    held = [i for i, o in enumerate(outs[:-1]) if o.token_ids and not o.text]
    assert held, texts
    cut = held[-1] + 1
    continuation = Continuation(
        (ContinuedChoice(0, tuple(t for o in outs[:cut] for t in o.token_ids), "".join(texts[:cut])),)
    )
    again = _run(engine, _request("held-cut", params, continuation))[0]
    assert "".join(texts[:cut]) + "".join(o.text for o in again) == "".join(texts)
    assert again[-1].stop_string == "in the park"


def _refused(engine: LLMEngine, continuation: Continuation, params: SamplingParams | None = None) -> str:
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(_request("bad", params or CASES["greedy"], continuation))
    assert not engine.has_request("bad") and engine.block_manager.stats().used == 0
    return str(err.value)


def test_bad_continuations_are_refused_naming_the_field(engine):
    greedy = CASES["greedy"]
    one = ContinuedChoice(0, (), "")
    assert _refused(engine, Continuation(())).startswith("continuation.choices: ")
    assert _refused(engine, Continuation((ContinuedChoice(1, (), ""),))).startswith(
        "continuation.choices[0].index: choice index 1 is not below n (1)"
    )
    two = dataclasses.replace(greedy, n=2)
    assert _refused(engine, Continuation((one, one)), two).startswith(
        "continuation.choices[1].index: choice 0 is continued twice"
    )
    assert _refused(engine, Continuation((ContinuedChoice(0, (5, 999), ""),))).startswith(
        "continuation.choices[0].token_ids: token id 999 is outside the vocabulary [0, 512)"
    )
    # As many tokens as max_tokens: the choice would already have ended.
    done = dataclasses.replace(greedy, max_tokens=3)
    assert _refused(engine, Continuation((ContinuedChoice(0, (400, 401, 402), ""),)), done).startswith(
        "continuation.choices[0].token_ids: token 402 at position 2 ends the choice"
    )
    eos = dataclasses.replace(greedy, ignore_eos=False)
    assert _refused(engine, Continuation((ContinuedChoice(0, (400, 2), ""),)), eos).startswith(
        "continuation.choices[0].token_ids: token 2 at position 1 ends the choice"
    )
    schema = CASES["json_schema"]
    assert _refused(engine, Continuation((ContinuedChoice(0, (403,), ""),)), schema).startswith(
        "continuation.choices[0].token_ids: token 403 at position 0 is not allowed by the request's output"
    )
    text = engine.tokenizer.decode([403, 407], False)
    assert _refused(engine, Continuation((ContinuedChoice(0, (403, 407), text + "x"),))).startswith(
        "continuation.choices[0].text: "
    )


def test_a_continuation_with_kv_transfer_is_refused_at_the_wire():
    msg = pb.GenerateRequest(text="hi", continuation=pb.Continuation(choices=[pb.ContinuedChoice(index=0)]))
    msg.kv_transfer.produce.SetInParent()
    with pytest.raises(InvalidRequestError, match=r"^continuation: cannot be combined with kv_transfer"):
        request_from_pb(msg)
    plain = request_from_pb(
        pb.GenerateRequest(
            text="hi",
            continuation=pb.Continuation(choices=[pb.ContinuedChoice(index=1, token_ids=[5, 6], text="ab")]),
        )
    )
    assert plain.continuation == Continuation((ContinuedChoice(1, (5, 6), "ab"),))


def test_migrate_all_hands_every_live_request_back_and_frees_its_blocks(engine):
    engine.add_request(_request("m1", dataclasses.replace(CASES["greedy"], max_tokens=200, n=2)))
    engine.add_request(_request("m2", CASES["greedy"]))
    for _ in range(3):
        engine.step()
    outputs = engine.migrate_all()
    assert sorted((o.request_id, o.index) for o in outputs) == [("m1", 0), ("m1", 1), ("m2", 0)]
    assert all(o.finished and o.finish_reason is FinishReason.MIGRATE and o.error is None for o in outputs)
    assert not engine.has_work()
    engine.check_integrity()
    assert engine.block_manager.stats().used == 0


def test_a_drain_that_runs_out_hands_the_streams_back_with_migrate(stories_path):
    config = engine_config(stories_path)
    config = dataclasses.replace(config, server=dataclasses.replace(config.server, drain_seconds=0))
    srv = ServerThread(config).start()
    stub = srv.stub()
    call = stub.Generate(
        pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[1]),
            sampling=pb.SamplingParams(max_tokens=450, temperature=0, n=2, ignore_eos=True),
        )
    )
    received = [next(call)]
    # Hold the engine thread between two steps: the stream is far from its end when the drain runs out.
    gate = threading.Event()
    srv.server.async_engine.call_soon(gate.wait)
    drain = asyncio.run_coroutine_threadsafe(srv.server.drain_and_stop(), srv.loop)
    assert wait_until(lambda: srv.server.async_engine.draining)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(text="hi")))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    gate.set()
    received.extend(call)  # ends normally (status OK): each choice's last message says MIGRATE
    finals = [m for m in received if m.finished]
    assert sorted(m.index for m in finals) == [0, 1]
    assert all(m.finish_reason == pb.FINISH_REASON_MIGRATE and not m.HasField("error") for m in finals)
    assert sum(len(m.token_ids) for m in received) < 900
    drain.result(timeout=60)
    srv.loop.call_soon_threadsafe(srv.loop.stop)
