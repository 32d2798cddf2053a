"""CUDA ops backend: the kernels in kernels/*.cu behind the `Ops` interface, launched through CuPy.

Each wrapper picks the launch configuration and hands a `KernelRef` plus arguments to a launcher; the
argument checks live in `cuda_checks` and run once per step, once per cache, and per call only when
asked (`check_calls`). `CupyLauncher` (the default) compiles each specialisation once with
cupy.RawModule and runs it on torch's current stream, passing tensors zero-copy as device addresses. Tests
pass an emulating launcher instead, which runs the same .cu source on the CPU, so everything in this
module except `CupyLauncher` is exercised without a GPU. CuPy is imported only inside `CupyLauncher`:
importing this module never needs it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from conduit_engine.ops import cuda_checks as checks
from conduit_engine.ops import cuda_lora
from conduit_engine.ops import kernel_loader as kl
from conduit_engine.ops.attention_geometry import (
    DEFAULT_SM_COUNT,
    MMA_PREFILL_ROWS,
    PREFILL_ROWS,
    auto_decode_partition,
    decode_lane_chunks,
    decode_pass_heads,
    decode_shared_bytes,
    prefill_mma_shared_bytes,
    prefill_shared_bytes,
)
from conduit_engine.ops.base import (
    AttentionMetadata,
    LoraBatch,
    LoraWeights,
    Ops,
    StepContext,
    check_gather_out,
    check_kv_block_args,
)
from conduit_engine.ops.cuda_checks import check, pack_elems
from conduit_engine.ops.kernel_loader import KernelArg, KernelLauncher, KernelRef
from conduit_engine.ops.kv_quant import is_quantized

_DEFAULT_SHARED_LIMIT = 48 * 1024  # above this a kernel must opt in to more dynamic shared memory
_PREFILL_THREADS = 128
_TENSOR_CORE_DTYPES = (torch.float16, torch.bfloat16)
# The int8 GEMM (int8_gemm.cu): k per mma step, columns per block, rows per block (4 warps x 16).
_INT8_K_STEP = 32
_INT8_TILE_N = 32
_INT8_TILE_M = 64
_INT8_GEMM_THREADS = 128
_INT8_QUANT_THREADS = 256
# Blocks per masked row: enough to fill the GPU at small batches; larger vocabularies loop in the kernel.
_BITMASK_MAX_BLOCKS_PER_ROW = 64


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def _threads_for(work_items: int) -> int:
    """A block size (multiple of 32, at most 1024) for `work_items` parallel items."""
    return max(32, min(1024, _round_up(work_items, 32)))


def _aligned(*tensors: torch.Tensor) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def _as_rows(name: str, x: torch.Tensor) -> torch.Tensor:
    """View x [..., H] as [rows, H] with unit stride along H (a copy only if no such view exists)."""
    check(x.dim() >= 1, f"{name}: expected at least 1 dimension, got a scalar")
    if x.dim() == 2 and x.stride(1) == 1:
        return x
    # reshape is a view for contiguous tensors; other layouts are copied once, which is always correct.
    return x.reshape(-1, x.shape[-1]) if x.is_contiguous() else x.contiguous().reshape(-1, x.shape[-1])


class _PagedAttention(NamedTuple):
    """One attention call as both attention kernels take it."""

    out: torch.Tensor
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float
    num_kv_heads: int
    group: int  # query heads per KV head
    log2_block: int
    sliding_window: int  # 0: full attention
    logit_softcap: float  # 0: none


def _split_k_buffers(
    q: torch.Tensor, partitions: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | tuple[None, None, None]:
    """Per-partition outputs, maxima and sums of split-K decode attention (None when not split)."""
    if partitions == 1:
        return None, None, None
    num_seqs, num_heads, head_dim = q.shape
    partial_out = torch.empty(
        (num_seqs, num_heads, partitions, head_dim), dtype=torch.float32, device=q.device
    )
    partial_max = torch.empty((num_seqs, num_heads, partitions), dtype=torch.float32, device=q.device)
    return partial_out, partial_max, torch.empty_like(partial_max)


def uses_tensor_core_prefill(
    q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> bool:
    """Whether prefill attention of these tensors can run on the tensor-core kernel: f16/bf16, head_dim
    a multiple of 16, 16-byte aligned tensors whose token strides are whole 16-byte chunks."""
    return (
        q.dtype in _TENSOR_CORE_DTYPES
        and q.shape[2] % 16 == 0
        and _aligned(q, out, k_cache, v_cache)
        and q.stride(0) % 8 == 0
        and out.stride(0) % 8 == 0
    )


class CudaOps(Ops):
    """`Ops` on the kernels in kernels/; `launcher` defaults to CuPy on the current CUDA device.

    decode_partition_size: context tokens per split-K partition of decode attention (a multiple of
    decode_threads); contexts longer than one partition are split across thread blocks, which the last
    of them to finish combines.
    None (the default) chooses it per call from sequences x KV heads against the SM count
    (auto_decode_partition); under CUDA graph capture that is once per captured batch size.
    check_calls: check every call's arguments (see cuda_checks); step inputs and caches are checked
    regardless, in begin_step and check_kv_cache.
    bitmask_threads: threads per block of the grammar-masking kernel (bitmask.cu).
    tensor_cores: run prefill attention on tensor cores where it applies (f16/bf16, head_dim % 16 == 0);
    None asks the launcher (sm_80 and later; the CPU emulation has them).
    """

    name = "cuda"

    def __init__(
        self,
        launcher: KernelLauncher | None = None,
        *,
        decode_partition_size: int | None = None,
        decode_threads: int = 128,
        check_calls: bool = True,
        bitmask_threads: int = 256,
        tensor_cores: bool | None = None,
    ) -> None:
        check(
            decode_threads % 32 == 0 and 32 <= decode_threads <= 1024,
            f"decode_threads: must be a multiple of 32 in [32, 1024], got {decode_threads}",
        )
        check(
            decode_partition_size is None
            or (decode_partition_size > 0 and decode_partition_size % decode_threads == 0),
            f"decode_partition_size: must be a positive multiple of decode_threads ({decode_threads}), "
            f"got {decode_partition_size}",
        )
        check(
            bitmask_threads % 32 == 0 and 32 <= bitmask_threads <= 1024,
            f"bitmask_threads: must be a multiple of 32 in [32, 1024], got {bitmask_threads}",
        )
        self._launcher = launcher if launcher is not None else CupyLauncher()
        self.decode_partition_size = decode_partition_size
        self.decode_threads = decode_threads
        self.check_calls = check_calls
        self.bitmask_threads = bitmask_threads
        self.sm_count = int(getattr(self._launcher, "sm_count", DEFAULT_SM_COUNT))
        self.tensor_cores = (
            tensor_cores if tensor_cores is not None else bool(getattr(self._launcher, "tensor_cores", True))
        )
        # (cache addresses, device table of them) of the last KV transfer: one engine has one cache.
        self._kv_pointers: tuple[tuple[object, ...], torch.Tensor] | None = None
        # Split-K decode's arrival counters (zero between launches: the combining block resets its own).
        self._counters: torch.Tensor | None = None
        self._retired: list[torch.Tensor] = []
        # int8 weights padded to whole k32 steps of the int8 GEMM, by the address of the weight's data
        self._int8: dict[int, torch.Tensor] = {}

    def _launch(
        self,
        kernel: KernelRef,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[KernelArg],
        shared_mem: int = 0,
    ) -> None:
        self._launcher.launch(kernel, grid, block, args, shared_mem)

    # ---- linear ---------------------------------------------------------------------------------------

    def prepare_linear(self, weight: torch.Tensor, weight_scale: torch.Tensor | None = None) -> None:
        if weight_scale is not None:
            self._int8_weight(weight)

    def _int8_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """weight [N, K] int8 as the GEMM reads it: [N, ldq], K zero-padded to a multiple of 32."""
        padded = self._int8.get(weight.data_ptr())
        if padded is None:
            n, k = weight.shape
            ldq = _round_up(max(k, 1), _INT8_K_STEP)
            padded = (
                weight.contiguous()
                if ldq == k
                else torch.zeros((n, ldq), dtype=torch.int8, device=weight.device)
            )
            if ldq != k:
                padded[:, :k] = weight
            self._int8[weight.data_ptr()] = padded
        return padded

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        weight_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if weight_scale is None:
            return super().linear(x, weight, bias)
        return self._int8_linear(x, weight, weight_scale, bias)

    def _int8_linear(
        self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """W8A8 (ops/quant.py): x quantized per token (quantize_rows_int8_kernel), then the tensor-core
        int8 GEMM with the scales and bias applied as it stores (int8_gemm.cu)."""
        rows = _as_rows("x", x)
        m, k = rows.shape
        n = weight.shape[0]
        check(weight.dtype == torch.int8 and weight.shape[1] == k, f"weight: expected int8 [{n}, {k}]")
        w = self._int8_weight(weight)
        ldq = w.shape[1]
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        if m == 0 or n == 0:
            return out
        q = torch.empty((m, ldq), dtype=torch.int8, device=x.device)
        x_scale = torch.empty(m, dtype=torch.float32, device=x.device)
        self._launch(
            kl.quantize_rows_int8_kernel(x.dtype),
            (m, 1, 1),
            (_INT8_QUANT_THREADS, 1, 1),
            [q, x_scale, rows, np.int32(k), np.int64(rows.stride(0)), np.int32(ldq)],
        )
        self._launch(
            kl.int8_gemm_kernel(x.dtype),
            (math.ceil(n / _INT8_TILE_N), math.ceil(m / _INT8_TILE_M), 1),
            (_INT8_GEMM_THREADS, 1, 1),
            [
                out,
                q,
                x_scale,
                w,
                weight_scale.to(torch.float32).contiguous(),
                None if bias is None else bias.contiguous(),
                np.int32(m),
                np.int32(n),
                np.int32(ldq),
                np.int64(n),
            ],
        )
        return out

    # ---- once per step, once per cache ----------------------------------------------------------------

    def begin_step(
        self, positions: torch.Tensor, meta: AttentionMetadata, cos_sin_cache: torch.Tensor
    ) -> StepContext:
        checks.check_positions(positions)
        checks.check_cos_sin(cos_sin_cache)
        checks.check_meta(meta)
        return StepContext(positions, meta, cos_sin_cache)

    def check_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        checks.check_cache(k_cache, v_cache)

    def lora_delta(self, y: torch.Tensor, x: torch.Tensor, w: LoraWeights, batch: LoraBatch) -> None:
        if self.check_calls:
            cuda_lora.check_lora_args(y, x, w, batch)
        cuda_lora.lora_delta(self._launcher, y, x, w, batch)

    # ---- normalisation and activation --------------------------------------------------------------

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = _as_rows("x", x)
        hidden = rows.shape[1]
        if self.check_calls:
            checks.check_norm_weight(weight, hidden, x.dtype)
        out = torch.empty((rows.shape[0], hidden), dtype=x.dtype, device=x.device)
        if out.numel() == 0:
            return out.view(x.shape)
        vec = pack_elems(x.dtype)
        vectorized = hidden % vec == 0 and rows.stride(0) % vec == 0 and _aligned(rows, weight, out)
        self._launch(
            kl.rms_norm_kernel(x.dtype),
            (rows.shape[0], 1, 1),
            (_threads_for(hidden // vec if vectorized else hidden), 1, 1),
            [
                out,
                rows,
                weight,
                np.int32(hidden),
                np.int64(rows.stride(0)),
                np.int64(hidden),
                np.float32(eps),
                np.int32(vectorized),
            ],
        )
        return out.view(x.shape)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.check_calls:
            checks.check_residual(x, residual)
        rows = _as_rows("x", x)
        res_rows = _as_rows("residual", residual)
        if res_rows.stride(0) != rows.stride(0):
            # The kernel walks x and residual with one row stride.
            rows, res_rows = rows.contiguous(), res_rows.contiguous()
        hidden = rows.shape[1]
        if self.check_calls:
            checks.check_norm_weight(weight, hidden, x.dtype)
        out = torch.empty((rows.shape[0], hidden), dtype=x.dtype, device=x.device)
        summed = torch.empty_like(out)
        if out.numel() == 0:
            return out.view(x.shape), summed.view(x.shape)
        vec = pack_elems(x.dtype)
        vectorized = hidden % vec == 0 and _aligned(weight, out, summed)
        self._launch(
            kl.add_rms_norm_kernel(x.dtype),
            (rows.shape[0], 1, 1),
            (_threads_for(hidden // vec if vectorized else hidden), 1, 1),
            [
                out,
                summed,
                rows,
                res_rows,
                weight,
                np.int32(hidden),
                np.int64(rows.stride(0)),
                np.int64(hidden),
                np.float32(eps),
                np.int32(vectorized),
            ],
        )
        return out.view(x.shape), summed.view(x.shape)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._gated_and_mul(kl.silu_and_mul_kernel(x.dtype), x)

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._gated_and_mul(kl.gelu_tanh_and_mul_kernel(x.dtype), x)

    def _gated_and_mul(self, kernel: KernelRef, x: torch.Tensor) -> torch.Tensor:
        rows = _as_rows("x", x)
        check(rows.shape[1] % 2 == 0, f"x: last dimension must be even (gate | up), got {rows.shape[1]}")
        inter = rows.shape[1] // 2
        out = torch.empty((rows.shape[0], inter), dtype=x.dtype, device=x.device)
        if out.numel() == 0:
            return out.view(*x.shape[:-1], inter)
        vec = pack_elems(x.dtype)
        vectorized = inter % vec == 0 and rows.stride(0) % vec == 0 and _aligned(rows, out)
        per_thread = vec if vectorized else 1
        threads = _threads_for(min(256, math.ceil(inter / per_thread)))
        grid_y = math.ceil(inter / (threads * per_thread))
        self._launch(
            kernel,
            (rows.shape[0], grid_y, 1),
            (threads, 1, 1),
            [out, rows, np.int32(inter), np.int64(rows.stride(0)), np.int64(inter), np.int32(vectorized)],
        )
        return out.view(*x.shape[:-1], inter)

    # ---- rotary embedding and KV cache ---------------------------------------------------------------

    def rotary_embedding(self, q: torch.Tensor, k: torch.Tensor, step: StepContext) -> None:
        positions, cos_sin_cache = step.positions, step.cos_sin_cache
        if self.check_calls:
            checks.check_rotary(q, k, positions)
            checks.check_cos_sin(cos_sin_cache, q.shape[2])
        num_tokens, num_q_heads, head_dim = q.shape
        if num_tokens == 0:
            return
        pairs = (num_q_heads + k.shape[1]) * head_dim // 2
        self._launch(
            kl.rotary_kernel(q.dtype),
            (num_tokens, 1, 1),
            (_threads_for(pairs), 1, 1),
            [
                q,
                k,
                positions,
                cos_sin_cache,
                np.int32(num_q_heads),
                np.int32(k.shape[1]),
                np.int32(head_dim),
                np.int64(q.stride(0)),
                np.int64(k.stride(0)),
            ],
        )

    def rotary_and_write_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        step: StepContext,
    ) -> None:
        positions, cos_sin_cache, slot_mapping = step.positions, step.cos_sin_cache, step.meta.slot_mapping
        if self.check_calls:
            checks.check_rotary(q, k, positions)
            checks.check_cos_sin(cos_sin_cache, q.shape[2])
            checks.check_cache(k_cache, v_cache)
            checks.check_kv_rows(k, v, k_cache, slot_mapping)
        num_tokens, num_q_heads, head_dim = q.shape
        if num_tokens == 0:
            return
        if is_quantized(k_cache):  # a row's scale needs all of its rotated values: rotate, then quantize
            self.rotary_embedding(q, k, step)
            self._write_kv_quant(k, v, k_cache, v_cache, slot_mapping)
            return
        pairs = (num_q_heads + k.shape[1]) * head_dim // 2
        self._launch(
            kl.rotary_write_kv_kernel(q.dtype),
            (num_tokens, 1, 1),
            (_threads_for(pairs), 1, 1),
            [
                q,
                k,
                v,
                k_cache,
                v_cache,
                positions,
                cos_sin_cache,
                slot_mapping,
                np.int32(num_q_heads),
                np.int32(k.shape[1]),
                np.int32(head_dim),
                np.int64(q.stride(0)),
                np.int64(k.stride(0)),
                np.int64(v.stride(0)),
            ],
        )

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if self.check_calls:
            checks.check_cache(k_cache, v_cache)
            checks.check_kv_rows(k, v, k_cache, slot_mapping)
        num_tokens = k.shape[0]
        if num_tokens == 0:
            return
        if is_quantized(k_cache):
            self._write_kv_quant(k, v, k_cache, v_cache, slot_mapping)
            return
        row = k_cache.shape[2] * k_cache.shape[3]
        vec = pack_elems(k.dtype)
        vectorized = (
            row % vec == 0
            and k.stride(0) % vec == 0
            and v.stride(0) % vec == 0
            and _aligned(k, v, k_cache, v_cache)
        )
        self._launch(
            kl.write_kv_kernel(k.dtype),
            (num_tokens, 1, 1),
            (_threads_for(row // vec if vectorized else row), 1, 1),
            [
                k,
                v,
                k_cache,
                v_cache,
                slot_mapping,
                np.int32(row),
                np.int64(k.stride(0)),
                np.int64(v.stride(0)),
                np.int32(vectorized),
            ],
        )

    def _write_kv_quant(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """k, v into an int8 / fp8 cache (kv_quant.py's rows): one thread quantizes one head's row."""
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        self._launch(
            kl.write_kv_quant_kernel(k.dtype, k_cache.dtype),
            (k.shape[0], 1, 1),
            (_threads_for(2 * num_kv_heads), 1, 1),
            [
                k,
                v,
                k_cache,
                v_cache,
                slot_mapping,
                np.int32(num_kv_heads),
                np.int32(head_dim),
                np.int64(k.stride(0)),
                np.int64(v.stride(0)),
            ],
        )

    # ---- attention -------------------------------------------------------------------------------------

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        step: StepContext,
        scale: float,
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:
        meta = step.meta
        if self.check_calls:
            checks.check_cache(k_cache, v_cache)
            checks.check_attention(q, k_cache, meta)
            checks.check_window(sliding_window, logit_softcap)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.num_seqs == 0 or q.shape[0] == 0:
            return out
        _, block_size, num_kv_heads, _ = k_cache.shape
        group = q.shape[1] // num_kv_heads
        log2_block = block_size.bit_length() - 1
        launch = _PagedAttention(
            out,
            q,
            k_cache,
            v_cache,
            meta,
            scale,
            num_kv_heads,
            group,
            log2_block,
            sliding_window or 0,
            logit_softcap or 0.0,
        )
        if meta.is_decode_only:
            self._decode_attention(launch)
        else:
            self._prefill_attention(launch)
        return out

    def _decode_attention(self, a: _PagedAttention) -> None:
        out, q, k_cache, v_cache, meta, scale, num_kv_heads, group, log2_block, window, softcap = a
        num_seqs, num_heads, head_dim = q.shape
        # The grid follows the host copy of the lengths (under CUDA graph capture: the longest allowed
        # context), or the window when shorter; partitions past a sequence's real end exit at once.
        visible = min(meta.max_seq_len, window) if window else meta.max_seq_len
        threads = self.decode_threads
        partition_size = self.decode_partition_size or auto_decode_partition(
            visible, num_seqs * num_kv_heads, self.sm_count, threads
        )
        partitions = max(1, math.ceil(visible / partition_size))
        partial_out, partial_max, partial_sum = _split_k_buffers(q, partitions)
        chunks = decode_lane_chunks(head_dim, q.element_size())
        kv = kl.kv_format(k_cache.dtype)
        self._launch(
            kl.decode_attention_kernel(q.dtype, chunks, decode_pass_heads(group, chunks), kv),
            (num_seqs, num_kv_heads, partitions),
            (threads, 1, 1),
            [
                out,
                np.int64(out.stride(0)),
                partial_out,
                partial_max,
                partial_sum,
                self._split_counters(num_seqs * num_kv_heads, q.device) if partitions > 1 else None,
                q,
                np.int64(q.stride(0)),
                k_cache,
                v_cache,
                meta.block_tables,
                np.int32(meta.block_tables.stride(0)),
                meta.seq_lens,
                np.int32(num_kv_heads),
                np.int32(head_dim),
                np.int32(group),
                np.int32(log2_block),
                np.float32(scale),
                np.int32(partition_size),
                np.int32(window),
                np.float32(softcap),
                np.float32(1.0 / softcap if softcap else 0.0),
            ],
            decode_shared_bytes(group, head_dim, threads, q.element_size()),
        )

    def _split_counters(self, needed: int, device: torch.device) -> torch.Tensor:
        """At least `needed` int32 zeros that outlive the launch (and any CUDA graph that records it):
        allocated once, with room to spare, and grown only when a larger batch needs more."""
        if self._counters is None or self._counters.numel() < needed or self._counters.device != device:
            if self._counters is not None:
                self._retired.append(self._counters)  # a captured graph may still point at it
            self._counters = torch.zeros(max(needed, 4096), dtype=torch.int32, device=device)
        return self._counters

    def _prefill_attention(self, a: _PagedAttention) -> None:
        out, q, k_cache, v_cache, meta, scale, num_kv_heads, group, log2_block, window, softcap = a
        num_heads, head_dim = q.shape[1], q.shape[2]
        kv = kl.kv_format(k_cache.dtype)
        if not kv and self.tensor_cores and uses_tensor_core_prefill(q, out, k_cache, v_cache):
            kernel = kl.prefill_attention_mma_kernel(q.dtype, head_dim)
            rows, shared = MMA_PREFILL_ROWS, prefill_mma_shared_bytes(head_dim)
        else:  # quantized caches are dequantized into the float32 kernel's shared tiles
            kernel = kl.prefill_attention_kernel(q.dtype, head_dim, kv)
            rows, shared = PREFILL_ROWS, prefill_shared_bytes(head_dim)
        self._launch(
            kernel,
            (math.ceil(meta.max_query_len / rows), meta.num_seqs, num_heads),
            (_PREFILL_THREADS, 1, 1),
            [
                out,
                np.int64(out.stride(0)),
                q,
                np.int64(q.stride(0)),
                k_cache,
                v_cache,
                meta.block_tables,
                np.int32(meta.block_tables.stride(0)),
                meta.seq_lens,
                meta.query_start_loc,
                np.int32(num_kv_heads),
                np.int32(group),
                np.int32(log2_block),
                np.float32(scale),
                np.int32(window),
                np.float32(softcap),
                np.float32(1.0 / softcap if softcap else 0.0),
            ],
            shared,
        )

    # ---- grammar masking (once per step) ---------------------------------------------------------------

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
        # Checked on every call, like begin_step: one call per step, and a wrong shape would write
        # outside the logits.
        checks.check_token_bitmask(logits, bitmask, rows)
        num_rows, vocab = bitmask.shape[0], logits.shape[1]
        if num_rows == 0 or vocab == 0:
            return
        threads = self.bitmask_threads
        self._launch(
            kl.APPLY_TOKEN_BITMASK_KERNEL,
            (min(math.ceil(vocab / threads), _BITMASK_MAX_BLOCKS_PER_ROW), num_rows, 1),
            (threads, 1, 1),
            [
                logits,
                np.int64(logits.stride(0)),
                np.int32(vocab),
                bitmask,
                np.int32(bitmask.shape[1]),
                rows,
                np.int32(logits.shape[0]),
            ],
        )

    # ---- KV transfer (prefill/decode disaggregation) ---------------------------------------------------

    def gather_kv_blocks(
        self,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        block_ids: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        shape = check_kv_block_args(kv_caches, block_ids)
        dtype = kv_caches[0][0].dtype
        if out is not None:
            check_gather_out(out, shape, dtype)
        same_device = out is not None and out.device == block_ids.device
        buffer = out if same_device else torch.empty(shape, dtype=dtype, device=block_ids.device)
        assert buffer is not None
        self._copy_kv_blocks(kl.gather_kv_blocks_kernel, buffer, kv_caches, block_ids)
        if out is not None and not same_device:
            out.copy_(buffer)  # device → host (a shared-memory segment): one copy over the bus
            return out
        return buffer

    def scatter_kv_blocks(
        self,
        buffer: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        block_ids: torch.Tensor,
    ) -> None:
        check_kv_block_args(kv_caches, block_ids, buffer)
        self._copy_kv_blocks(kl.scatter_kv_blocks_kernel, buffer, kv_caches, block_ids)

    def _copy_kv_blocks(
        self,
        kernel_for: Callable[[torch.dtype], KernelRef],
        buffer: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        block_ids: torch.Tensor,
    ) -> None:
        """One launch for every block of every layer's K and V (kv_transfer.cu); arguments checked."""
        num_blocks = block_ids.numel()
        if num_blocks == 0:
            return
        caches = [cache for pair in kv_caches for cache in pair]
        check(len(caches) <= 65535, f"kv_caches: {len(caches) // 2} layers exceed the grid's 32767")
        block_elems = caches[0][0].numel()
        check(block_elems < 2**31, f"kv_caches: a block of {block_elems} elements exceeds 2^31")
        vec = pack_elems(buffer.dtype)
        vectorized = block_elems % vec == 0 and _aligned(buffer, *caches)
        per_thread = vec if vectorized else 1
        self._launch(
            kernel_for(buffer.dtype),
            (num_blocks, len(caches), 1),
            (_threads_for(min(256, math.ceil(block_elems / per_thread))), 1, 1),
            [
                buffer,
                self._cache_pointers(caches),
                block_ids,
                np.int32(num_blocks),
                np.int32(block_elems),
                np.int32(vectorized),
            ],
        )

    def _cache_pointers(self, caches: list[torch.Tensor]) -> torch.Tensor:
        """int64 table of the caches' addresses on their device, rebuilt only when an address changes."""
        addresses = [cache.data_ptr() for cache in caches]
        key = (str(caches[0].device), *addresses)
        if self._kv_pointers is None or self._kv_pointers[0] != key:
            table = torch.tensor(addresses, dtype=torch.int64).to(caches[0].device)
            self._kv_pointers = (key, table)
        return self._kv_pointers[1]


@functools.cache
def _cupy_function(kernel: KernelRef) -> object:
    """Compile one specialisation with NVRTC (once per process; CuPy also caches on disk)."""
    import cupy

    module = cupy.RawModule(
        code=kl.compile_unit(kernel.source), options=nvrtc_options(), name_expressions=(kernel.name,)
    )
    return module.get_function(kernel.name)


def nvrtc_options() -> tuple[str, ...]:
    """NVRTC flags: kernels/ on the include path; no toolkit headers are needed (see dtypes.cuh)."""
    return ("-std=c++17", f"-I{kl.kernels_dir()}")


class CupyLauncher:
    """Launches kernels with CuPy on torch's current CUDA stream; tensors go zero-copy by address."""

    def __init__(self) -> None:
        try:
            import cupy
        except ImportError as exc:
            raise RuntimeError(
                "the cuda ops backend needs CuPy: install the engine with the cuda12 or cuda13 extra"
            ) from exc
        self._cupy = cupy
        self._streams: dict[int, object] = {}
        # mma.sync m16n8k16 with bf16 (the tensor-core prefill kernel) needs sm_80 or later.
        self.tensor_cores = torch.cuda.get_device_capability() >= (8, 0)
        self.sm_count = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count

    def launch(
        self,
        kernel: KernelRef,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[KernelArg],
        shared_mem: int = 0,
    ) -> None:
        function = _cupy_function(kernel)
        if shared_mem > _DEFAULT_SHARED_LIMIT:
            function.max_dynamic_shared_size_bytes = shared_mem
        # CuPy's current stream becomes torch's, so the hand-over needs no synchronisation and the
        # launch lands on the stream a CUDA graph capture records.
        with self._cupy_stream(torch.cuda.current_stream()):
            converted = tuple(self._convert(arg) for arg in args)
            function(grid, block, converted, shared_mem=shared_mem)

    def _cupy_stream(self, stream: torch.cuda.Stream) -> object:
        wrapped = self._streams.get(stream.cuda_stream)
        if wrapped is None:
            if hasattr(stream, "__cuda_stream__"):
                wrapped = self._cupy.cuda.Stream.from_external(stream)
            else:  # torch releases without the CUDA stream protocol
                wrapped = self._cupy.cuda.ExternalStream(stream.cuda_stream, stream.device_index)
            self._streams[stream.cuda_stream] = wrapped
        return wrapped

    def _convert(self, arg: KernelArg) -> object:
        if isinstance(arg, torch.Tensor):
            if not arg.is_cuda:
                raise ValueError(f"kernel argument on {arg.device}: the cuda ops backend needs CUDA tensors")
            # The kernel takes a raw pointer: pass the device address by value (zero-copy, as DLPack
            # would be) without building a CuPy array per argument per launch. The caller keeps the
            # tensor alive until the launch is enqueued on torch's stream, which orders its reuse.
            return np.uint64(arg.data_ptr())
        if arg is None:
            return np.uint64(0)  # a null pointer: same size as a device pointer
        return arg
