"""Launch geometry of the attention kernels (kernels/decode_attention.cu, kernels/prefill_attention.cu):
rows and keys per block, dynamic shared memory, and decode's lane chunks, head passes and split-K. Each
constant mirrors one in the kernel source named beside it."""

from __future__ import annotations

import math

from conduit_engine.ops.cuda_checks import check

PREFILL_ROWS = 16  # query rows per prefill block (kPrefillRows)
MMA_PREFILL_ROWS = 64  # query rows per tensor-core prefill block (kMmaRows: 4 warps x 16)
_DECODE_GROUP_CHUNK = 8  # query heads per pass over the KV (kDecodeGroupChunk in decode_attention.cu)
_DECODE_MIN_PARTITION = 256  # the automatic split-K never cuts a context finer than this
_DECODE_BLOCKS_PER_SM = 8  # the automatic split-K aims at this many blocks per SM
DEFAULT_SM_COUNT = 16  # a launcher that does not say (the CPU emulation)


def decode_lane_chunks(head_dim: int, element_size: int) -> int:
    """16-byte chunks of a K/V row each lane reads in paged_decode_attention_kernel (its CHUNKS)."""
    row_chunks = head_dim * element_size // 16
    check(
        row_chunks <= 64,
        f"q: head_dim {head_dim} is over the decode kernel's {64 * 16 // element_size} for this dtype",
    )
    return 1 if row_chunks <= 32 else 2


def decode_pass_heads(group_size: int, chunks: int) -> int:
    """Query heads per pass of paged_decode_attention_kernel (its GROUP): the power of two covering
    the group, at most _DECODE_GROUP_CHUNK / chunks (larger groups take several passes)."""
    heads = 1
    while heads < group_size and heads * chunks < _DECODE_GROUP_CHUNK:
        heads *= 2
    return heads


def decode_shared_bytes(group_size: int, head_dim: int, threads: int, element_size: int = 2) -> int:
    """Dynamic shared memory of paged_decode_attention_kernel: each warp's merged state per head of a
    pass (layout in decode_attention.cu)."""
    heads = decode_pass_heads(group_size, decode_lane_chunks(head_dim, element_size))
    return 4 * (threads // 32) * heads * (head_dim + 2)


def auto_decode_partition(visible: int, blocks: int, sm_count: int, threads: int) -> int:
    """Split-K partition size for `blocks` (sequences x KV heads) over `visible` tokens: enough
    partitions for _DECODE_BLOCKS_PER_SM blocks per SM, none shorter than _DECODE_MIN_PARTITION tokens,
    a multiple of `threads`."""
    wanted = max(1, math.ceil(_DECODE_BLOCKS_PER_SM * sm_count / max(1, blocks)))
    partitions = max(1, min(wanted, visible // _DECODE_MIN_PARTITION))
    return -(-math.ceil(visible / partitions) // threads) * threads


def prefill_tile_keys(head_dim: int) -> int:
    """Keys per shared-memory tile of paged_prefill_attention_kernel (PrefillTile<HEAD_DIM>::kKeys)."""
    return min(64, max(16, 4096 // head_dim))


def prefill_shared_bytes(head_dim: int) -> int:
    """Dynamic shared memory of paged_prefill_attention_kernel (layout in prefill_attention.cu)."""
    keys = prefill_tile_keys(head_dim)
    rows = PREFILL_ROWS
    return 4 * (rows * (head_dim + 1) + keys * (head_dim + 1) + keys * head_dim + rows * (keys + 1))


def prefill_mma_tile_keys(head_dim: int) -> int:
    """Keys per tile of paged_prefill_attention_mma_kernel (MmaPrefillTile<HEAD_DIM>::kKeys)."""
    return 64 if head_dim <= 128 else 32


def prefill_mma_shared_bytes(head_dim: int) -> int:
    """Dynamic shared memory of paged_prefill_attention_mma_kernel: Q and K tiles row-major, V transposed,
    16-bit elements, rows padded by 8 (layout in prefill_attention.cu)."""
    keys = prefill_mma_tile_keys(head_dim)
    return 2 * ((MMA_PREFILL_ROWS + keys) * (head_dim + 8) + head_dim * (keys + 8))
