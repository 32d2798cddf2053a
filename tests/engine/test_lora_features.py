"""LoRA adapters with the rest of the engine on stories260K (in process): both sides of a disaggregated
request name the adapter and continue exactly as one colocated engine running it; a handle of another
adapter is refused; grammars, seeded sampling, logprobs and decode bursts hold under an adapter."""

from __future__ import annotations

import re

import pytest

from conduit_engine.config import LoraConfig
from conduit_engine.core.sequence import FinishReason
from conduit_engine.engine.request import GenerationRequest
from conduit_engine.errors import InvalidRequestError
from conduit_engine.kv_transfer.params import KvConsume, KvFirstToken, KvHandleRef
from conduit_engine.sampling_params import SamplingParams
from conduit_engine.structured.spec import StructuredKind, StructuredSpec
from tests.engine.support.harness import greedy, make_engine, run_to_completion
from tests.engine.support.lora_factory import load_merged, make_adapter
from tests.engine.support.model_factory import greedy_with
from tests.engine.support.pd_harness import run, transfer_blocks
from tests.support.stories import PROMPT_IDS

pytestmark = pytest.mark.unit

PROMPT = [1, *range(40, 90)]  # several blocks of 16


@pytest.fixture(scope="module")
def adapters(stories_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a1": make_adapter(stories_path, root / "a1", r=8, seed=1, magnitude=1.0),
        "a2": make_adapter(stories_path, root / "a2", r=4, seed=2, magnitude=1.0),
    }


def lora(adapters) -> LoraConfig:
    return LoraConfig(
        enable_lora=True, lora_modules=tuple((n, str(p)) for n, p in adapters.items()), max_loras=2
    )


@pytest.fixture(scope="module")
def engines(stories_path, adapters):
    config = lora(adapters)
    return (
        make_engine(stories_path, lora=config),
        make_engine(stories_path, role="prefill", lora=config),
        make_engine(stories_path, role="decode", lora=config),
    )


def consume(rid, prompt, params, firsts, layout, lora_name):
    (handed,) = [out for out in firsts.values() if out.finish_reason is FinishReason.KV_HANDOFF]
    transfer = handed.kv_transfer
    assert transfer.lora_name == lora_name  # the transfer names its adapter
    handle = KvHandleRef(
        transfer.transfer_id, "in-process", len(prompt), layout.fingerprint, lora_name=transfer.lora_name
    )
    first = (KvFirstToken(handed.index, handed.token_ids[0]),)
    return GenerationRequest(
        rid, params, token_ids=prompt, kv_consume=KvConsume(handle, first), lora=lora_name
    )


def test_a_disaggregated_adapter_request_continues_as_colocated(stories_path, adapters, engines):
    colocated, prefill, decode = engines
    params = greedy(24, ignore_eos=True)
    for rid, adapter in (("pd-a1", "a1"), ("pd-base", None)):
        prefill.add_request(GenerationRequest(rid, params, token_ids=PROMPT, kv_produce=True, lora=adapter))
        firsts = {index: c.final for (_, index), c in run(prefill).items()}
        decode.add_request(consume(rid, PROMPT, params, firsts, decode.kv_layout, adapter))
        decode.finish_pull(rid, transfer_blocks(prefill, decode, rid))
        pd = {index: c for (_, index), c in run(decode).items()}
        pd[0].token_ids[:0] = firsts[0].token_ids
        colocated.add_request(GenerationRequest(rid, params, token_ids=PROMPT, lora=adapter))
        ref = {index: c for (_, index), c in run_to_completion(colocated).items()}
        assert pd[0].token_ids == ref[0].token_ids, rid
    expected = greedy_with(load_merged(stories_path, adapters["a1"]), PROMPT, 24)
    assert ref[0].token_ids != expected  # the last one ran the base model
    colocated.add_request(GenerationRequest("check", params, token_ids=PROMPT, lora="a1"))
    assert run_to_completion(colocated)[("check", 0)].token_ids == expected
    for engine in engines:
        engine.check_integrity()
        assert engine.block_manager.stats().used == 0


def test_a_handle_of_another_adapter_is_refused(engines):
    _, prefill, decode = engines
    params = greedy(4, ignore_eos=True)
    prefill.add_request(GenerationRequest("x", params, token_ids=PROMPT, kv_produce=True, lora="a1"))
    firsts = {index: c.final for (_, index), c in run(prefill).items()}
    request = consume("x", PROMPT, params, firsts, decode.kv_layout, "a1")
    for wrong in ("a2", None):
        request.lora = wrong
        with pytest.raises(InvalidRequestError) as err:
            decode.add_request(request)
        assert err.value.field == "kv_transfer.consume.handle.lora_name"
        assert "computed with LoRA adapter 'a1'" in str(err.value)
    prefill.kv_registry.release(firsts[0].kv_transfer.transfer_id)
    prefill.check_integrity()
    assert prefill.block_manager.stats().used == 0


def test_grammars_seeds_logprobs_and_bursts_under_an_adapter(stories_path, adapters):
    engine = make_engine(stories_path, lora=lora(adapters), max_decode_steps=8, decode_burst_ms=1000.0)
    regex = r"(Once|Then) [a-z]+ [a-z]+\."
    structured = SamplingParams(
        max_tokens=40, temperature=0.0, structured=StructuredSpec(StructuredKind.REGEX, text=regex)
    )
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=5, logprobs=2, ignore_eos=True)
    jobs = {
        "g1": ("a1", structured),
        "s1": ("a2", seeded),
        "s2": ("a2", seeded),
        "b": ("a1", greedy(40, ignore_eos=True)),
    }
    passes = []
    execute = engine.executor.execute

    def recording(out):
        passes.append(out.num_passes)
        return execute(out)

    engine.executor.execute = recording
    for rid, (adapter, params) in jobs.items():
        engine.add_request(GenerationRequest(rid, params, token_ids=list(PROMPT_IDS), lora=adapter))
    results = run_to_completion(engine)
    assert re.fullmatch(regex, results[("g1", 0)].text), results[("g1", 0)].text
    assert results[("s1", 0)].token_ids == results[("s2", 0)].token_ids  # same seed, same adapter
    logprobs = [lp for o in results[("s1", 0)].outputs for lp in o.logprobs]
    assert len(logprobs) == 16 and all(len(lp.top_ids) == 2 for lp in logprobs)
    assert max(passes) > 1  # decode bursts ran with the adapters' rows
    merged = greedy_with(load_merged(stories_path, adapters["a1"]), list(PROMPT_IDS), 40)
    assert results[("b", 0)].token_ids == merged
