"""GenerateStream: many Generate calls on one gRPC stream, on the real engine (stories260K) and through the
real gateway, which multiplexes every generation to an engine that serves it (--engine-multiplex).

Each request on the stream answers exactly what its own Generate call answers (messages, then its end with
Generate's status); cancelling a tag, closing the stream, a deadline and a dead engine end requests as they
end Generate calls, with every KV block given back."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Iterator

import grpc
import httpx
import openai
import pytest

from conduit.engine.v1 import engine_pb2, engine_pb2_grpc
from tests.gateway.sse import parse_events
from tests.support.gateway_thread import GatewayThread
from tests.support.polling import wait_for
from tests.support.processes import require_shared, start_engine
from tests.support.stories import MODEL, PROMPT_IDS

pytestmark = pytest.mark.integration

OK = grpc.StatusCode.OK.value[0]


@pytest.fixture(scope="module")
def engine():
    with start_engine(require_shared(f"models/{MODEL}"), "--max-num-seqs", "8") as process:
        yield process


@pytest.fixture(scope="module")
def stub(engine):
    with grpc.insecure_channel(engine.address) as channel:
        yield engine_pb2_grpc.EngineStub(channel)


def _request(max_tokens: int, **sampling: object) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        token_ids=engine_pb2.TokenIds(ids=PROMPT_IDS),
        sampling=engine_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling),
    )


def _open(tag: int, request: engine_pb2.GenerateRequest, **metadata: str) -> engine_pb2.GenerateStreamRequest:
    return engine_pb2.GenerateStreamRequest(
        open=engine_pb2.GenerateStreamOpen(tag=tag, request=request, metadata=metadata)
    )


class Session:
    """A GenerateStream driven from a test thread: send actions, read batches on a reader thread."""

    def __init__(self, stub: engine_pb2_grpc.EngineStub) -> None:
        self._actions: list[engine_pb2.GenerateStreamRequest | None] = []
        self._ready = threading.Condition()
        self.messages: dict[int, list[engine_pb2.GenerateResponse]] = {}
        self.ends: dict[int, tuple[int, str]] = {}
        self.batches = 0
        self.error: grpc.RpcError | None = None
        self._call = stub.GenerateStream(self._requests())
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def send(self, action: engine_pb2.GenerateStreamRequest | None) -> None:
        """An action; None closes the client's side."""
        with self._ready:
            self._actions.append(action)
            self._ready.notify()

    def _requests(self) -> Iterator[engine_pb2.GenerateStreamRequest]:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._actions)
                action = self._actions.pop(0)
            if action is None:
                return
            yield action

    def _read(self) -> None:
        try:
            for batch in self._call:
                self.batches += 1
                for item in batch.messages:
                    assert item.tag not in self.ends, "a message after its request's end"
                    self.messages.setdefault(item.tag, []).append(item.message)
                for end in batch.ends:
                    self.ends[end.tag] = (end.code, end.details)
        except grpc.RpcError as exc:
            self.error = exc

    def cancel(self) -> None:
        self._call.cancel()

    def join(self) -> None:
        self._reader.join(timeout=60)
        assert not self._reader.is_alive()


def _generate(stub: engine_pb2_grpc.EngineStub, request: engine_pb2.GenerateRequest) -> list:
    return list(stub.Generate(request, timeout=60))


def _choices(messages: list[engine_pb2.GenerateResponse]) -> dict[int, tuple]:
    """Per choice: its token ids, text, logprobs and finish reason."""
    out: dict[int, tuple[list[int], str, list[float], int]] = {}
    for message in messages:
        ids, text, logprobs, _ = out.get(message.index, ([], "", [], 0))
        ids = ids + list(message.token_ids)
        logprobs = logprobs + [entry.token.logprob for entry in message.logprobs]
        out[message.index] = (ids, text + message.text, logprobs, message.finish_reason)
    return out


def _idle(stub: engine_pb2_grpc.EngineStub) -> bool:
    load = stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=10)
    return load.running_requests == 0 and load.waiting_requests == 0 and load.kv_blocks_used == 0


def test_model_info_says_the_engine_serves_generate_stream_and_takes_batches_up_to_its_limit(stub):
    info = stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=10)
    assert info.generate_stream
    # The engine's gRPC receive limit: the largest request of its context (a few hundred KB here).
    assert 0 < info.generate_stream_batch_bytes < 64 * 1024 * 1024


def test_a_batch_of_actions_answers_what_the_same_actions_one_by_one_answer(stub):
    requests = {tag: _request(12 + tag, temperature=0) for tag in (1, 2, 3)}
    batched, plain = Session(stub), Session(stub)
    batched.send(
        engine_pb2.GenerateStreamRequest(
            batch=engine_pb2.GenerateStreamActions(actions=[_open(t, r) for t, r in requests.items()])
        )
    )
    for tag, request in requests.items():
        plain.send(_open(tag, request))
    for session in (batched, plain):
        session.send(None)
        session.join()
        assert session.error is None
    assert batched.ends == plain.ends == {tag: (OK, "") for tag in requests}
    assert {tag: _choices(batched.messages[tag]) for tag in requests} == {
        tag: _choices(plain.messages[tag]) for tag in requests
    }
    wait_for(lambda: _idle(stub), "the engine idle")


def test_a_batch_inside_a_batch_ends_the_stream_invalid_argument(stub):
    inner = engine_pb2.GenerateStreamRequest(
        batch=engine_pb2.GenerateStreamActions(actions=[_open(2, _request(4))])
    )
    session = Session(stub)
    session.send(engine_pb2.GenerateStreamRequest(batch=engine_pb2.GenerateStreamActions(actions=[inner])))
    session.join()
    assert session.error is not None
    assert session.error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "a batch inside a batch" in session.error.details()


def test_each_request_on_the_stream_answers_what_its_generate_call_answers(stub):
    requests = {
        1: _request(40, temperature=0),
        2: _request(24, temperature=0.8, seed=7, n=2, logprobs=2),
        3: _request(33, temperature=0, logprobs=0),
        4: engine_pb2.GenerateRequest(
            text="Once upon a time", sampling=engine_pb2.SamplingParams(max_tokens=5, temperature=0)
        ),
    }
    session = Session(stub)
    for tag, request in requests.items():
        session.send(_open(tag, request))
    session.send(None)
    session.join()
    assert session.error is None
    assert session.ends == {tag: (OK, "") for tag in requests}
    for tag, request in requests.items():
        got, want = session.messages[tag], _generate(stub, request)
        got_choices, want_choices = _choices(got), _choices(want)
        assert got_choices.keys() == want_choices.keys()
        for index, (ids, text, logprobs, finish) in want_choices.items():
            assert got_choices[index][:2] == (ids, text)
            assert got_choices[index][3] == finish
            assert got_choices[index][2] == pytest.approx(logprobs, abs=1e-4)
        assert got[-1].usage == want[-1].usage
        assert list(got[0].prompt_token_ids) == list(want[0].prompt_token_ids)
    # Requests that ran together shared batches: fewer batches than messages.
    assert session.batches < sum(len(messages) for messages in session.messages.values())
    wait_for(lambda: _idle(stub), "the engine idle")


def test_a_refused_request_ends_its_tag_with_generates_status_and_the_others_go_on(stub):
    session = Session(stub)
    session.send(_open(1, _request(20, temperature=0)))
    session.send(_open(2, _request(20, temperature=-1.0)))
    session.send(_open(3, engine_pb2.GenerateRequest(model="no-such-model", text="hi")))
    session.send(None)
    session.join()
    assert session.error is None
    assert session.ends[1] == (OK, "")
    with pytest.raises(grpc.RpcError) as refused:
        _generate(stub, _request(20, temperature=-1.0))
    code, details = session.ends[2]
    assert (code, details) == (refused.value.code().value[0], refused.value.details())
    assert "temperature" in details
    assert session.ends[3][0] == grpc.StatusCode.NOT_FOUND.value[0]
    assert 2 not in session.messages and 3 not in session.messages
    assert len(_choices(session.messages[1])[0][0]) == 20


def test_a_cancelled_tag_is_aborted_and_gives_its_blocks_back(stub):
    session = Session(stub)
    session.send(_open(5, _request(400, temperature=0)))
    session.send(_open(6, _request(30, temperature=0)))
    wait_for(lambda: len(session.messages.get(5, [])) >= 2, "the long request under way")
    session.send(engine_pb2.GenerateStreamRequest(cancel=5))
    session.send(engine_pb2.GenerateStreamRequest(cancel=12345))  # unknown: ignored
    session.send(None)
    session.join()  # the stream ends once the other request has
    assert session.error is None
    assert 5 not in session.ends  # a cancelled request sends nothing more
    assert sum(len(m.token_ids) for m in session.messages[5]) < 400
    assert session.ends[6] == (OK, "")
    wait_for(lambda: _idle(stub), "the cancelled request's blocks freed")


def test_closing_the_stream_cancels_every_request_open_on_it(stub):
    session = Session(stub)
    for tag in (1, 2, 3):
        session.send(_open(tag, _request(400, temperature=0)))
    wait_for(lambda: all(len(session.messages.get(tag, [])) >= 2 for tag in (1, 2, 3)), "three under way")
    session.cancel()
    session.join()
    assert session.error is not None and session.error.code() == grpc.StatusCode.CANCELLED
    wait_for(lambda: _idle(stub), "every request of the stream aborted")


def test_a_tag_opened_twice_ends_the_stream_invalid_argument(stub):
    session = Session(stub)
    session.send(_open(9, _request(400, temperature=0)))
    session.send(_open(9, _request(4, temperature=0)))
    session.join()
    assert session.error is not None
    assert session.error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tag 9 is already open" in session.error.details()
    wait_for(lambda: _idle(stub), "the open request aborted with the stream")


def test_the_request_id_and_trace_context_come_from_the_open_metadata(stub):
    session = Session(stub)
    session.send(_open(1, _request(3, temperature=0), **{"x-request-id": "mux-req-1"}))
    session.send(None)
    session.join()
    assert {message.request_id for message in session.messages[1]} == {"mux-req-1"}


# -- through the gateway ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gateways(engine):
    """Two in-process gateways on the engine: one multiplexing (the default), one not."""
    mux = GatewayThread([engine.address]).start()
    plain = GatewayThread([engine.address], engine_multiplex=False).start()
    wait_for(lambda: _serving(mux) and _serving(plain), "both gateways see the engine")
    yield mux, plain
    mux.stop()
    plain.stop()


def _serving(gateway: GatewayThread) -> bool:
    return all(node.serving for node in gateway.ctx.pool.engines)


def _client(gateway: GatewayThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)


def _streamed(client: openai.OpenAI, index: int) -> tuple:
    """One request of a mixed load, streamed: per choice its text, logprobs and finish reason; usage."""
    if index % 2:
        stream = client.completions.create(
            model=MODEL,
            prompt=f"Once upon a time, number {index}",
            max_tokens=48,
            temperature=0.9,
            seed=index,
            n=2,
            logprobs=2,
            stream=True,
            stream_options={"include_usage": True},
        )
        texts: dict[int, str] = {}
        finishes: dict[int, str | None] = {}
        logprobs: dict[int, list[float]] = {}
        usage = None
        for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + choice.text
                finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
                if choice.logprobs is not None:
                    logprobs.setdefault(choice.index, []).extend(choice.logprobs.token_logprobs)
        return texts, finishes, logprobs, usage.model_dump() if usage else None
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"Tell me story {index}"}],
        max_tokens=40,
        temperature=0,
        stream=True,
    )
    text, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return {0: text}, {0: finish}, {}, None


def _load(gateway: GatewayThread, count: int) -> list[tuple]:
    async def run() -> list[tuple]:
        with _client(gateway) as client:
            return list(
                await asyncio.gather(*(asyncio.to_thread(_streamed, client, i) for i in range(count)))
            )

    return asyncio.run(run())


def test_the_gateway_multiplexes_and_answers_as_with_a_call_per_prompt(gateways, stub):
    mux, plain = gateways
    assert all(node.client.multiplexed for node in mux.ctx.pool.engines)
    assert not any(node.client.multiplexed for node in plain.ctx.pool.engines)
    got, want = _load(mux, 16), _load(plain, 16)
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a[0] == b[0], index  # texts
        assert a[1] == b[1], index  # finish reasons
        assert a[3] == b[3], index  # usage
        for choice, values in b[2].items():
            assert a[2][choice] == pytest.approx(values, abs=1e-4), index
    wait_for(lambda: _idle(stub), "the engine idle")


def test_a_client_leaving_mid_stream_cancels_its_request_on_the_shared_stream(gateways, stub):
    mux, _ = gateways
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=mux.url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert parse_events(next(line for line in lines if line) + "\n\n")
    wait_for(lambda: _idle(stub), "the left request aborted")
    node = mux.ctx.pool.engines[0]
    wait_for(lambda: node.client._mux.open_calls == 0, "no request left open on the stream")


def test_a_request_deadline_on_the_shared_stream_is_504_and_cancels_it(engine, stub):
    gateway = GatewayThread([engine.address], request_timeout_s=0.5).start()
    try:
        wait_for(lambda: _serving(gateway), "the gateway sees the engine")
        engine.process.send_signal(signal.SIGSTOP)  # nothing comes back before the deadline
        try:
            body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8}
            response = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=30)
        finally:
            engine.process.send_signal(signal.SIGCONT)
        assert response.status_code == 504
        assert response.json()["error"]["code"] == "timeout"
        wait_for(lambda: _idle(stub), "the expired request cancelled on the engine")
    finally:
        gateway.stop()


def test_an_engine_killed_under_the_shared_stream_fails_its_requests_and_the_next_opens_a_new_one():
    with start_engine(require_shared(f"models/{MODEL}")) as doomed:
        gateway = GatewayThread([doomed.address]).start()
        try:
            wait_for(lambda: _serving(gateway), "the gateway sees the engine")
            body = {"model": MODEL, "prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}
            with httpx.Client(base_url=gateway.url, timeout=30) as client:
                with client.stream("POST", "/v1/completions", json=body) as response:
                    lines = (line for line in response.iter_lines() if line)
                    next(lines)
                    doomed.process.send_signal(signal.SIGSTOP)
                    doomed.process.kill()
                    events = [parse_events(line + "\n\n")[0] for line in lines if line != "data: [DONE]"]
            error = events[-1]["error"]
            assert (error["type"], error["code"]) == ("server_error", "engine_unavailable")
            node = gateway.ctx.pool.engines[0]
            assert node.client._mux.open_calls == 0
        finally:
            gateway.stop()
