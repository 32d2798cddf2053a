"""`--kv-cache-dtype int8 | fp8` on the real engine (stories260K): the flag and its errors, the cache it
sizes (about twice the tokens of bfloat16 in the same bytes), prefix caching and disaggregation over
quantized blocks (scales travel with them; engines of different KV dtypes never pair), and what
GetModelInfo and /metrics say about the cache."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from conduit.engine.v1 import engine_pb2 as pb
from conduit_engine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
    TelemetryConfig,
)
from conduit_engine.entrypoints.cli import build_parser, config_from_args, main
from conduit_engine.kv_transfer.errors import KvLayoutMismatchError
from conduit_engine.models.architectures import read_arch_config
from conduit_engine.worker.kv_cache import host_kv_budget, kv_block_bytes, size_kv_cache
from tests.engine.support.harness import generate, greedy, make_engine, run_to_completion
from tests.engine.support.pd_harness import (
    assert_same,
    colocated_run,
    consume_request,
    disaggregated,
    produce,
)
from tests.engine.support.server_thread import ServerThread
from tests.engine.test_prefix_preemption_parity import submit
from tests.support.prometheus import scrape

pytestmark = pytest.mark.integration

KV_DTYPES = ("int8", "fp8")
ELEMENTS = {"int8": "int8", "fp8": "fp8_e4m3"}


def test_an_unknown_kv_cache_dtype_is_a_cli_error_naming_the_flag(capsys):
    args = build_parser({}).parse_args(["--model", "m", "--kv-cache-dtype", "int4"])
    with pytest.raises(ValueError, match=r"--kv-cache-dtype must be one of auto, int8, fp8, got 'int4'"):
        config_from_args(args)
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "m", "--kv-cache-dtype", "fp16"])
    assert exit_info.value.code == 2
    assert "--kv-cache-dtype must be one of auto, int8, fp8, got 'fp16'" in capsys.readouterr().err


def test_quantized_blocks_hold_about_twice_the_tokens_of_bfloat16(stories_path):
    arch = read_arch_config(stories_path)
    bf16 = kv_block_bytes(arch, 16, "bfloat16")
    for kv in KV_DTYPES:
        quantized = kv_block_bytes(arch, 16, "float32", kv)  # whatever the compute dtype
        assert quantized == 2 * arch.num_layers * 16 * arch.num_kv_heads * (arch.head_dim + 2)
        # head_dim + 2 scale bytes against 2 * head_dim: 1.6x at stories260K's head_dim 8
        assert bf16 / quantized == pytest.approx(1.6)
    for head_dim, ratio in ((64, 1.93), (128, 1.96)):
        wide = dataclasses.replace(arch, head_dim=head_dim)
        assert kv_block_bytes(wide, 16, "bfloat16") / kv_block_bytes(wide, 16, "bfloat16", "int8") > ratio
    # The cache sized from a memory budget takes that many more blocks.
    cache = CacheConfig(memory_fraction=1e-4)
    sized = {}
    for dtype, kv in (("bfloat16", "auto"), ("float32", "int8"), ("float32", "fp8")):
        config = EngineConfig(
            model=ModelConfig(path=str(stories_path)),
            cache=dataclasses.replace(cache, kv_cache_dtype=kv),
            scheduler=SchedulerConfig(max_num_seqs=256),
        )
        facts = SimpleNamespace(dtype=dtype, max_model_len=512)
        sized[kv] = size_kv_cache(config, facts, arch, 1, [None])  # type: ignore[arg-type]
        assert sized[kv] == host_kv_budget(config) // kv_block_bytes(arch, 16, dtype, kv)
    assert sized["int8"] == sized["fp8"] and sized["int8"] / sized["auto"] == pytest.approx(1.6, rel=0.02)


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_prefix_cache_hits_on_quantized_blocks_give_the_same_tokens(stories_path, kv):
    """Shared prefixes, chunked prefill over small blocks and forced preemption: the tokens equal those of
    the same requests run one at a time without a prefix cache (both quantized)."""
    prompts = {f"r{i}": [1, *range(300, 313), *range(40 + 7 * i, 44 + 11 * i)] for i in range(4)}
    alone = {}
    for rid, ids in prompts.items():
        engine = make_engine(stories_path, kv_cache_dtype=kv, enable_prefix_caching=False, block_size=4)
        alone[rid] = generate(engine, {rid: ids}, greedy(24, ignore_eos=True))[rid].token_ids
    shared = make_engine(
        stories_path, kv_cache_dtype=kv, block_size=4, num_blocks=16, max_num_batched_tokens=7
    )
    seqs = submit(shared, prompts, 24)
    results = run_to_completion(shared)
    assert sum(s.num_preemptions for s in seqs) >= 1
    assert sum(results[(rid, 0)].final.usage.cached_tokens for rid in prompts) > 0
    for rid in prompts:
        assert results[(rid, 0)].token_ids == alone[rid], rid
    shared.check_integrity()


@pytest.fixture(scope="module", params=KV_DTYPES)
def quantized_pair(request, stories_path):
    kv = request.param
    return (
        kv,
        make_engine(stories_path, kv_cache_dtype=kv),
        make_engine(stories_path, kv_cache_dtype=kv, role="prefill"),
        make_engine(stories_path, kv_cache_dtype=kv, role="decode"),
    )


def test_quantized_blocks_move_with_their_scales(quantized_pair):
    """Prefill on one int8 (fp8) engine, decode on another: the same tokens as one colocated engine of the
    same KV dtype, so the pulled codes and scales are the ones the prefill wrote."""
    kv, colocated, prefill, decode = quantized_pair
    assert prefill.kv_layout.dtype == decode.kv_layout.dtype == ELEMENTS[kv]
    prompt = [1, *range(40, 90)]
    params = greedy(24, ignore_eos=True)
    assert_same(
        disaggregated(prefill, decode, "q", prompt, params), colocated_run(colocated, "q", prompt, params)
    )
    for engine in (colocated, prefill, decode):
        engine.check_integrity()


def test_engines_of_different_kv_dtypes_never_pair(stories_path, quantized_pair):
    kv, _, prefill, decode = quantized_pair
    plain = make_engine(stories_path, role="decode")
    other = make_engine(stories_path, role="decode", kv_cache_dtype="fp8" if kv == "int8" else "int8")
    prompt = [1, *range(300, 320)]
    params = greedy(8)
    firsts = produce(prefill, "x", prompt, params)
    for engine in (plain, other):
        assert engine.kv_layout.fingerprint != prefill.kv_layout.fingerprint
        request = consume_request("x", prompt, params, firsts, prefill.kv_layout)
        with pytest.raises(KvLayoutMismatchError, match="layout.fingerprint: .* differs from this engine's"):
            engine.add_request(request)
        assert engine.block_manager.stats().used == 0
    transfer = next(out for out in firsts.values() if out.kv_transfer is not None).kv_transfer
    assert prefill.kv_registry.release(transfer.transfer_id)
    assert decode.block_manager.stats().used == 0


def test_model_info_and_metrics_show_the_kv_dtype_and_capacity(stories_path):
    config = EngineConfig(
        model=ModelConfig(path=str(stories_path)),
        cache=CacheConfig(num_blocks=40, kv_cache_dtype="fp8"),
        scheduler=SchedulerConfig(max_num_seqs=4),
        server=ServerConfig(host="127.0.0.1", port=0, drain_seconds=5),
        telemetry=TelemetryConfig(metrics_port=0, metrics_vllm_compat=True),
    )
    thread = ServerThread(config).start()
    try:
        info = thread.stub().GetModelInfo(pb.GetModelInfoRequest())
        block_bytes = 2 * 5 * 16 * 4 * (8 + 2)
        assert info.dtype == "float32" and info.kv_cache_dtype == "fp8_e4m3"
        assert info.kv_layout.dtype == "fp8_e4m3"
        assert info.kv_cache_tokens == 40 * 16 and info.kv_block_bytes == block_bytes
        metrics = scrape(thread.metrics_url)
        assert (
            metrics.value("conduit_engine_kv_cache_info", dtype="fp8_e4m3", block_bytes=str(block_bytes)) == 1
        )
        assert metrics.value("conduit_engine_kv_cache_capacity_tokens") == 640
        assert metrics.value("conduit_engine_kv_cache_bytes") == 40 * block_bytes
        assert metrics.value("vllm:cache_config_info", cache_dtype="fp8") == 1
    finally:
        thread.stop()


def test_tensor_parallel_workers_shard_the_quantized_cache_by_heads(stories_path):
    """Two worker processes, each holding two of the four KV heads (codes and scales): the tokens of one
    in-process engine on the same KV dtype."""
    prompts = {"a": [1, *range(40, 70)], "b": [1, 403, 407, 261, 378]}
    single = generate(make_engine(stories_path, kv_cache_dtype="int8"), prompts, greedy(24, ignore_eos=True))
    engine = make_engine(stories_path, kv_cache_dtype="int8", tensor_parallel_size=2)
    try:
        sharded = generate(engine, prompts, greedy(24, ignore_eos=True))
        assert engine.kv_layout.dtype == "int8"
    finally:
        engine.shutdown()
    for rid in prompts:
        assert sharded[rid].token_ids == single[rid].token_ids, rid
