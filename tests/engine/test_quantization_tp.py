"""Int8 weights under tensor parallelism (two worker processes): quantized at load (each rank quantizes
its own shard) and from a compressed-tensors checkpoint (each rank reads its weight rows and the scales
that go with them, models/sharding.py), stories260K greedy continuations equal the unsharded int8 engine's."""

from __future__ import annotations

import pytest

from tests.engine.support.harness import generate, greedy, make_engine
from tests.engine.test_quantization import write_compressed

pytestmark = pytest.mark.integration

PROMPT = [1, 403, 407, 261, 378]


def _greedy(folder, tp: int, quantization: str) -> list[int]:
    engine = make_engine(folder, tensor_parallel_size=tp, quantization=quantization)
    try:
        return generate(engine, {"a": PROMPT}, greedy(24))["a"].token_ids
    finally:
        engine.shutdown()


def test_quantized_at_load_tp2_matches_tp1(stories_path):
    assert _greedy(stories_path, 2, "int8") == _greedy(stories_path, 1, "int8")


def test_compressed_tensors_tp2_matches_tp1(stories_path, tmp_path):
    folder = write_compressed(stories_path, tmp_path / "w8a8")
    assert _greedy(folder, 2, "none") == _greedy(folder, 1, "none")
