"""Both sides of a disaggregated request on in-process LLMEngines (no servers): run the prefill side, move
the blocks its pull plan asks for from the source runner into the destination runner (what a transport
does, through the same gather/scatter calls), end the pull and decode on; and the colocated reference."""

from __future__ import annotations

from conduit_engine.core.sequence import FinishReason
from conduit_engine.engine.request import GenerationRequest, RequestOutput
from conduit_engine.kv_transfer.params import KvConsume, KvFirstToken, KvHandleRef
from conduit_engine.kv_transfer.shm_segment import ShmSegment
from conduit_engine.kv_transfer.transport import KvPullResult
from tests.engine.support.harness import Collected, run_to_completion


def run(engine) -> dict[tuple[str, int], Collected]:
    """Step until idle (run_to_completion would insist on a cache without pins)."""
    results: dict[tuple[str, int], Collected] = {}
    while engine.has_work():
        for out in engine.step():
            collected = results.setdefault((out.request_id, out.index), Collected())
            collected.token_ids.extend(out.token_ids)
            collected.text += out.text
            collected.outputs.append(out)
    engine.check_integrity()
    return results


def produce(engine, rid: str, prompt: list[int], params) -> dict[int, RequestOutput]:
    engine.add_request(GenerationRequest(rid, params, token_ids=prompt, kv_produce=True))
    return {index: c.final for (_, index), c in run(engine).items()}


def consume_request(rid, prompt, params, firsts: dict[int, RequestOutput], layout) -> GenerationRequest:
    handed = [out for out in firsts.values() if out.finish_reason is FinishReason.KV_HANDOFF]
    transfer = handed[0].kv_transfer
    handle = KvHandleRef(transfer.transfer_id, "in-process", len(prompt), layout.fingerprint)
    first_tokens = tuple(KvFirstToken(out.index, out.token_ids[0]) for out in handed)
    return GenerationRequest(rid, params, token_ids=prompt, kv_consume=KvConsume(handle, first_tokens))


def transfer_blocks(source, destination, rid: str, via_shm: bool = False) -> KvPullResult:
    """What a transport does: the pull plan's blocks from the source's store into the destination's
    (`via_shm`: as the shm transport, gathered into a shared-memory segment and scattered from it)."""
    pending = destination.kv_consumer.pending(rid)
    spec = pending.spec
    transfer = source.kv_registry.start_pull(spec.transfer_id)
    ids = transfer.block_ids[spec.start_block :]
    if via_shm:
        segment = ShmSegment.create(len(ids) * spec.layout.block_bytes)
        try:
            source.executor.gather_kv_blocks_into(ids, segment.view)
            destination.executor.scatter_kv_blocks(pending.dest_block_ids, segment.view)
            size = segment.size
        finally:
            segment.close()
    else:
        data = source.executor.gather_kv_blocks(ids)
        destination.executor.scatter_kv_blocks(pending.dest_block_ids, data)
        size = len(data)
    source.kv_registry.finish_pull(spec.transfer_id, completed=True)
    return KvPullResult(spec.num_blocks, size)


def disaggregated(
    prefill, decode, rid, prompt, params, pull: bool = True, via_shm: bool = False
) -> dict[int, Collected]:
    """Run `rid` prefill → decode; per choice, what the client receives (prefill's message, then decode's)."""
    firsts = produce(prefill, rid, prompt, params)
    combined = {index: Collected([*out.token_ids], out.text, [out]) for index, out in firsts.items()}
    if any(out.finish_reason is FinishReason.KV_HANDOFF for out in firsts.values()):
        decode.add_request(consume_request(rid, prompt, params, firsts, decode.kv_layout))
        result = transfer_blocks(prefill, decode, rid, via_shm) if pull else None
        if not pull:
            prefill.kv_registry.release(decode.kv_consumer.pending(rid).spec.transfer_id)
        decode.finish_pull(rid, result)
        for (_, index), collected in run(decode).items():
            combined[index].token_ids += collected.token_ids
            combined[index].text += collected.text
            combined[index].outputs += collected.outputs
    return combined


def colocated_run(engine, rid, prompt, params) -> dict[int, Collected]:
    engine.add_request(GenerationRequest(rid, params, token_ids=prompt))
    return {index: c for (_, index), c in run_to_completion(engine).items()}


def assert_same(pd: dict[int, Collected], ref: dict[int, Collected]) -> None:
    assert sorted(pd) == sorted(ref)
    for index in ref:
        assert pd[index].token_ids == ref[index].token_ids, f"choice {index}"
        assert pd[index].text == ref[index].text, f"choice {index}"
        assert pd[index].final.finish_reason == ref[index].final.finish_reason
        assert pd[index].final.stop_string == ref[index].final.stop_string
