"""The cheap fake engine of the gateway benches: a gRPC Engine that answers Generate and GenerateStream
with pre-serialised GenerateResponse messages (one token each, text WORD), every stream getting its next
token at each tick of a ticker shared by all streams of the same rate (a decode step); the request's
`seed` is the tick in ms, so one engine serves every rate. A token costs it about a microsecond.

    .venv/bin/python bench/stream_fake_engine.py --port PORT [--sse-port PORT]

With --sse-port it also serves the same streams as SSE itself (`DirectSse`), without any gateway: what a
minimal SSE server leaves of a client's ITL (bench/gateway_throughput.py --direct).
"""

from __future__ import annotations

import argparse
import asyncio
import json

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from conduit.engine.v1 import engine_pb2

WORD = "§"


def run_engine(port: int, sse_port: int = 0) -> None:
    """Serve until killed: gRPC on `port`, and SSE on `sse_port` when not 0."""
    prebuilt: dict[tuple[int, int], list[bytes]] = {}

    def messages(max_tokens: int, top: int) -> list[bytes]:
        """Serialised messages of one stream, without request_id (prepended per stream)."""
        key = (max_tokens, top)
        if key not in prebuilt:
            out = []
            for step in range(max_tokens):
                last = step == max_tokens - 1
                message = engine_pb2.GenerateResponse(
                    index=0,
                    text=WORD,
                    token_ids=[100 + step % 100],
                    usage=engine_pb2.Usage(prompt_tokens=4, completion_tokens=step + 1),
                    finished=last,
                    finish_reason=engine_pb2.FINISH_REASON_LENGTH if last else 0,
                )
                if step == 0:
                    message.prompt_token_ids.extend([1, 2, 3, 4])
                if top >= 0:
                    chosen = engine_pb2.TokenLogprob(token_id=100, text=WORD, logprob=-0.25, rank=1)
                    others = [
                        engine_pb2.TokenLogprob(token_id=100 + k, text=f"a{k}", logprob=-1.5 * k, rank=k + 1)
                        for k in range(1, top + 1)
                    ]
                    message.logprobs.append(engine_pb2.PositionLogprobs(token=chosen, top=others))
                out.append(message.SerializeToString())
            prebuilt[key] = out
        return prebuilt[key]

    class Ticker:
        def __init__(self, interval_s: float) -> None:
            self.interval_s = interval_s
            self.tick: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.task = asyncio.create_task(self.run())

        async def run(self) -> None:
            loop = asyncio.get_running_loop()
            next_at = loop.time()
            while True:
                next_at += self.interval_s
                await asyncio.sleep(max(0.0, next_at - loop.time()))
                tick, self.tick = self.tick, loop.create_future()
                tick.set_result(None)

    tickers: dict[int, Ticker] = {}

    async def generate(request, context):
        sampling = request.sampling
        max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else 16
        top = sampling.logprobs if sampling.HasField("logprobs") else -1
        step_ms = sampling.seed if sampling.HasField("seed") and sampling.seed > 0 else 10
        ticker = tickers.get(step_ms) or tickers.setdefault(step_ms, Ticker(step_ms / 1000))
        head = engine_pb2.GenerateResponse(request_id=request.request_id).SerializeToString()
        for body in messages(max_tokens, top):
            await ticker.tick
            await context.write(head + body)

    def varint(value: int) -> bytes:
        out = bytearray()
        while value > 0x7F:
            out.append(value & 0x7F | 0x80)
            value >>= 7
        out.append(value)
        return bytes(out)

    async def generate_stream(request_iterator, context):
        """GenerateStream as the engine serves it: at each tick the next message of every stream open on
        it goes into an outbox (written by hand from the pre-serialised messages: GenerateStreamBatch
        fields 1 and 2), and the writer sends all the outbox holds as one batch; while the gateway reads
        slower than that, the outbox holds several ticks and a batch carries them all."""
        open_streams: dict[int, list] = {}  # tag -> [tag bytes, request_id head, bodies, next index]
        opened, filled = asyncio.Event(), asyncio.Event()
        outbox: list[bytes] = []
        step = [10]

        def apply(action) -> None:
            if action.WhichOneof("action") == "batch":
                for each in action.batch.actions:
                    apply(each)
            elif action.WhichOneof("action") == "open":
                request = action.open.request
                sampling = request.sampling
                max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else 16
                top = sampling.logprobs if sampling.HasField("logprobs") else -1
                if sampling.HasField("seed") and sampling.seed > 0:
                    step[0] = sampling.seed
                head = engine_pb2.GenerateResponse(request_id=request.request_id).SerializeToString()
                tag = b"\x08" + varint(action.open.tag)
                open_streams[action.open.tag] = [tag, head, messages(max_tokens, top), 0]
                opened.set()
            else:
                open_streams.pop(action.cancel, None)

        async def read() -> None:
            async for action in request_iterator:
                apply(action)

        async def produce() -> None:
            while True:
                if not open_streams:
                    opened.clear()
                    await opened.wait()
                ticker = tickers.get(step[0]) or tickers.setdefault(step[0], Ticker(step[0] / 1000))
                await ticker.tick
                for key, stream in list(open_streams.items()):
                    tag, head, bodies, at = stream
                    body = head + bodies[at]
                    item = tag + b"\x12" + varint(len(body)) + body
                    outbox.append(b"\x0a" + varint(len(item)) + item)
                    stream[3] = at + 1
                    if at + 1 == len(bodies):
                        del open_streams[key]
                        outbox.append(b"\x12" + varint(len(tag)) + tag)
                filled.set()

        await context.send_initial_metadata(())  # the stream is taken: the gateway may write
        tasks = [asyncio.create_task(read()), asyncio.create_task(produce())]
        try:
            while True:
                await filled.wait()
                filled.clear()
                batch = b"".join(outbox)
                outbox.clear()
                yield batch
        finally:
            for task in tasks:
                task.cancel()

    async def model_info(request, context):
        return engine_pb2.GetModelInfoResponse(
            model="fake-model",
            architecture="FakeForCausalLM",
            vocab_size=512,
            max_model_len=100000,
            dtype="float32",
            device="cpu",
            block_size=16,
            num_kv_blocks=100000,
            max_num_seqs=4096,
            eos_token_ids=[2],
            has_chat_template=True,
            generate_stream=True,
            generate_stream_batch_bytes=4 * 1024 * 1024,  # gRPC's default largest message
        )

    async def get_load(request, context):
        return engine_pb2.GetLoadResponse(kv_blocks_total=100000)

    async def abort(request, context):
        return engine_pb2.AbortResponse(aborted=False)

    def unary(fn, request_type, response_type):
        return grpc.unary_unary_rpc_method_handler(
            fn,
            request_deserializer=request_type.FromString,
            response_serializer=response_type.SerializeToString,
        )

    handlers = {
        # Responses go out as the bytes they were built as (no serialiser).
        "Generate": grpc.unary_stream_rpc_method_handler(
            generate, request_deserializer=engine_pb2.GenerateRequest.FromString
        ),
        "GenerateStream": grpc.stream_stream_rpc_method_handler(
            generate_stream, request_deserializer=engine_pb2.GenerateStreamRequest.FromString
        ),
        "GetModelInfo": unary(model_info, engine_pb2.GetModelInfoRequest, engine_pb2.GetModelInfoResponse),
        "GetLoad": unary(get_load, engine_pb2.GetLoadRequest, engine_pb2.GetLoadResponse),
        "Abort": unary(abort, engine_pb2.AbortRequest, engine_pb2.AbortResponse),
    }

    class DirectSse(asyncio.Protocol):
        """`--direct`: one request per connection, answered by the engine's process itself with the
        events a plain stream of the gateway writes (same shape and size), one per tick of the same
        ticker: the floor a minimal SSE server sets on the client's ITL, without any gateway."""

        def connection_made(self, transport) -> None:
            self.transport, self.buf, self.task = transport, b"", None

        def data_received(self, data: bytes) -> None:
            self.buf += data
            end = self.buf.find(b"\r\n\r\n")
            if end < 0 or self.task is not None:
                return
            length = next(
                int(line.split(b":", 1)[1])
                for line in self.buf[:end].split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            if len(self.buf) >= end + 4 + length:
                self.task = asyncio.ensure_future(
                    self.stream(json.loads(self.buf[end + 4 : end + 4 + length]))
                )

        def connection_lost(self, exc) -> None:
            if self.task is not None:
                self.task.cancel()

        async def stream(self, body: dict) -> None:
            step_ms = body.get("seed") or 10
            ticker = tickers.get(step_ms) or tickers.setdefault(step_ms, Ticker(step_ms / 1000))
            chat = "messages" in body
            head = (
                '{"id":"chatcmpl-direct0000000000000000000000","object":"chat.completion.chunk","created":1,'
                if chat
                else '{"id":"cmpl-direct0000000000000000000000","object":"text_completion","created":1,'
            ) + '"model":"fake-model","system_fingerprint":null,"choices":[{"index":0,'

            def event(choice: str) -> bytes:
                data = f"data: {head}{choice}}}]}}\n\n".encode()
                return b"%x\r\n%b\r\n" % (len(data), data)

            word = json.dumps(WORD, ensure_ascii=False)
            if chat:
                first = event(
                    '"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null'
                )
                token = event(f'"delta":{{"content":{word}}},"logprobs":null,"finish_reason":null')
                last = event('"delta":{},"logprobs":null,"finish_reason":"length"')
            else:
                first = b""
                token = event(f'"text":{word},"logprobs":null,"finish_reason":null')
                last = event('"text":"","logprobs":null,"finish_reason":"length"')
            write = self.transport.write
            write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
                b"connection: close\r\n\r\n" + first
            )
            for _ in range(body["max_tokens"]):
                await ticker.tick
                write(token)
            write(last + b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
            self.transport.close()

    async def serve() -> None:
        if sse_port:
            await asyncio.get_running_loop().create_server(DirectSse, "127.0.0.1", sse_port)
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("conduit.engine.v1.Engine", handlers),)
        )
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        await server.wait_for_termination()

    asyncio.run(serve())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--sse-port", type=int, default=0)
    args = parser.parse_args()
    run_engine(args.port, args.sse_port)


if __name__ == "__main__":
    main()
