"""GPU kernel figures, measured side by side in one run (needs a CUDA device and CuPy):

- device-to-device copy bandwidth (bytes read + written per second), the ceiling;
- paged decode attention bandwidth (K/V bytes read per second) as a fraction of it (goal >= 0.6),
  for a large batch and for one long sequence with split-K on and off;
- prefill attention: the tensor-core kernel, the float32 (SIMT) kernel and torch's own
  scaled_dot_product_attention (flash backend, contiguous K/V) on the same shapes, in TFLOP/s and as a
  fraction of the device's dense bf16 tensor-core peak (goal >= 0.3, and at least SDPA's speed);
- the engine's sampler (torch ops on the GPU) for a large batch.
The last lines are one table: each figure against its goal.

    python3 bench/gpu_kernels_bench.py [--peak-tflops 989]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from conduit_engine.ops.base import AttentionMetadata, StepContext
from conduit_engine.ops.cuda_ops import CudaOps
from conduit_engine.sampling.metadata import build_sampling_metadata
from conduit_engine.sampling.plan import SamplingRow
from conduit_engine.sampling.sampler import Sampler
from conduit_engine.sampling_params import SamplingParams

_NO_ROPE = torch.zeros(1, 2, device="cuda") if torch.cuda.is_available() else torch.zeros(1, 2)


def timed(fn, iters: int = 20, warmup: int = 3) -> float:
    """Mean seconds per call, by CUDA events."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / iters


def copy_bandwidth() -> float:
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src))
    return 2 * src.numel() / seconds


def paged_batch(batch: int, context: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype):
    blocks_per_seq = context // block_size
    num_blocks = batch * blocks_per_seq
    gen = torch.Generator(device="cuda").manual_seed(0)
    k_cache = torch.randn(
        num_blocks, block_size, kv_heads, head_dim, device="cuda", dtype=dtype, generator=gen
    )
    v_cache = torch.randn_like(k_cache)
    tables = (
        torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32).view(batch, blocks_per_seq)
    )
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device="cuda"),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device="cuda"),
        block_tables=tables,
        query_lens_cpu=(1,) * batch,
        seq_lens_cpu=(context,) * batch,
        block_size=block_size,
    )
    return k_cache, v_cache, meta


def decode_bandwidth(
    ops: CudaOps, batch: int, context: int, heads: int, kv_heads: int, head_dim: int
) -> float:
    dtype = torch.bfloat16
    k_cache, v_cache, meta = paged_batch(batch, context, kv_heads, head_dim, 16, dtype)
    q = torch.randn(batch, heads, head_dim, device="cuda", dtype=dtype)
    step = ops.begin_step(torch.zeros(batch, dtype=torch.int64, device="cuda"), meta, _NO_ROPE)
    seconds = timed(lambda: ops.attention(q, k_cache, v_cache, step, head_dim**-0.5))
    kv_bytes = 2 * k_cache.numel() * k_cache.element_size()
    return kv_bytes / seconds


# Dense (no sparsity) bf16 tensor-core peaks, TFLOP/s, by device name.
_BF16_PEAKS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.0}


def bf16_peak(name: str, override: float | None) -> float | None:
    if override:
        return override
    return next((peak for key, peak in _BF16_PEAKS.items() if key in name), None)


def fresh_prefill(seqs: int, tokens: int, heads: int, kv_heads: int, head_dim: int):
    """`seqs` prompts of `tokens` new tokens (no cache hit): paged caches, q, and contiguous K/V for SDPA."""
    k_cache, v_cache, meta = paged_batch(seqs, tokens, kv_heads, head_dim, 16, torch.bfloat16)
    total = seqs * tokens
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(total, dtype=torch.int64, device="cuda"),
        query_start_loc=torch.arange(0, total + 1, tokens, dtype=torch.int32, device="cuda"),
        seq_lens=meta.seq_lens,
        block_tables=meta.block_tables,
        query_lens_cpu=(tokens,) * seqs,
        seq_lens_cpu=meta.seq_lens_cpu,
        block_size=16,
    )
    q = torch.randn(total, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    step = StepContext(torch.zeros(total, dtype=torch.int64, device="cuda"), meta, _NO_ROPE)
    # The same keys as contiguous [seqs, kv_heads, tokens, head_dim] tensors, GQA expanded for SDPA.
    order = meta.block_tables.long()
    k = k_cache[order].reshape(seqs, tokens, kv_heads, head_dim).transpose(1, 2)
    v = v_cache[order].reshape(seqs, tokens, kv_heads, head_dim).transpose(1, 2)
    group = heads // kv_heads
    k = k.repeat_interleave(group, dim=1).contiguous()
    v = v.repeat_interleave(group, dim=1).contiguous()
    q_sdpa = q.view(seqs, tokens, heads, head_dim).transpose(1, 2).contiguous()
    return q, k_cache, v_cache, step, q_sdpa, k, v


def prefill_rates(seqs: int, tokens: int) -> dict[str, float]:
    """TFLOP/s of causal prefill attention (32/8 heads, d128, bf16): Conduit's kernels and SDPA flash."""
    heads, kv_heads, head_dim = 32, 8, 128
    q, k_cache, v_cache, step, q_sdpa, k, v = fresh_prefill(seqs, tokens, heads, kv_heads, head_dim)
    flops = seqs * heads * 4 * head_dim * (tokens * (tokens + 1) // 2)  # QK and PV over the causal half
    rates = {}
    for label, ops in (("tensor cores", CudaOps()), ("float32 kernel", CudaOps(tensor_cores=False))):
        seconds = timed(lambda ops=ops: ops.attention(q, k_cache, v_cache, step, head_dim**-0.5), iters=5)
        rates[label] = flops / seconds / 1e12
    try:
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            seconds = timed(lambda: F.scaled_dot_product_attention(q_sdpa, k, v, is_causal=True), iters=5)
        rates["torch sdpa (flash)"] = flops / seconds / 1e12
    except RuntimeError as exc:  # no flash backend in this torch build
        print(f"torch sdpa flash backend unavailable: {exc}")
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak (default: by name)")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    name = torch.cuda.get_device_name()
    print(f"device: {name}")
    ceiling = copy_bandwidth()
    print(f"device-to-device copy: {ceiling / 1e12:.2f} TB/s (read + write)")
    goals: list[tuple[str, str, str, bool]] = []  # figure, value, goal, met
    ops = CudaOps()
    for label, kwargs, shape in (
        ("batch 64 x 4096 tokens, 32/8 heads, d128", {}, (64, 4096, 32, 8, 128)),
        ("batch 64 x 4096 tokens, 32/4 heads, d128", {}, (64, 4096, 32, 4, 128)),
        ("batch 1 x 32768 tokens, split-K on (512)", {}, (1, 32768, 32, 8, 128)),
        ("batch 1 x 32768 tokens, split-K off", {"decode_partition_size": 32768}, (1, 32768, 32, 8, 128)),
    ):
        bw = decode_bandwidth(CudaOps(**kwargs) if kwargs else ops, *shape)
        print(f"paged decode attention, {label}: {bw / 1e12:.2f} TB/s = {bw / ceiling:.2f} of copy bandwidth")
        if "split-K off" not in label:
            goals.append((f"decode {label}", f"{bw / ceiling:.2f} of copy", ">= 0.60", bw / ceiling >= 0.6))
    peak = bf16_peak(name, args.peak_tflops)
    for seqs, tokens in ((8, 1024), (1, 8192)):
        rates = prefill_rates(seqs, tokens)
        for label, rate in rates.items():
            share = f" = {rate / peak:.3f} of the {peak:.0f} TFLOP/s bf16 peak" if peak else ""
            print(f"prefill attention {seqs} x {tokens}, {label}: {rate:.1f} TFLOP/s{share}")
        ours, sdpa = rates["tensor cores"], rates.get("torch sdpa (flash)")
        if peak:
            goals.append(
                (f"prefill {seqs} x {tokens}", f"{ours / peak:.3f} of peak", ">= 0.30", ours / peak >= 0.3)
            )
        if sdpa:
            goals.append(
                (f"prefill {seqs} x {tokens} vs sdpa", f"{ours / sdpa:.2f}x", ">= 1.00x", ours >= sdpa)
            )
    # prefill: 8 sequences of 1024 new tokens after 1024 cached ones
    k_cache, v_cache, meta = paged_batch(8, 2048, 8, 128, 16, torch.bfloat16)
    q_lens = (1024,) * 8
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(8192, dtype=torch.int64, device="cuda"),
        query_start_loc=torch.arange(0, 8193, 1024, dtype=torch.int32, device="cuda"),
        seq_lens=meta.seq_lens,
        block_tables=meta.block_tables,
        query_lens_cpu=q_lens,
        seq_lens_cpu=meta.seq_lens_cpu,
        block_size=16,
    )
    q = torch.randn(8192, 32, 128, device="cuda", dtype=torch.bfloat16)
    step = StepContext(torch.zeros(8192, dtype=torch.int64, device="cuda"), meta, _NO_ROPE)
    seconds = timed(lambda: ops.attention(q, k_cache, v_cache, step, 128**-0.5), iters=5)
    flops = 8 * 32 * 4 * 128 * sum(1024 + i + 1 for i in range(1024))  # QK and PV, causal with prefix
    rate = flops / seconds / 1e12
    print(f"prefill attention 8 x 1024 after 1024 cached: {seconds * 1e3:.2f} ms, {rate:.1f} TFLOP/s")
    logits = torch.randn(64, 128256, device="cuda") * 3
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, seed=1)
    rows = [SamplingRow(params, [1], [], seed=i) for i in range(64)]
    sampler = Sampler()
    seconds = timed(
        lambda: sampler(logits, build_sampling_metadata(rows, logits.shape[1], logits.device)), iters=10
    )
    print(
        f"engine sampler, 64 rows x 128256 vocab (top-k 50, top-p 0.9, min-p 0.05, seeded): "
        f"{seconds * 1e3:.2f} ms"
    )
    print("\n| figure | value | goal | met |\n|---|---|---|---|")
    for figure, value, goal, met in goals:
        print(f"| {figure} | {value} | {goal} | {'yes' if met else 'NO'} |")


if __name__ == "__main__":
    main()
