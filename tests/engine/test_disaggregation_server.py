"""The engine server's side of disaggregation on real grpc.aio servers in this process (stories260K):

- a draining prefill engine refuses new requests but still serves PullKv, and stops only once its
  transfers were pulled;
- a decode request cancelled while its pull hangs (a source that sends one chunk and then nothing) frees
  its blocks once the pull has stopped, and the engine passes its integrity check;
- a `both` engine can pull from itself (it is the prefill and the decode engine of one request).
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from conduit.engine.v1 import engine_pb2 as pb
from conduit.engine.v1 import engine_pb2_grpc as pb_grpc
from conduit_engine.config import CacheConfig, DisaggregationConfig, EngineConfig, ModelConfig, ServerConfig
from tests.engine.support.server_thread import ServerThread
from tests.support.polling import wait_for
from tests.support.stories import PROMPT_IDS

pytestmark = pytest.mark.integration

PROMPT = [1, *range(60, 99)]  # 40 tokens: 3 blocks
GREEDY = pb.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def server(stories_path, role: str) -> ServerThread:
    config = EngineConfig(
        model=ModelConfig(path=str(stories_path)),
        cache=CacheConfig(num_blocks=64),
        server=ServerConfig(host="127.0.0.1", port=0, drain_seconds=30),
        disaggregation=DisaggregationConfig(role=role),
    )
    return ServerThread(config).start()


def load(stub) -> pb.GetLoadResponse:
    return stub.GetLoad(pb.GetLoadRequest(), timeout=10)


def produce(stub, prompt=PROMPT) -> pb.GenerateResponse:
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        sampling=GREEDY,
        kv_transfer=pb.KvTransferParams(produce=pb.KvProduce()),
    )
    (message,) = stub.Generate(request, timeout=60)
    assert message.finish_reason == pb.FINISH_REASON_KV_HANDOFF
    return message


def consume_request(first: pb.GenerateResponse, prompt=PROMPT) -> pb.GenerateRequest:
    consume = pb.KvConsume(
        handle=first.kv_handle, first_tokens=[pb.KvFirstToken(index=0, token_id=first.token_ids[0])]
    )
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt), sampling=GREEDY, kv_transfer=pb.KvTransferParams(consume=consume)
    )


def colocated_tokens(stub, prompt=PROMPT) -> list[int]:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=GREEDY)
    return [token for message in stub.Generate(request, timeout=60) for token in message.token_ids]


def test_a_draining_prefill_engine_serves_pulls_until_its_transfers_are_taken(stories_path):
    prefill, decode = server(stories_path, "prefill"), server(stories_path, "decode")
    try:
        first = produce(prefill.stub())
        stopped = threading.Thread(target=prefill.stop)
        stopped.start()
        wait_for(lambda: prefill.server.async_engine.draining, "the drain")
        with pytest.raises(grpc.RpcError) as refused:
            produce(prefill.stub(), [1, 5, 6])
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert stopped.is_alive()  # waiting for the pending transfer
        tokens = [t for m in decode.stub().Generate(consume_request(first), timeout=60) for t in m.token_ids]
        stopped.join(timeout=30)
        assert not stopped.is_alive()
        assert first.token_ids[:] + tokens == colocated_tokens(decode.stub())
        assert load(decode.stub()).kv_bytes_pulled > 0
    finally:
        decode.stop()
        if prefill.server is not None and stopped.is_alive():
            stopped.join(timeout=60)


class HangingSource(pb_grpc.EngineServicer):
    """Fault injection: a source that sends the first block of a pull and then nothing more. `hanging` is
    set once the first block has gone out; `cancelled` when the pull is cancelled, wherever it was."""

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.hanging = threading.Event()
        self.cancelled = threading.Event()

    async def PullKv(self, request, context):
        try:
            yield pb.KvChunk(first_block=0, num_blocks=1, total_blocks=3, data=bytes(self.block_bytes))
            self.hanging.set()
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


def test_a_decode_request_cancelled_during_its_pull_frees_its_blocks(stories_path):
    decode = server(stories_path, "decode")
    info = decode.stub().GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    block_bytes = 2 * 5 * 16 * 4 * 8 * 4
    hanging = HangingSource(block_bytes)

    async def start_source() -> tuple[grpc.aio.Server, int]:
        source = grpc.aio.server()
        pb_grpc.add_EngineServicer_to_server(hanging, source)
        port = source.add_insecure_port("127.0.0.1:0")
        await source.start()
        return source, port

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    source, port = asyncio.run_coroutine_threadsafe(start_source(), loop).result(10)
    try:
        address = f"127.0.0.1:{port}"
        handle = pb.KvHandle(transfer_id="t", source_address=address, num_tokens=40, layout=info.kv_layout)
        first = pb.GenerateResponse(token_ids=[400], kv_handle=handle)
        call = decode.stub().Generate(consume_request(first), timeout=60)
        wait_for(lambda: load(decode.stub()).kv_blocks_used == 3, "the pull's blocks")
        assert hanging.hanging.wait(10)  # cancelled mid-pull, not before the source began
        call.cancel()
        wait_for(lambda: load(decode.stub()).kv_blocks_used == 0, "the blocks to be freed after the pull")
        assert hanging.cancelled.wait(10)  # the source saw the pull stop
        decode.check_integrity()
        assert load(decode.stub()).kv_bytes_pulled == 0
    finally:
        asyncio.run_coroutine_threadsafe(source.stop(None), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        decode.stop()


def test_a_both_engine_pulls_from_itself(stories_path):
    both = server(stories_path, "both")
    try:
        stub = both.stub()
        prompt = [1, *PROMPT_IDS[1:], *range(100, 130)]
        first = produce(stub, prompt)
        tokens = [t for m in stub.Generate(consume_request(first, prompt), timeout=60) for t in m.token_ids]
        assert first.token_ids[:] + tokens == colocated_tokens(stub, prompt)
        reply = load(stub)
        # Its own full blocks were prefix-cache hits: only the last, partial block came over PullKv.
        block_bytes = 2 * 5 * 16 * 4 * 8 * 4  # K and V of 5 layers, 16 tokens, 4 KV heads of 8, float32
        assert (reply.kv_bytes_pulled, reply.kv_bytes_saved) == (block_bytes, 2 * block_bytes)
        assert (reply.kv_blocks_used, reply.kv_transfers_pending) == (0, 0)
        both.check_integrity()
    finally:
        both.stop()
