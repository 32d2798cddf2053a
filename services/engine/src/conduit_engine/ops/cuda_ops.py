"""CUDA ops backend: the kernels in kernels/*.cu behind the `Ops` interface, launched through CuPy.

Each wrapper checks shapes, strides and dtypes, picks the launch configuration and hands a `KernelRef`
plus arguments to a launcher. `CupyLauncher` (the default) compiles each specialisation once with
cupy.RawModule and runs it on torch's current stream, passing tensors zero-copy through DLPack. Tests
pass an emulating launcher instead, which runs the same .cu source on the CPU, so everything in this
module except `CupyLauncher` is exercised without a GPU. CuPy is imported only inside `CupyLauncher`:
importing this module never needs it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
import torch

from conduit_engine.ops import kernel_loader as kl
from conduit_engine.ops.base import AttentionMetadata, Ops
from conduit_engine.ops.kernel_loader import KernelArg, KernelLauncher, KernelRef

_DEFAULT_SHARED_LIMIT = 48 * 1024  # above this a kernel must opt in to more dynamic shared memory
_PREFILL_ROWS = 16  # query rows per prefill block (prefill_attention.cu)
_PREFILL_THREADS = 128


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def _pack_elems(dtype: torch.dtype) -> int:
    """Elements of `dtype` in one 16-byte vector (conduit::Pack<T>)."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def _threads_for(work_items: int) -> int:
    """A block size (multiple of 32, at most 1024) for `work_items` parallel items."""
    return max(32, min(1024, _round_up(work_items, 32)))


def _aligned(*tensors: torch.Tensor) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_dtype(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    _check(tensor.dtype == dtype, f"{name}: expected dtype {dtype}, got {tensor.dtype}")


def _as_rows(name: str, x: torch.Tensor) -> torch.Tensor:
    """View x [..., H] as [rows, H] with unit stride along H (a copy only if no such view exists)."""
    _check(x.dim() >= 1, f"{name}: expected at least 1 dimension, got a scalar")
    if x.dim() == 2 and x.stride(1) == 1:
        return x
    # reshape is a view for contiguous tensors; other layouts are copied once, which is always correct.
    return x.reshape(-1, x.shape[-1]) if x.is_contiguous() else x.contiguous().reshape(-1, x.shape[-1])


def decode_shared_bytes(group_size: int, head_dim: int, threads: int) -> int:
    """Dynamic shared memory of paged_decode_attention_kernel (layout in decode_attention.cu)."""
    return 4 * threads + 4 * (2 * group_size * head_dim + group_size * threads + 3 * group_size)


def prefill_tile_keys(head_dim: int) -> int:
    """Keys per shared-memory tile of paged_prefill_attention_kernel (PrefillTile<HEAD_DIM>::kKeys)."""
    return min(64, max(16, 4096 // head_dim))


def prefill_shared_bytes(head_dim: int) -> int:
    """Dynamic shared memory of paged_prefill_attention_kernel (layout in prefill_attention.cu)."""
    keys = prefill_tile_keys(head_dim)
    rows = _PREFILL_ROWS
    return 4 * (rows * (head_dim + 1) + keys * (head_dim + 1) + keys * head_dim + rows * (keys + 1))


class CudaOps(Ops):
    """`Ops` on the kernels in kernels/; `launcher` defaults to CuPy on the current CUDA device.

    decode_partition_size: context tokens per split-K partition of decode attention (a multiple of
    decode_threads); contexts longer than one partition are split across thread blocks and reduced.
    """

    name = "cuda"

    def __init__(
        self,
        launcher: KernelLauncher | None = None,
        *,
        decode_partition_size: int = 512,
        decode_threads: int = 128,
        sampling_threads: int = 1024,
    ) -> None:
        _check(
            decode_threads % 32 == 0 and 32 <= decode_threads <= 1024,
            f"decode_threads: must be a multiple of 32 in [32, 1024], got {decode_threads}",
        )
        _check(
            decode_partition_size > 0 and decode_partition_size % decode_threads == 0,
            f"decode_partition_size: must be a positive multiple of decode_threads ({decode_threads}), "
            f"got {decode_partition_size}",
        )
        _check(
            sampling_threads % 32 == 0 and 32 <= sampling_threads <= 1024,
            f"sampling_threads: must be a multiple of 32 in [32, 1024], got {sampling_threads}",
        )
        self._launcher = launcher if launcher is not None else CupyLauncher()
        self.decode_partition_size = decode_partition_size
        self.decode_threads = decode_threads
        self.sampling_threads = sampling_threads

    def _launch(
        self,
        kernel: KernelRef,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[KernelArg],
        shared_mem: int = 0,
    ) -> None:
        self._launcher.launch(kernel, grid, block, args, shared_mem)

    # ---- normalisation and activation --------------------------------------------------------------

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = _as_rows("x", x)
        hidden = rows.shape[1]
        self._check_norm_weight(weight, hidden, x.dtype)
        out = torch.empty((rows.shape[0], hidden), dtype=x.dtype, device=x.device)
        if out.numel() == 0:
            return out.view(x.shape)
        vec = _pack_elems(x.dtype)
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
        _check(
            x.shape == residual.shape,
            f"residual: shape {tuple(residual.shape)} differs from x {tuple(x.shape)}",
        )
        _check_dtype("residual", residual, x.dtype)
        rows = _as_rows("x", x)
        res_rows = _as_rows("residual", residual)
        if res_rows.stride(0) != rows.stride(0):
            # The kernel walks x and residual with one row stride.
            rows, res_rows = rows.contiguous(), res_rows.contiguous()
        hidden = rows.shape[1]
        self._check_norm_weight(weight, hidden, x.dtype)
        out = torch.empty((rows.shape[0], hidden), dtype=x.dtype, device=x.device)
        summed = torch.empty_like(out)
        if out.numel() == 0:
            return out.view(x.shape), summed.view(x.shape)
        vec = _pack_elems(x.dtype)
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

    @staticmethod
    def _check_norm_weight(weight: torch.Tensor, hidden: int, dtype: torch.dtype) -> None:
        _check(
            weight.dim() == 1 and weight.shape[0] == hidden,
            f"weight: expected shape ({hidden},), got {tuple(weight.shape)}",
        )
        _check(weight.is_contiguous(), "weight: must be contiguous")
        _check_dtype("weight", weight, dtype)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        rows = _as_rows("x", x)
        _check(rows.shape[1] % 2 == 0, f"x: last dimension must be even (gate | up), got {rows.shape[1]}")
        inter = rows.shape[1] // 2
        out = torch.empty((rows.shape[0], inter), dtype=x.dtype, device=x.device)
        if out.numel() == 0:
            return out.view(*x.shape[:-1], inter)
        vec = _pack_elems(x.dtype)
        vectorized = inter % vec == 0 and rows.stride(0) % vec == 0 and _aligned(rows, out)
        per_thread = vec if vectorized else 1
        threads = _threads_for(min(256, math.ceil(inter / per_thread)))
        grid_y = math.ceil(inter / (threads * per_thread))
        self._launch(
            kl.silu_and_mul_kernel(x.dtype),
            (rows.shape[0], grid_y, 1),
            (threads, 1, 1),
            [out, rows, np.int32(inter), np.int64(rows.stride(0)), np.int64(inter), np.int32(vectorized)],
        )
        return out.view(*x.shape[:-1], inter)

    # ---- rotary embedding and KV cache ---------------------------------------------------------------

    def rotary_embedding(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
    ) -> None:
        _check(
            q.dim() == 3 and k.dim() == 3, f"q, k: expected [T, H, D], got {tuple(q.shape)}, {tuple(k.shape)}"
        )
        num_tokens, num_q_heads, head_dim = q.shape
        _check(
            k.shape[0] == num_tokens and k.shape[2] == head_dim,
            f"k: shape {tuple(k.shape)} does not match q {tuple(q.shape)} in tokens and head_dim",
        )
        _check(head_dim % 2 == 0, f"q: head_dim must be even, got {head_dim}")
        _check_dtype("k", k, q.dtype)
        for name, t in (("q", q), ("k", k)):
            # Rotated in place, so the layout cannot be fixed by a copy.
            _check(
                t.stride(2) == 1 and t.stride(1) == head_dim,
                f"{name}: heads must be contiguous (strides [*, {head_dim}, 1]), got {t.stride()}",
            )
        _check(
            positions.shape == (num_tokens,) and positions.dtype == torch.int64 and positions.is_contiguous(),
            f"positions: expected contiguous int64 [{num_tokens}], "
            f"got {positions.dtype} {tuple(positions.shape)}",
        )
        _check(
            cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == head_dim,
            f"cos_sin_cache: expected [max_positions, {head_dim}], got {tuple(cos_sin_cache.shape)}",
        )
        _check_dtype("cos_sin_cache", cos_sin_cache, torch.float32)
        _check(cos_sin_cache.is_contiguous(), "cos_sin_cache: must be contiguous")
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

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        self._check_cache(k_cache, v_cache)
        _, _, num_kv_heads, head_dim = k_cache.shape
        num_tokens = k.shape[0]
        for name, t in (("k", k), ("v", v)):
            _check(
                t.dim() == 3 and t.shape == (num_tokens, num_kv_heads, head_dim),
                f"{name}: expected [{num_tokens}, {num_kv_heads}, {head_dim}], got {tuple(t.shape)}",
            )
            _check_dtype(name, t, k_cache.dtype)
            _check(
                t.stride(2) == 1 and t.stride(1) == head_dim,
                f"{name}: heads must be contiguous (strides [*, {head_dim}, 1]), got {t.stride()}",
            )
        _check(
            slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64,
            f"slot_mapping: expected int64 [{num_tokens}], "
            f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}",
        )
        _check(slot_mapping.is_contiguous(), "slot_mapping: must be contiguous")
        if num_tokens == 0:
            return
        row = num_kv_heads * head_dim
        vec = _pack_elems(k.dtype)
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

    @staticmethod
    def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        _check(
            k_cache.dim() == 4,
            f"k_cache: expected [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(k_cache.shape)}",
        )
        _check(v_cache.shape == k_cache.shape, f"v_cache: shape {tuple(v_cache.shape)} differs from k_cache")
        _check_dtype("v_cache", v_cache, k_cache.dtype)
        _check(k_cache.is_contiguous() and v_cache.is_contiguous(), "k_cache, v_cache: must be contiguous")
        block_size, head_dim = k_cache.shape[1], k_cache.shape[3]
        _check(
            block_size > 0 and block_size & (block_size - 1) == 0,
            f"k_cache: block_size must be a power of two, got {block_size}",
        )
        vec = _pack_elems(k_cache.dtype)
        _check(head_dim % vec == 0, f"k_cache: head_dim must be a multiple of {vec} for {k_cache.dtype}")

    # ---- attention -------------------------------------------------------------------------------------

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        self._check_cache(k_cache, v_cache)
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        _check(
            q.dim() == 3 and q.shape[2] == head_dim, f"q: expected [T, Hq, {head_dim}], got {tuple(q.shape)}"
        )
        _check_dtype("q", q, k_cache.dtype)
        _check(
            q.stride(2) == 1 and q.stride(1) == head_dim,
            f"q: heads must be contiguous, got strides {q.stride()}",
        )
        num_heads = q.shape[1]
        _check(
            num_heads % num_kv_heads == 0,
            f"q: {num_heads} heads is not a multiple of the cache's {num_kv_heads} KV heads",
        )
        _check(
            meta.block_size == block_size,
            f"meta.block_size: {meta.block_size} != cache block size {block_size}",
        )
        num_seqs = meta.num_seqs
        _check(
            meta.seq_lens.shape == (num_seqs,) and meta.seq_lens.dtype == torch.int32,
            f"meta.seq_lens: expected int32 [{num_seqs}], "
            f"got {meta.seq_lens.dtype} {tuple(meta.seq_lens.shape)}",
        )
        _check(
            meta.block_tables.dim() == 2 and meta.block_tables.shape[0] == num_seqs,
            f"meta.block_tables: expected [{num_seqs}, max_blocks], got {tuple(meta.block_tables.shape)}",
        )
        _check_dtype("meta.block_tables", meta.block_tables, torch.int32)
        _check(meta.block_tables.stride(1) == 1, "meta.block_tables: rows must be contiguous")
        _check(meta.seq_lens.is_contiguous(), "meta.seq_lens: must be contiguous")
        _check(
            sum(meta.query_lens_cpu) == q.shape[0],
            f"q: {q.shape[0]} tokens but meta.query_lens_cpu sums to {sum(meta.query_lens_cpu)}",
        )
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if num_seqs == 0 or q.shape[0] == 0:
            return out
        group = num_heads // num_kv_heads
        log2_block = block_size.bit_length() - 1
        if meta.is_decode_only:
            self._decode_attention(out, q, k_cache, v_cache, meta, scale, num_kv_heads, group, log2_block)
        else:
            self._prefill_attention(out, q, k_cache, v_cache, meta, scale, num_kv_heads, group, log2_block)
        return out

    def _decode_attention(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        num_kv_heads: int,
        group: int,
        log2_block: int,
    ) -> None:
        num_seqs, num_heads, head_dim = q.shape
        # The grid follows the host copy of the lengths (under CUDA graph capture: the longest allowed
        # context); partitions past a sequence's real end exit at once.
        partitions = max(1, math.ceil(meta.max_seq_len / self.decode_partition_size))
        threads = self.decode_threads
        if partitions > 1:
            partial_out = torch.empty(
                (num_seqs, num_heads, partitions, head_dim), dtype=torch.float32, device=q.device
            )
            partial_max = torch.empty((num_seqs, num_heads, partitions), dtype=torch.float32, device=q.device)
            partial_sum = torch.empty_like(partial_max)
        else:
            partial_out = partial_max = partial_sum = None
        self._launch(
            kl.decode_attention_kernel(q.dtype),
            (num_seqs, num_kv_heads, partitions),
            (threads, 1, 1),
            [
                out,
                np.int64(out.stride(0)),
                partial_out,
                partial_max,
                partial_sum,
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
                np.int32(self.decode_partition_size),
            ],
            decode_shared_bytes(group, head_dim, threads),
        )
        if partitions > 1:
            self._launch(
                kl.decode_reduce_kernel(q.dtype),
                (num_seqs, num_heads, 1),
                (_threads_for(head_dim), 1, 1),
                [
                    out,
                    np.int64(out.stride(0)),
                    partial_out,
                    partial_max,
                    partial_sum,
                    meta.seq_lens,
                    np.int32(head_dim),
                    np.int32(partitions),
                    np.int32(self.decode_partition_size),
                ],
            )

    def _prefill_attention(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        num_kv_heads: int,
        group: int,
        log2_block: int,
    ) -> None:
        num_heads, head_dim = q.shape[1], q.shape[2]
        _check(
            meta.query_start_loc.shape == (meta.num_seqs + 1,) and meta.query_start_loc.dtype == torch.int32,
            f"meta.query_start_loc: expected int32 [{meta.num_seqs + 1}], got "
            f"{meta.query_start_loc.dtype} {tuple(meta.query_start_loc.shape)}",
        )
        _check(
            head_dim % 8 == 0, f"q: head_dim must be a multiple of 8 for prefill attention, got {head_dim}"
        )
        self._launch(
            kl.prefill_attention_kernel(q.dtype, head_dim),
            (math.ceil(meta.max_query_len / _PREFILL_ROWS), meta.num_seqs, num_heads),
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
            ],
            prefill_shared_bytes(head_dim),
        )

    # ---- sampling ------------------------------------------------------------------------------------

    def sample(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
        uniform: torch.Tensor,
    ) -> torch.Tensor:
        """Token ids [B] int64 drawn from logits [B, V] float32 with per-row parameters (sampling.cu).

        temperature <= 0 is greedy; top_k <= 0 or >= V, top_p >= 1 and min_p <= 0 disable those filters;
        uniform [B] in [0, 1) is the row's random draw (the caller seeds it per request).
        """
        _check(logits.dim() == 2, f"logits: expected [B, V], got {tuple(logits.shape)}")
        _check_dtype("logits", logits, torch.float32)
        _check(logits.stride(1) == 1, "logits: rows must be contiguous")
        rows = logits.shape[0]
        _check(logits.shape[1] < 2**24, f"logits: vocabulary of {logits.shape[1]} exceeds 2^24")
        for name, t, dtype in (
            ("temperature", temperature, torch.float32),
            ("top_k", top_k, torch.int32),
            ("top_p", top_p, torch.float32),
            ("min_p", min_p, torch.float32),
            ("uniform", uniform, torch.float32),
        ):
            _check(t.shape == (rows,), f"{name}: expected shape ({rows},), got {tuple(t.shape)}")
            _check_dtype(name, t, dtype)
            _check(t.is_contiguous(), f"{name}: must be contiguous")
        ids = torch.empty(rows, dtype=torch.int64, device=logits.device)
        if rows == 0:
            return ids
        _check(logits.shape[1] > 0, "logits: vocabulary must not be empty")
        self._launch(
            kl.SAMPLE_KERNEL,
            (rows, 1, 1),
            (self.sampling_threads, 1, 1),
            [
                ids,
                logits,
                np.int64(logits.stride(0)),
                np.int32(logits.shape[1]),
                temperature,
                top_k,
                top_p,
                min_p,
                uniform,
            ],
        )
        return ids


@functools.cache
def _cupy_function(kernel: KernelRef) -> object:
    """Compile one specialisation with NVRTC (once per process; CuPy also caches on disk)."""
    import cupy

    module = cupy.RawModule(
        code=kl.compile_unit(kernel.source), options=_nvrtc_options(), name_expressions=(kernel.name,)
    )
    return module.get_function(kernel.name)


def _nvrtc_options() -> tuple[str, ...]:
    """NVRTC flags: kernels/ on the include path; no toolkit headers are needed (see dtypes.cuh)."""
    return ("-std=c++17", f"-I{kl.kernels_dir()}")


class CupyLauncher:
    """Launches kernels with CuPy on torch's current CUDA stream; tensors go zero-copy through DLPack."""

    def __init__(self) -> None:
        try:
            import cupy
        except ImportError as exc:
            raise RuntimeError(
                "the cuda ops backend needs CuPy: install the engine with the cuda12 or cuda13 extra"
            ) from exc
        self._cupy = cupy
        self._streams: dict[int, object] = {}

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
        # CuPy's current stream becomes torch's, so the DLPack hand-over needs no synchronisation and the
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
            # detach(): model weights are nn.Parameters, which DLPack refuses to export while they
            # require grad; the view shares their memory.
            return self._cupy.from_dlpack(arg.detach())
        if arg is None:
            return np.uint64(0)  # a null pointer: same size as a device pointer
        return arg
