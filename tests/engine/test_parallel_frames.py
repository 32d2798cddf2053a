"""The frames between the engine and its workers, without processes: the wire format round-trips every
array type; a step (batch, sampling plan, grammar bitmask) and rank 0's answer come back exactly; and
sampling from a decoded plan gives the tokens and logprobs of sampling from the requests themselves."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conduit_engine.sampling.grammar_mask import StepBitmask
from conduit_engine.sampling.logprobs import TokenLogprobs
from conduit_engine.sampling.metadata import build_sampling_metadata, metadata_from_plan
from conduit_engine.sampling.plan import SamplingRow, plan_sampling
from conduit_engine.sampling.sampler import Sampler
from conduit_engine.sampling_params import SamplingParams
from conduit_engine.worker.step_codec import (
    RankTimings,
    decode_result,
    decode_step,
    encode_result,
    encode_step,
)
from conduit_engine.worker.step_inputs import PromptSpan, StepBatch, StepOutput
from conduit_engine.worker.wire import Kind, as_array, control, decode, encode

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")


def rows() -> list[SamplingRow]:
    return [
        SamplingRow(SamplingParams(temperature=0.0, logprobs=2), [1, 5], [7], None),
        SamplingRow(SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=11), [1, 6], [8, 9], 11),
        SamplingRow(SamplingParams(temperature=1.0, min_p=0.05), [1], [], None),
        SamplingRow(
            SamplingParams(
                temperature=0.7,
                repetition_penalty=1.3,
                presence_penalty=0.5,
                frequency_penalty=0.25,
                logit_bias={3: 2.5, 40: -1.0},
                min_tokens=3,
                seed=5,
            ),
            [1, 3, 3, 4],
            [40, 40],
            5,
            (2,),
        ),
    ]


def test_the_wire_round_trips_every_array_type():
    data = encode(
        Kind.STEP,
        (7, -3, 2**40),
        [
            as_array("i", [1, -2, 2**31 - 1]),
            as_array("q", [2**62]),
            as_array("d", [0.1, math.nan]),
            ("f", np.array([1.5], dtype=np.float32)),
            ("B", b"abc"),
            as_array("i", []),
        ],
    )
    frame = decode(bytearray(data))
    assert frame.kind is Kind.STEP and frame.ints == (7, -3, 2**40)
    i32, i64, f64, f32, raw, empty = frame.arrays
    assert i32.tolist() == [1, -2, 2**31 - 1] and i64.tolist() == [2**62]
    assert f64[0] == 0.1 and math.isnan(f64[1]) and f32.tolist() == [1.5]
    assert raw.tobytes() == b"abc" and empty.size == 0
    assert decode(bytearray(control(Kind.ERROR, {"error": "x"}))).json() == {"error": "x"}
    with pytest.raises(ValueError, match="not a worker frame"):
        decode(bytearray(b"\0" * 16))


def test_a_step_and_its_answer_come_back_exactly():
    plan = plan_sampling(rows())
    batch = StepBatch(
        input_ids=[5, 6, 7, 9],
        positions=[0, 1, 2, 40],
        slot_mapping=[64, 65, 66, 8],
        query_lens=[3, 1],
        seq_lens=[3, 41],
        block_tables=[4, 0, 0, -1, 0, 2],
        table_width=3,
        logits_rows=[2, 3],
        prompt_spans=[PromptSpan(0, 0, 2, [6, 7])],
        sampling=plan,
    )
    bits = torch.tensor([[0x0F, -1], [5, 0]], dtype=torch.int32)
    mask = StepBitmask(bitmask=bits, rows=torch.tensor([3, 1]))
    decoded, decoded_mask = decode_step(decode(bytearray(encode_step(batch, mask))), CPU)
    for name in (
        "input_ids",
        "positions",
        "slot_mapping",
        "query_lens",
        "seq_lens",
        "block_tables",
        "logits_rows",
    ):
        assert list(getattr(decoded, name)) == getattr(batch, name), name
    assert decoded.table_width == 3 and decoded.prompt_spans == batch.prompt_spans
    for name in plan.__dataclass_fields__:
        got, want = getattr(decoded.sampling, name), getattr(plan, name)
        assert got == want or all(map(lambda a, b: a == b or (math.isnan(a) and math.isnan(b)), got, want)), (
            name
        )
    assert decoded_mask is not None
    assert torch.equal(decoded_mask.bitmask, bits) and decoded_mask.rows.tolist() == [3, 1]
    plain, none_mask = decode_step(
        decode(bytearray(encode_step(StepBatch([1], [0], [0], [1], [1], [0], 1, []), None))), CPU
    )
    assert plain.sampling is None and none_mask is None and plain.prompt_spans == []

    out = StepOutput(
        token_ids=[17, 3],
        logprobs=[None, TokenLogprobs(3, -0.125, 2, [9, 3], [-0.0625, -0.125])],
        prompt_logprobs=[[TokenLogprobs(6, -1.5, 4, [1], [-0.5]), TokenLogprobs(7, -2.0, 1, [], [])], []],
    )
    back, timings = decode_result(decode(bytearray(encode_result(out, RankTimings(12, 345)))))
    assert back == out and timings == RankTimings(12, 345)


def test_sampling_a_decoded_plan_equals_sampling_the_requests():
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(3)) * 3
    batch = StepBatch([1], [0], [0], [1], [1], [0], 1, [0, 0, 0, 0], sampling=plan_sampling(rows()))
    decoded, _ = decode_step(decode(bytearray(encode_step(batch, None))), CPU)
    direct = Sampler(seed=1)(logits, build_sampling_metadata(rows(), 64, CPU))
    via_frames = Sampler(seed=1)(logits, metadata_from_plan(decoded.sampling, 64, CPU))
    assert via_frames == direct
