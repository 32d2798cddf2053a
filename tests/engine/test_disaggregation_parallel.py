"""Disaggregation across runners of different tensor-parallel sizes (stories260K, gloo on the CPU): a
prefill engine whose model runs in two worker processes hands its KV to an in-process decode engine, and
the other way round. Each KV shard lives in a worker; the runner assembles (or splits) the whole model's
payload, so both engines have one layout and the tokens equal a colocated engine's; as bytes (gRPC) and
through a shared-memory segment (the shm transport's gather into / scatter from the segment)."""

from __future__ import annotations

import pytest

from conduit_engine.sampling_params import SamplingParams
from tests.engine.support.harness import greedy, make_engine
from tests.engine.support.pd_harness import assert_same, colocated_run, disaggregated

# Makes KV segments in /dev/shm: one such module at a time (tests/conftest.py).
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("kv_shm_exclusive")]

PROMPT = [1, *range(300, 341)]  # 42 tokens: three blocks of 16


@pytest.fixture(scope="module")
def engines(stories_path):
    """{"colocated", "prefill" and "decode" in process; "prefill-tp2" and "decode-tp2" in workers}."""
    made = {}
    try:
        made["colocated"] = make_engine(stories_path)
        for role in ("prefill", "decode"):
            made[role] = make_engine(stories_path, role=role)
            made[f"{role}-tp2"] = make_engine(stories_path, role=role, tensor_parallel_size=2)
        yield made
    finally:
        for engine in made.values():
            engine.shutdown()


@pytest.mark.parametrize("via_shm", [False, True], ids=["bytes", "shm"])
@pytest.mark.parametrize(("prefill", "decode"), [("prefill-tp2", "decode"), ("prefill", "decode-tp2")])
def test_a_transfer_between_tensor_parallel_sizes_gives_the_colocated_tokens(
    engines, prefill, decode, via_shm
):
    assert engines[prefill].kv_layout == engines[decode].kv_layout
    for name, params in [
        ("greedy", greedy(20, ignore_eos=True)),
        ("seeded", SamplingParams(max_tokens=12, temperature=1.0, seed=5, n=2)),
    ]:
        pd = disaggregated(engines[prefill], engines[decode], name, PROMPT, params, via_shm=via_shm)
        assert_same(pd, colocated_run(engines["colocated"], name, PROMPT, params))
    for engine in (engines[prefill], engines[decode]):
        engine.check_integrity()
        assert engine.block_manager.stats().used == 0
