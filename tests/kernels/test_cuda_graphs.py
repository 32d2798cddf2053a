"""The device-independent parts of cuda_graphs.py: capture sizes, padding, static decode inputs.

Capture and replay need a GPU (bench/gpu_check.sh); here the padded static metadata is run through the
emulated kernels to show padding rows do not change the real rows' attention output.
"""

from __future__ import annotations

import pytest
import torch
from test_ops_emulated import PagedBatch, step

from conduit_engine.ops.cuda_ops import CudaOps
from conduit_engine.worker.cuda_graphs import StaticDecodeInputs, capture_batch_sizes, padded_batch_size

pytestmark = pytest.mark.kernels


def test_capture_batch_sizes():
    assert capture_batch_sizes(1) == (1,)
    assert capture_batch_sizes(3) == (1, 2, 3)
    assert capture_batch_sizes(8) == (1, 2, 4, 8)
    assert capture_batch_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert capture_batch_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_batch_sizes(0)


def test_padded_batch_size_is_the_next_captured_size():
    sizes = capture_batch_sizes(20)
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 20)] == [
        1,
        2,
        4,
        4,
        8,
        8,
        16,
        16,
        20,
        20,
    ]
    assert padded_batch_size(21, sizes) is None
    with pytest.raises(ValueError, match="num_seqs"):
        padded_batch_size(0, sizes)


def test_static_inputs_pad_rows_and_keep_fixed_addresses():
    gen = torch.Generator().manual_seed(0)
    batch = PagedBatch(gen, (5, 17, 9), (1, 1, 1), 4, 2, 8, torch.float32)
    inputs = StaticDecodeInputs(
        max_batch=8, max_blocks_per_seq=10, max_context_len=40, block_size=4, device="cpu"
    )
    addresses = [t.data_ptr() for t in (inputs.input_ids, inputs.slot_mapping, inputs.block_tables)]
    inputs.load(torch.tensor([7, 8, 9]), torch.tensor([4, 16, 8]), batch.meta, batch=4)
    meta = inputs.metadata(4)
    assert [t.data_ptr() for t in (inputs.input_ids, inputs.slot_mapping, inputs.block_tables)] == addresses
    assert inputs.input_ids[:4].tolist() == [7, 8, 9, 0]
    assert inputs.positions[:4].tolist() == [4, 16, 8, 0]
    assert meta.slot_mapping.tolist() == [*batch.meta.slot_mapping.tolist(), -1]
    assert meta.seq_lens.tolist() == [5, 17, 9, 1]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    width = batch.meta.block_tables.shape[1]
    assert torch.equal(meta.block_tables[:3, :width], batch.meta.block_tables)
    assert not meta.block_tables[:3, width:].any() and not meta.block_tables[3].any()
    assert meta.query_lens_cpu == (1, 1, 1, 1) and meta.seq_lens_cpu == (40, 40, 40, 40)
    # A later, smaller step overwrites the padding of the earlier one.
    inputs.load(torch.tensor([1]), torch.tensor([3]), _first_row(batch.meta), batch=2)
    assert inputs.seq_lens[:2].tolist() == [5, 1] and inputs.slot_mapping[:2].tolist()[1] == -1


def _first_row(meta):
    from conduit_engine.ops.base import AttentionMetadata

    return AttentionMetadata(
        slot_mapping=meta.slot_mapping[:1],
        query_start_loc=meta.query_start_loc[:2],
        seq_lens=meta.seq_lens[:1],
        block_tables=meta.block_tables[:1],
        query_lens_cpu=meta.query_lens_cpu[:1],
        seq_lens_cpu=meta.seq_lens_cpu[:1],
        block_size=meta.block_size,
    )


def test_static_inputs_reject_steps_they_cannot_hold():
    gen = torch.Generator().manual_seed(1)
    batch = PagedBatch(gen, (30, 3), (1, 1), 4, 1, 8, torch.float32)
    inputs = StaticDecodeInputs(
        max_batch=4, max_blocks_per_seq=16, max_context_len=16, block_size=4, device="cpu"
    )
    with pytest.raises(ValueError, match="exceeds 16"):
        inputs.load(torch.tensor([1, 2]), torch.tensor([29, 2]), batch.meta, batch=2)
    prefill = PagedBatch(gen, (5,), (3,), 4, 1, 8, torch.float32)
    with pytest.raises(ValueError, match="not a decode step"):
        inputs.load(torch.tensor([1, 2, 3]), torch.tensor([2, 3, 4]), prefill.meta, batch=2)


def test_padded_decode_attention_matches_unpadded_rows(launcher):
    gen = torch.Generator().manual_seed(2)
    batch = PagedBatch(gen, (70, 5, 33), (1, 1, 1), 8, 2, 64, torch.float16)
    q = torch.randn(3, 8, 64, generator=gen).half()
    ops = CudaOps(launcher, decode_partition_size=32, decode_threads=32)
    want = ops.attention(q, batch.k_cache, batch.v_cache, step(ops, batch.meta), 0.125)
    inputs = StaticDecodeInputs(
        max_batch=8, max_blocks_per_seq=20, max_context_len=160, block_size=8, device="cpu"
    )
    inputs.load(torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), batch.meta, batch=8)
    q_padded = torch.cat([q, torch.randn(5, 8, 64, generator=gen).half()])
    got = ops.attention(q_padded, batch.k_cache, batch.v_cache, step(ops, inputs.metadata(8)), 0.125)
    assert torch.equal(got[:3], want)
    # the captured grid covers 160 tokens: 5 partitions of 32, combined in the same launch
    assert [k.name.split("<")[0] for k in launcher.launches][-2:] == [
        "paged_decode_attention_kernel",
        "paged_decode_attention_kernel",
    ]
    assert launcher.grids[-1] == (8, batch.k_cache.shape[2], 5)
