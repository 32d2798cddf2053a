"""CudaOps' input checks and its import hygiene (no CuPy unless the CuPy launcher is built)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_ops_emulated import _meta_for_tokens

from conduit_engine.ops.cuda_ops import (
    CudaOps,
    auto_decode_partition,
    decode_pass_heads,
    decode_shared_bytes,
    prefill_mma_shared_bytes,
    prefill_shared_bytes,
)
from conduit_engine.ops.kernel_loader import (
    KERNEL_SOURCES,
    all_specializations,
    ctype,
    kernels_dir,
    read_source,
)
from conduit_engine.ops.torch_ops import TorchOps
from tests.support.imports import assert_not_loaded

pytestmark = pytest.mark.kernels


def test_importing_the_cuda_backend_does_not_import_cupy():
    assert_not_loaded(
        "import conduit_engine.ops.cuda_ops, conduit_engine.worker.cuda_graphs\n"
        "from conduit_engine.ops import get_ops; get_ops('cpu')",
        "cupy",
    )


def test_every_specialisation_names_an_existing_kernel():
    refs = all_specializations([torch.float32, torch.float16, torch.bfloat16], [64])
    assert {ref.source for ref in refs} == set(KERNEL_SOURCES)
    for ref in refs:
        assert ref.name.split("<")[0] in read_source(ref.source), ref
    assert (kernels_dir() / "emulation" / "cuda_emu.h").is_file()
    with pytest.raises(ValueError, match="float64 is not supported"):
        ctype(torch.float64)


def test_every_kernel_source_documents_layout_grid_and_limits():
    paths = sorted(kernels_dir().glob("*.cu"))
    assert [path.name for path in paths] == sorted(KERNEL_SOURCES)
    for path in paths:
        header = path.read_text().split("#include")[0]
        for word in ("Layout", "Grid", "Limits"):
            assert word in header, f"{path.name}: header comment lacks '{word}'"


def test_shared_memory_fits_the_default_limit_for_common_shapes():
    assert decode_shared_bytes(group_size=8, head_dim=128, threads=128) <= 48 * 1024
    assert prefill_shared_bytes(128) <= 48 * 1024
    assert prefill_shared_bytes(256) <= 227 * 1024  # opts in to more than 48 KiB through the launcher
    assert prefill_mma_shared_bytes(64) <= 48 * 1024
    assert prefill_mma_shared_bytes(256) <= 227 * 1024


@pytest.fixture
def ops(launcher) -> CudaOps:
    return CudaOps(launcher)


def test_wrappers_name_the_bad_field(ops, launcher):
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"weight: expected shape \(8,\)"):
        ops.rms_norm(x, torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match="weight: expected dtype torch.float32"):
        ops.rms_norm(x, torch.ones(8, dtype=torch.float16), 1e-5)
    with pytest.raises(ValueError, match="x: last dimension must be even"):
        ops.silu_and_mul(torch.randn(2, 7))
    cache = torch.zeros(4, 3, 2, 8)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        ops.write_kv(
            torch.zeros(1, 2, 8),
            torch.zeros(1, 2, 8),
            cache,
            cache.clone(),
            torch.zeros(1, dtype=torch.int64),
        )
    cache = torch.zeros(4, 4, 2, 8)
    with pytest.raises(ValueError, match="slot_mapping: expected int64"):
        ops.write_kv(
            torch.zeros(1, 2, 8),
            torch.zeros(1, 2, 8),
            cache,
            cache.clone(),
            torch.zeros(1, dtype=torch.int32),
        )
    q = torch.zeros(3, 4, 16)
    meta = _meta_for_tokens(3)
    step = ops.begin_step(torch.zeros(3, dtype=torch.int64), meta, torch.zeros(10, 16))
    with pytest.raises(ValueError, match="q, k: expected"):
        ops.rotary_embedding(q, torch.zeros(3, 16), step)
    with pytest.raises(ValueError, match="positions: expected contiguous int64"):
        ops.begin_step(torch.zeros(3, dtype=torch.int32), meta, torch.zeros(10, 16))
    with pytest.raises(ValueError, match="meta.block_tables: expected dtype torch.int32"):
        bad = dataclasses.replace(meta, block_tables=meta.block_tables.long())
        ops.begin_step(torch.zeros(3, dtype=torch.int64), bad, torch.zeros(10, 16))
    with pytest.raises(ValueError, match="decode_partition_size"):
        CudaOps(launcher, decode_partition_size=100)
    with pytest.raises(ValueError, match="bitmask_threads"):
        CudaOps(launcher, bitmask_threads=100)


def test_bitmask_wrapper_names_the_bad_field(ops):
    logits, rows = torch.zeros(2, 40), torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"bitmask: expected \[R, 2\] for a vocabulary of 40, got \(1, 1\)"):
        ops.apply_token_bitmask(logits, torch.zeros(1, 1, dtype=torch.int32), rows)
    with pytest.raises(ValueError, match="bitmask: expected dtype torch.int32"):
        ops.apply_token_bitmask(logits, torch.zeros(1, 2, dtype=torch.int64), rows)
    with pytest.raises(ValueError, match=r"rows: expected shape \(1,\), got \(2,\)"):
        ops.apply_token_bitmask(
            logits, torch.zeros(1, 2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64)
        )
    with pytest.raises(ValueError, match="rows: expected dtype torch.int64"):
        ops.apply_token_bitmask(logits, torch.zeros(1, 2, dtype=torch.int32), rows.int())
    with pytest.raises(ValueError, match="logits: expected dtype torch.float32"):
        ops.apply_token_bitmask(logits.half(), torch.zeros(1, 2, dtype=torch.int32), rows)


def test_empty_batches_launch_nothing(launcher):
    ops = CudaOps(launcher)
    assert ops.rms_norm(torch.zeros(0, 8), torch.ones(8), 1e-5).shape == (0, 8)
    assert ops.silu_and_mul(torch.zeros(0, 8)).shape == (0, 4)
    ops.write_kv(
        torch.zeros(0, 2, 8),
        torch.zeros(0, 2, 8),
        torch.zeros(2, 4, 2, 8),
        torch.zeros(2, 4, 2, 8),
        torch.zeros(0, dtype=torch.int64),
    )
    ops.apply_token_bitmask(
        torch.zeros(3, 40), torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, dtype=torch.int64)
    )
    assert launcher.launches == []


def test_kv_transfer_ops_name_the_bad_argument_in_both_backends(launcher):
    caches = [(torch.zeros(4, 2, 1, 8), torch.zeros(4, 2, 1, 8)) for _ in range(2)]
    ids = torch.tensor([1, 3], dtype=torch.int64)
    for ops in (CudaOps(launcher), TorchOps()):
        with pytest.raises(ValueError, match=r"block_ids: must lie in \[0, 4\), got values from 1 to 4"):
            ops.gather_kv_blocks(caches, torch.tensor([1, 4], dtype=torch.int64))
        with pytest.raises(ValueError, match="block_ids: expected a 1-D int64 tensor"):
            ops.gather_kv_blocks(caches, ids.int())
        with pytest.raises(ValueError, match=r"kv_caches\[1\].v: dtype torch.float16 differs from layer 0"):
            ops.gather_kv_blocks([caches[0], (caches[1][0], caches[1][1].half())], ids)
        with pytest.raises(ValueError, match=r"kv_caches\[0\].k: must be contiguous"):
            ops.gather_kv_blocks([(torch.zeros(2, 4, 1, 8).transpose(0, 1), caches[0][1]), caches[1]], ids)
        with pytest.raises(ValueError, match="kv_caches: expected at least one layer"):
            ops.gather_kv_blocks([], ids)
        with pytest.raises(ValueError, match=r"buffer: expected shape \(2, 2, 2, 2, 1, 8\)"):
            ops.scatter_kv_blocks(torch.zeros(2, 2, 3, 2, 1, 8), caches, ids)
        with pytest.raises(ValueError, match="block_ids: must be distinct for a scatter"):
            ops.scatter_kv_blocks(torch.zeros(2, 2, 2, 2, 1, 8), caches, torch.tensor([3, 3]))
    assert launcher.launches == []


def test_kv_transfer_of_no_blocks_launches_nothing(launcher):
    ops = CudaOps(launcher)
    caches = [(torch.zeros(4, 2, 1, 8), torch.zeros(4, 2, 1, 8))]
    empty = torch.zeros(0, dtype=torch.int64)
    assert ops.gather_kv_blocks(caches, empty).shape == (1, 2, 0, 2, 1, 8)
    ops.scatter_kv_blocks(torch.zeros(1, 2, 0, 2, 1, 8), caches, empty)
    assert launcher.launches == []


def test_automatic_split_k_fills_the_sms_without_cutting_contexts_too_fine():
    # batch 1 x 32k, 8 KV heads on 132 SMs: 128 partitions of 256 tokens (1,024 blocks).
    assert auto_decode_partition(32768, 8, 132, 128) == 256
    # batch 64 x 4096, 8 KV heads: 512 blocks want 3 partitions of 1,408 tokens.
    assert auto_decode_partition(4096, 512, 132, 128) == 1408
    # Enough blocks already, or a short context: one partition.
    assert auto_decode_partition(4096, 4096, 132, 128) == 4096
    assert auto_decode_partition(300, 1, 132, 128) == 384


@pytest.mark.parametrize(
    ("group", "chunks", "heads"),
    [(1, 1, 1), (2, 1, 2), (3, 1, 4), (4, 1, 4), (8, 1, 8), (12, 1, 8), (8, 2, 4)],
)
def test_decode_passes_hold_only_the_heads_there_are(group, chunks, heads):
    assert decode_pass_heads(group, chunks) == heads
