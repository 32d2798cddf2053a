"""The emulated kernel tests again, on a GPU through CuPy (the production launcher), plus CUDA graph capture.

Runs only where torch sees a CUDA device and CuPy imports (bench/gpu_check.sh); elsewhere every test here
is skipped with that reason. `launcher` bridges the CPU tensors the shared test bodies build: each
argument's whole storage is copied to the GPU (so views keep their strides and views of one buffer stay
one buffer), the kernel runs through CupyLauncher, and the storages are copied back.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from conduit_engine.ops.kernel_loader import KernelArg, KernelRef

HAS_GPU = torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None
pytestmark = [
    pytest.mark.kernels,
    pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device and CuPy (run bench/gpu_check.sh)"),
]

if HAS_GPU:
    # Re-collected here, so each runs with this module's `launcher` fixture.
    from test_cuda_graphs import test_padded_decode_attention_matches_unpadded_rows  # noqa: F401
    from test_ops_emulated import (  # noqa: F401
        test_add_rms_norm_matches_reference,
        test_apply_token_bitmask_matches_reference,
        test_apply_token_bitmask_on_strided_logits_skips_rows_outside,
        test_decode_attention_matches_reference,
        test_decode_grid_sized_for_longer_contexts_gives_same_result,
        test_fused_rotary_and_kv_write_matches_the_two_reference_ops,
        test_prefill_attention_matches_reference,
        test_prefill_without_tensor_cores_runs_the_float32_kernel,
        test_rms_norm_matches_reference,
        test_rms_norm_on_strided_rows_and_3d_input,
        test_rotary_on_fused_qkv_views_matches_reference,
        test_silu_and_mul_matches_reference,
        test_write_kv_skips_negative_slots_and_reads_strided_views,
    )


class CudaBridgeLauncher:
    def __init__(self) -> None:
        from conduit_engine.ops.cuda_ops import CupyLauncher

        self._inner = CupyLauncher()
        self.launches: list[KernelRef] = []

    def launch(self, kernel, grid, block, args, shared_mem=0) -> None:
        buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        moved: list[KernelArg] = []
        for arg in args:
            if not isinstance(arg, torch.Tensor):
                moved.append(arg)
                continue
            storage = arg.untyped_storage()
            if storage.data_ptr() not in buffers:
                host = torch.empty(0, dtype=torch.uint8).set_(storage)
                buffers[storage.data_ptr()] = (host, host.to("cuda"))
            device_bytes = buffers[storage.data_ptr()][1]
            moved.append(
                device_bytes.view(arg.dtype).as_strided(arg.shape, arg.stride(), arg.storage_offset())
            )
        self.launches.append(kernel)
        self._inner.launch(kernel, grid, block, moved, shared_mem)
        torch.cuda.synchronize()
        for host, device_bytes in buffers.values():
            host.copy_(device_bytes.cpu())


@pytest.fixture
def launcher() -> CudaBridgeLauncher:
    return CudaBridgeLauncher()


def test_decode_step_captured_as_cuda_graph_matches_eager():
    """A toy decode 'model' (norm, KV write, paged attention) replays from a graph like it runs eagerly."""
    from conduit_engine.ops.base import AttentionMetadata
    from conduit_engine.ops.cuda_ops import CudaOps
    from conduit_engine.worker.cuda_graphs import CudaGraphRunner, StaticDecodeInputs, capture_batch_sizes

    torch.manual_seed(0)
    ops = CudaOps(decode_partition_size=128)
    heads, kv_heads, head_dim, block_size, hidden = 8, 2, 64, 16, 8 * 64
    embed = torch.randn(100, hidden, device="cuda", dtype=torch.float16)
    wk = torch.randn(hidden, kv_heads * head_dim, device="cuda", dtype=torch.float16) / hidden**0.5
    norm_w = torch.nn.Parameter(torch.ones(hidden, device="cuda", dtype=torch.float16))  # as in the model
    k_cache = torch.randn(64, block_size, kv_heads, head_dim, device="cuda", dtype=torch.float16)
    caches = [(k_cache, torch.randn_like(k_cache))]

    def model(input_ids, positions, kv_caches, meta):
        x = ops.rms_norm(embed[input_ids], norm_w, 1e-5)
        k = (x @ wk).view(-1, kv_heads, head_dim)
        ops.write_kv(k, k, kv_caches[0][0], kv_caches[0][1], meta.slot_mapping)
        step = ops.begin_step(positions, meta, torch.zeros(1, 2, device="cuda"))
        return ops.attention(x.view(-1, heads, head_dim), kv_caches[0][0], kv_caches[0][1], step, 0.125)

    inputs = StaticDecodeInputs(8, 16, 256, block_size, torch.device("cuda"))
    runner = CudaGraphRunner(model, caches, capture_batch_sizes(8), inputs)
    runner.capture()
    seq_lens = (40, 200, 7)
    tables = torch.arange(48, dtype=torch.int32, device="cuda").view(3, 16)
    slots = torch.tensor([int(tables[i, (n - 1) // 16]) * 16 + (n - 1) % 16 for i, n in enumerate(seq_lens)])
    meta = AttentionMetadata(
        slot_mapping=slots.cuda(),
        query_start_loc=torch.arange(4, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        block_tables=tables,
        query_lens_cpu=(1, 1, 1),
        seq_lens_cpu=seq_lens,
        block_size=block_size,
    )
    ids = torch.tensor([5, 17, 99], device="cuda")
    positions = torch.tensor([n - 1 for n in seq_lens], device="cuda")
    assert runner.can_run(meta)
    replayed = runner.run(ids, positions, meta).clone()
    eager = model(ids, positions, caches, meta)
    torch.testing.assert_close(replayed, eager, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
def test_kv_blocks_gather_and_scatter_on_cuda_tensors_match_reference(dtype):
    """Not through the bridge launcher: the kernels read a table of cache addresses, which must be the
    caches' real device addresses, so this test builds CUDA caches directly."""
    from conduit_engine.ops.cuda_ops import CudaOps
    from conduit_engine.ops.torch_ops import TorchOps

    gen = torch.Generator().manual_seed(5)
    shape = (64, 16, 8, 128)  # a real model's block: 16 tokens, 8 KV heads, head_dim 128
    host = [
        (torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
        for _ in range(4)
    ]
    device = [(k.cuda(), v.cuda()) for k, v in host]
    blocks = [9, 0, 63, 31, 2]
    ids = torch.tensor(blocks, dtype=torch.int64)
    ops, ref = CudaOps(), TorchOps()
    gathered = ops.gather_kv_blocks(device, ids.cuda())
    assert torch.equal(gathered.cpu(), ref.gather_kv_blocks(host, ids))
    buffer = torch.randn(4, 2, len(blocks), *shape[1:], generator=gen).to(dtype)
    ref.scatter_kv_blocks(buffer, host, ids)
    ops.scatter_kv_blocks(buffer.cuda(), device, ids.cuda())
    torch.cuda.synchronize()
    for (k, v), (dk, dv) in zip(host, device, strict=True):
        assert torch.equal(dk.cpu(), k) and torch.equal(dv.cpu(), v)


def test_kv_payload_round_trip_between_cuda_caches():
    """The transfer path on a GPU: gather kernel → host bytes (LocalKvBlocks.gather_kv_blocks) → scatter
    kernel into another CUDA cache (CacheBlockWriter), byte for byte, into non-contiguous destination
    blocks."""
    import asyncio

    from conduit_engine.kv_transfer.cache_io import CacheBlockWriter
    from conduit_engine.ops.cuda_ops import CudaOps
    from tests.support.kv_blocks import LocalKvBlocks

    gen = torch.Generator().manual_seed(9)
    shape = (32, 16, 8, 128)
    src = [
        (
            torch.randn(shape, generator=gen).to(torch.bfloat16).cuda(),
            torch.randn(shape, generator=gen).to(torch.bfloat16).cuda(),
        )
        for _ in range(3)
    ]
    dst = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in src]
    ops = CudaOps()
    src_ids, dst_ids = [4, 17, 2, 30], [11, 0, 25, 6]
    payload = LocalKvBlocks(ops, src).gather_kv_blocks(src_ids)
    assert len(payload) == 4 * 2 * 3 * 16 * 8 * 128 * 2
    block_bytes = len(payload) // 4
    asyncio.run(CacheBlockWriter(LocalKvBlocks(ops, dst), block_bytes, dst_ids, 0).write(0, 4, payload))
    for (sk, sv), (dk, dv) in zip(src, dst, strict=True):
        assert torch.equal(sk[src_ids], dk[dst_ids]) and torch.equal(sv[src_ids], dv[dst_ids])
        untouched = [b for b in range(32) if b not in dst_ids]
        assert not dk[untouched].any() and not dv[untouched].any()
