"""Where the CUDA kernel sources live, how each kernel specialisation is named, and the launcher protocol.

The kernels in kernels/*.cu are templates; a specialisation is named by a C++ name expression such as
`rms_norm_kernel<conduit::f16>`. The same `KernelRef` is compiled by CuPy/NVRTC on a GPU (ops/cuda_ops.py), by
nvcc in the compile checks and by g++ against kernels/emulation/cuda_emu.h in the CPU emulation tests, so
every backend runs exactly the same source. Nothing here imports CuPy.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np
import torch

# Scalars are passed as NumPy scalars so their C type is explicit (int vs long long vs float); tensors
# by pointer; None as a null pointer (buffers a kernel does not touch in that configuration).
KernelArg = torch.Tensor | np.int32 | np.int64 | np.float32 | None

KERNEL_SOURCES = (
    "norm.cu",
    "rotary.cu",
    "activation.cu",
    "cache.cu",
    "decode_attention.cu",
    "prefill_attention.cu",
    "bitmask.cu",
    "kv_transfer.cu",
    "int8_gemm.cu",
    "lora.cu",
)

_CTYPES = {torch.float32: "float", torch.float16: "conduit::f16", torch.bfloat16: "conduit::bf16"}


class KernelRef(NamedTuple):
    """One kernel specialisation: the source file under kernels/ and its C++ name expression."""

    source: str
    name: str


class KernelLauncher(Protocol):
    """Runs one kernel specialisation with CUDA launch semantics (grid, block, dynamic shared memory)."""

    def launch(
        self,
        kernel: KernelRef,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[KernelArg],
        shared_mem: int = 0,
    ) -> None: ...


def kernels_dir() -> Path:
    """The kernels/ folder: $CONDUIT_KERNELS_DIR, else the repository's (the engine is installed editable)."""
    override = os.environ.get("CONDUIT_KERNELS_DIR")
    path = Path(override) if override else Path(__file__).resolve().parents[5] / "kernels"
    if not (path / "common.cuh").is_file():
        raise FileNotFoundError(
            f"CUDA kernel sources not found in {path}: "
            "set CONDUIT_KERNELS_DIR to the repository's kernels/ folder"
        )
    return path


def read_source(source: str) -> str:
    """Text of kernels/<source>; `source` must be one of KERNEL_SOURCES."""
    if source not in KERNEL_SOURCES:
        raise ValueError(f"unknown kernel source {source!r}: expected one of {', '.join(KERNEL_SOURCES)}")
    return (kernels_dir() / source).read_text()


def compile_unit(source: str) -> str:
    """Source text to hand to NVRTC: kernels/<source> behind a digest of the shared headers, so that a
    compile cache keyed by the source text (CuPy's on-disk cache) misses when only a header changed."""
    headers = hashlib.sha256()
    for path in sorted(kernels_dir().glob("*.cuh")):
        headers.update(path.name.encode() + path.read_bytes())
    return f"// conduit kernel headers {headers.hexdigest()[:16]}\n" + read_source(source)


def ctype(dtype: torch.dtype) -> str:
    """C++ element type of a torch dtype in the kernels (float, conduit::f16, conduit::bf16: dtypes.cuh)."""
    try:
        return _CTYPES[dtype]
    except KeyError:
        raise ValueError(
            f"dtype {dtype} is not supported by the CUDA kernels: use float32, float16 or bfloat16"
        ) from None


def rms_norm_kernel(dtype: torch.dtype) -> KernelRef:
    return KernelRef("norm.cu", f"rms_norm_kernel<{ctype(dtype)}>")


def add_rms_norm_kernel(dtype: torch.dtype) -> KernelRef:
    return KernelRef("norm.cu", f"add_rms_norm_kernel<{ctype(dtype)}>")


def rotary_kernel(dtype: torch.dtype) -> KernelRef:
    return KernelRef("rotary.cu", f"rotary_embedding_kernel<{ctype(dtype)}>")


def rotary_write_kv_kernel(dtype: torch.dtype) -> KernelRef:
    return KernelRef("rotary.cu", f"rotary_write_kv_kernel<{ctype(dtype)}>")


def silu_and_mul_kernel(dtype: torch.dtype) -> KernelRef:
    return KernelRef("activation.cu", f"silu_and_mul_kernel<{ctype(dtype)}>")


def gelu_tanh_and_mul_kernel(dtype: torch.dtype) -> KernelRef:
    return KernelRef("activation.cu", f"gelu_tanh_and_mul_kernel<{ctype(dtype)}>")


def write_kv_kernel(dtype: torch.dtype) -> KernelRef:
    return KernelRef("cache.cu", f"write_kv_kernel<{ctype(dtype)}>")


# Quantized KV cache formats (kernels/kv_quant.cuh) by cache dtype; 0 is the compute dtype.
KV_FORMATS = {torch.int8: 1, torch.float8_e4m3fn: 2}


def kv_format(cache_dtype: torch.dtype) -> int:
    return KV_FORMATS.get(cache_dtype, 0)


def write_kv_quant_kernel(dtype: torch.dtype, cache_dtype: torch.dtype) -> KernelRef:
    """The quantizing cache write: k/v of `dtype` into an int8 or fp8 cache."""
    return KernelRef("cache.cu", f"write_kv_quant_kernel<{ctype(dtype)}, {KV_FORMATS[cache_dtype]}>")


DECODE_VARIANTS = ((1, 1), (1, 2), (1, 4), (1, 8), (2, 1), (2, 2), (2, 4))  # (chunks, group) specialised


def decode_attention_kernel(dtype: torch.dtype, chunks: int = 1, group: int = 8, kv: int = 0) -> KernelRef:
    """`chunks`: 16-byte chunks of a K/V row per lane (1 up to 32 chunks a row, 2 up to 64); `group`:
    query heads per pass over the KV (a power of two, group x chunks <= 8); `kv`: the cache's format
    (`kv_format`: 0 the compute dtype, 1 int8, 2 fp8)."""
    if (chunks, group) not in DECODE_VARIANTS:
        raise ValueError(f"no decode attention kernel for chunks={chunks}, group={group}")
    name = f"paged_decode_attention_kernel<{ctype(dtype)}, {chunks}, {group}>"
    if kv:
        name = f"paged_decode_attention_kernel<{ctype(dtype)}, {chunks}, {group}, {kv}>"
    return KernelRef("decode_attention.cu", name)


def prefill_attention_kernel(dtype: torch.dtype, head_dim: int, kv: int = 0) -> KernelRef:
    """The float32-arithmetic prefill kernel; `kv` as for decode_attention_kernel."""
    if kv:
        return KernelRef(
            "prefill_attention.cu", f"paged_prefill_attention_kernel<{ctype(dtype)}, {head_dim}, {kv}>"
        )
    return KernelRef("prefill_attention.cu", f"paged_prefill_attention_kernel<{ctype(dtype)}, {head_dim}>")


def prefill_attention_mma_kernel(dtype: torch.dtype, head_dim: int) -> KernelRef:
    """The tensor-core prefill kernel: float16/bfloat16, head_dim a multiple of 16."""
    return KernelRef(
        "prefill_attention.cu", f"paged_prefill_attention_mma_kernel<{ctype(dtype)}, {head_dim}>"
    )


APPLY_TOKEN_BITMASK_KERNEL = KernelRef("bitmask.cu", "apply_token_bitmask_kernel")


def _block_ctype(dtype: torch.dtype) -> str:
    """Element type of whole-block copies: a quantized cache (codes and scales) moves as bytes."""
    return "unsigned char" if dtype in KV_FORMATS else ctype(dtype)


def gather_kv_blocks_kernel(dtype: torch.dtype) -> KernelRef:
    return KernelRef("kv_transfer.cu", f"gather_kv_blocks_kernel<{_block_ctype(dtype)}>")


def scatter_kv_blocks_kernel(dtype: torch.dtype) -> KernelRef:
    return KernelRef("kv_transfer.cu", f"scatter_kv_blocks_kernel<{_block_ctype(dtype)}>")


def quantize_rows_int8_kernel(dtype: torch.dtype) -> KernelRef:
    return KernelRef("int8_gemm.cu", f"quantize_rows_int8_kernel<{ctype(dtype)}>")


def int8_gemm_kernel(dtype: torch.dtype) -> KernelRef:
    """The int8 tensor-core GEMM (mma.sync m16n8k32 s8) of `--quantization int8`, output in `dtype`."""
    return KernelRef("int8_gemm.cu", f"int8_gemm_mma_kernel<{ctype(dtype)}>")


def lora_shrink_kernel(dtype: torch.dtype) -> KernelRef:
    return KernelRef("lora.cu", f"lora_shrink_kernel<{ctype(dtype)}>")


def lora_expand_kernel(dtype: torch.dtype) -> KernelRef:
    return KernelRef("lora.cu", f"lora_expand_kernel<{ctype(dtype)}>")


def all_specializations(dtypes: Sequence[torch.dtype], head_dims: Sequence[int]) -> list[KernelRef]:
    """Every specialisation the CUDA ops may launch for these model dtypes and head sizes."""
    refs: list[KernelRef] = []
    for dtype in dtypes:
        refs += [
            rms_norm_kernel(dtype),
            add_rms_norm_kernel(dtype),
            rotary_kernel(dtype),
            rotary_write_kv_kernel(dtype),
            silu_and_mul_kernel(dtype),
            gelu_tanh_and_mul_kernel(dtype),
            write_kv_kernel(dtype),
            *(decode_attention_kernel(dtype, chunks, group) for chunks, group in DECODE_VARIANTS),
            gather_kv_blocks_kernel(dtype),
            scatter_kv_blocks_kernel(dtype),
            quantize_rows_int8_kernel(dtype),
            int8_gemm_kernel(dtype),
            lora_shrink_kernel(dtype),
            lora_expand_kernel(dtype),
        ]
        refs += [prefill_attention_kernel(dtype, head_dim) for head_dim in head_dims]
        for cache_dtype, kv in KV_FORMATS.items():  # --kv-cache-dtype int8 | fp8
            refs.append(write_kv_quant_kernel(dtype, cache_dtype))
            refs += [decode_attention_kernel(dtype, chunks, group, kv) for chunks, group in DECODE_VARIANTS]
            refs += [prefill_attention_kernel(dtype, head_dim, kv) for head_dim in head_dims]
        if dtype in (torch.float16, torch.bfloat16):
            refs += [prefill_attention_mma_kernel(dtype, hd) for hd in head_dims if hd % 16 == 0]
    refs.append(APPLY_TOKEN_BITMASK_KERNEL)
    refs += [gather_kv_blocks_kernel(torch.int8), scatter_kv_blocks_kernel(torch.int8)]
    return refs
