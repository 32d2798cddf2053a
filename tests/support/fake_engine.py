"""A scriptable fake engine (grpc.aio Engine + grpc.health.v1) for fault injection.

It runs on its own event loop in a background thread, so synchronous tests and benchmarks can use it.
Each Generate call follows `FakeEngine.script`; the calls it received are recorded for assertions.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from conduit.engine.v1 import engine_pb2, engine_pb2_grpc
from conduit_engine.entrypoints.generate_stream import GenerateStreamSession
from conduit_engine.errors import EngineError

# The fake's server takes gRPC's default largest message, and so GenerateStream batches up to it.
BATCH_BYTES = 4 * 1024 * 1024

WORDS = ("Once", " upon", " a", " time", ",", " there", " was", " a", " little", " cat", ".")


@dataclass
class Script:
    """What every Generate call does (tests replace `FakeEngine.script` between requests)."""

    # Text of the i-th generated token (cycled); each token goes out as its own message.
    words: Sequence[str] = WORDS
    # Tokens per choice when the request does not set max_tokens.
    default_max_tokens: int = 16
    max_tokens_cap: int = 64
    n_cap: int = 8
    finish_reason: int = engine_pb2.FINISH_REASON_LENGTH
    # Fail with this status before sending anything...
    error_before: grpc.StatusCode | None = None
    # ...or after this many messages (error_code/error_message).
    error_after: int | None = None
    error_code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    error_message: str = "injected failure"
    # After this many messages, wait until FakeEngine.release() (or the caller cancels).
    hold_after: int | None = None
    # Logprobs per token when the request asks for them.
    logprob: float = -0.5
    # Abort answers this status (the engine failing as the gateway stops a request)...
    abort_error: grpc.StatusCode | None = None
    # ...or answers only after FakeEngine.release().
    abort_held: bool = False


@dataclass
class Record:
    """What the fake saw, for assertions."""

    requests: list[engine_pb2.GenerateRequest] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)
    # Every call of any service (health included): (method, its invocation metadata).
    calls: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    cancelled: int = 0
    completed: int = 0
    # The request ids of the Abort calls received.
    aborted: list[str] = field(default_factory=list)


class _CallRecorder(grpc.aio.ServerInterceptor):
    """Records the method and metadata of every call before it is handled."""

    def __init__(self, fake: FakeEngine) -> None:
        self.fake = fake

    async def intercept_service(self, continuation, handler_call_details):
        metadata = {key: value for key, value in handler_call_details.invocation_metadata or ()}
        self.fake.record.calls.append((handler_call_details.method, metadata))
        return await continuation(handler_call_details)


class _Servicer(engine_pb2_grpc.EngineServicer):
    def __init__(self, fake: FakeEngine) -> None:
        self.fake = fake

    async def Generate(self, request, context):
        fake = self.fake
        script = fake.script
        # This call's record: a call a test left behind that ends late counts in its own test's record.
        record = fake.record
        record.requests.append(request)
        record.metadata.append({key: value for key, value in context.invocation_metadata()})
        if script.error_before is not None:
            await context.abort(script.error_before, script.error_message)
        if request.HasField("model") and request.model != fake.model:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model: unknown model {request.model!r}")
        sampling = request.sampling
        max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else script.default_max_tokens
        n = sampling.n if sampling.HasField("n") else 1
        # Fuzzed requests may ask for billions of tokens: a fake only needs to show the shape.
        max_tokens, n = min(max_tokens, script.max_tokens_cap), min(n, script.n_cap)
        prompt_ids = _prompt_ids(request)
        # A continuation carries on its choices where the other engine stopped; the rest had finished.
        start = {index: 0 for index in range(n)}
        if request.HasField("continuation"):
            start = {choice.index: len(choice.token_ids) for choice in request.continuation.choices}
        replayed = sum(start.values())
        sent = 0
        try:
            for step in range(max_tokens):
                for index in sorted(start):
                    if step < start[index]:
                        continue
                    if script.error_after is not None and sent >= script.error_after:
                        await context.abort(script.error_code, script.error_message)
                    if script.hold_after is not None and sent >= script.hold_after:
                        await fake.wait_released()
                    word = script.words[(step + index) % len(script.words)]
                    last = step == max_tokens - 1
                    message = engine_pb2.GenerateResponse(
                        request_id=request.request_id,
                        index=index,
                        text=word,
                        token_ids=[100 + step],
                        usage=engine_pb2.Usage(
                            prompt_tokens=len(prompt_ids),
                            completion_tokens=replayed + sent + 1,
                            cached_tokens=0,
                        ),
                        finished=last,
                        finish_reason=script.finish_reason if last else engine_pb2.FINISH_REASON_UNSPECIFIED,
                    )
                    if sent == 0:
                        message.prompt_token_ids.extend(prompt_ids)
                        if sampling.HasField("prompt_logprobs"):
                            # Every prompt token but the first (nothing predicts it).
                            message.prompt_logprobs.extend(
                                _logprobs(f"p{token}", token, script.logprob, sampling.prompt_logprobs)
                                for token in prompt_ids[1:]
                            )
                    if sampling.HasField("logprobs"):
                        message.logprobs.append(
                            _logprobs(word, 100 + step, script.logprob, sampling.logprobs)
                        )
                    await context.write(message)
                    sent += 1
                    # Let other streams (and cancellations) in, as a real engine's step loop would.
                    await asyncio.sleep(0)
        except asyncio.CancelledError:
            record.cancelled += 1
            raise
        record.completed += 1

    async def GenerateStream(self, request_iterator, context):
        mode = self.fake.generate_stream
        if mode != "on":
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found: GenerateStream")
        # The engine's own session over this fake's Generate (each request as a Generate call).
        await context.send_initial_metadata(())
        session = GenerateStreamSession(self._generate_on_stream, lambda exc: exc.code)
        async for batch in session.run(request_iterator):
            yield batch

    async def _generate_on_stream(self, request, metadata):
        """The scripted Generate of one request on a GenerateStream: its writes, then its abort if any."""
        messages: asyncio.Queue[object] = asyncio.Queue()
        ended = object()
        context = _StreamRequestContext(metadata, messages)

        async def run() -> None:
            try:
                await self.Generate(request, context)
            finally:
                messages.put_nowait(ended)

        task = asyncio.ensure_future(run())
        try:
            while (message := await messages.get()) is not ended:
                yield message
            await task  # raises the scripted abort
        finally:
            task.cancel()

    async def Abort(self, request, context):
        script = self.fake.script
        self.fake.record.aborted.append(request.request_id)
        if script.abort_held:
            await self.fake.wait_released()
        if script.abort_error is not None:
            await context.abort(script.abort_error, script.error_message)
        return engine_pb2.AbortResponse(aborted=False)

    async def Tokenize(self, request, context):
        words = request.text.split()
        return engine_pb2.TokenizeResponse(token_ids=list(range(len(words))), tokens=words)

    async def Detokenize(self, request, context):
        return engine_pb2.DetokenizeResponse(text=" ".join(WORDS[i % len(WORDS)] for i in request.token_ids))

    async def GetModelInfo(self, request, context):
        if self.fake.model_info is not None:
            info = engine_pb2.GetModelInfoResponse()
            info.CopyFrom(self.fake.model_info)
            # A real engine's answer, less what the fake does not serve (unless a test wants the lie).
            info.generate_stream = self.fake.generate_stream != "off"
            info.generate_stream_batch_bytes = BATCH_BYTES if info.generate_stream else 0
            return info
        return engine_pb2.GetModelInfoResponse(
            model=self.fake.model,
            architecture="FakeForCausalLM",
            vocab_size=512,
            max_model_len=512,
            dtype="float32",
            device="cpu",
            block_size=16,
            num_kv_blocks=64,
            max_num_seqs=8,
            eos_token_ids=[2],
            has_chat_template=True,
            generate_stream=self.fake.generate_stream != "off",
            generate_stream_batch_bytes=BATCH_BYTES if self.fake.generate_stream != "off" else 0,
        )

    async def GetLoad(self, request, context):
        return engine_pb2.GetLoadResponse(kv_blocks_total=64)


class _Aborted(EngineError):
    """A scripted abort of a request on a GenerateStream: it ends with this status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code


class _StreamRequestContext:
    """What the scripted Generate uses of its call's context, for a request on a GenerateStream."""

    def __init__(self, metadata: Sequence[tuple[str, str]], messages: asyncio.Queue[object]) -> None:
        self._metadata = tuple(metadata)
        self._messages = messages

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    async def write(self, message: engine_pb2.GenerateResponse) -> None:
        self._messages.put_nowait(message)

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Aborted(code, details)


def _prompt_ids(request: engine_pb2.GenerateRequest) -> list[int]:
    kind = request.WhichOneof("input")
    if kind == "token_ids":
        return list(request.token_ids.ids)
    if kind == "text":
        return list(range(1, len(request.text.split()) + 2))
    return list(range(1, sum(len(m.content.split()) + 2 for m in request.chat.messages) + 2))


def _logprobs(word: str, token_id: int, logprob: float, top: int) -> engine_pb2.PositionLogprobs:
    chosen = engine_pb2.TokenLogprob(token_id=token_id, text=word, logprob=logprob, rank=1)
    alternatives = [
        engine_pb2.TokenLogprob(token_id=token_id + k, text=f"{word}#{k}", logprob=logprob - k, rank=k + 1)
        for k in range(1, top + 1)
    ]
    return engine_pb2.PositionLogprobs(token=chosen, top=alternatives)


class FakeEngine:
    """Start with `start()` (or as a context manager); `address` is HOST:PORT on 127.0.0.1."""

    def __init__(self, model: str = "fake-model", port: int = 0, extra_listeners: Sequence[str] = ()) -> None:
        """`port` 0 picks a free one; `extra_listeners`: more gRPC targets to serve on as well (e.g.
        `unix:PATH`, `unix-abstract:NAME`)."""
        self.extra_listeners = tuple(extra_listeners)
        self.model = model
        # What GetModelInfo answers instead of the fake's own (e.g. a real engine's, with its role and KV
        # layout, so the fake can stand in a disaggregated pool).
        self.model_info: engine_pb2.GetModelInfoResponse | None = None
        # GenerateStream: "off" (not served, GetModelInfo says so), "on" (served: each request runs
        # the scripted Generate), "claimed" (GetModelInfo says it is served; it answers UNIMPLEMENTED).
        self.generate_stream = "off"
        self.script = Script()
        self.record = Record()
        self.port = port
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-engine", daemon=True)
        self._released: asyncio.Event | None = None
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> FakeEngine:
        self._thread.start()
        self._call(self._start())
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._call(self._server.stop(grace=None))
            self._server = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> FakeEngine:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def reset(self, script: Script | None = None) -> None:
        """New script, empty record, not held, SERVING."""
        self.script = script or Script()
        self.record = Record()
        self._call(self._reset_release())
        self.set_serving(True)

    def release(self) -> None:
        """Let held streams (Script.hold_after) continue."""
        self._loop.call_soon_threadsafe(self._released.set)  # type: ignore[union-attr]

    def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        self._call(self._health.set("", status))  # type: ignore[union-attr]

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=30)

    async def _start(self) -> None:
        self._released = asyncio.Event()
        self._server = grpc.aio.server(interceptors=[_CallRecorder(self)])
        engine_pb2_grpc.add_EngineServicer_to_server(_Servicer(self), self._server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self.port = self._server.add_insecure_port(f"127.0.0.1:{self.port}")
        for target in self.extra_listeners:
            self._server.add_insecure_port(target)
        await self._server.start()
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)

    async def _reset_release(self) -> None:
        self._released = asyncio.Event()

    async def wait_released(self) -> None:
        """Return once `release()` has been called (held streams wait here)."""
        await self._released.wait()  # type: ignore[union-attr]


def main() -> None:
    """`python -m tests.support.fake_engine --port N`: serve the default script until SIGTERM/SIGINT."""
    import argparse
    import signal

    parser = argparse.ArgumentParser(description="Conduit fake engine (instant tokens) for benchmarks")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="fake-model")
    parser.add_argument(
        "--generate-stream", choices=["off", "on"], default="off", help="serve GenerateStream"
    )
    args = parser.parse_args()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with FakeEngine(args.model, port=args.port) as fake:
        fake.generate_stream = args.generate_stream
        stop.wait()


if __name__ == "__main__":
    main()
