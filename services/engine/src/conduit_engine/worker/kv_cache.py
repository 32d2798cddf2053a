"""The paged KV cache of a model runner: how many blocks the memory budget allows (one place, for the
in-process and the multi-process executor) and the cache tensors themselves.

On the CPU the cache is anonymous memory (an mmap): zeroed pages the kernel maps lazily, so a large cache
costs nothing at start-up (a page is touched only when a block on it is first written), and page-aligned,
so the kernels' vector loads never straddle cache lines (numpy's calloc is only 16-byte aligned). A
background thread then has the kernel map every page (madvise MADV_POPULATE_WRITE, in chunks, the GIL
released): a page first written by a step would cost that step a fault (on this VM, about 8% of the 110M
model's decode speed while the cache is fresh), and populating never changes what a page holds, so it
runs safely beside the steps. With --kv-transport shm the in-process cache is shared memory instead (one
memfd, kv_transfer.shm_cache), the same lazily mapped zero pages, that same-host pullers copy from."""

from __future__ import annotations

import logging
import math
import mmap
import os
import threading

import torch

from conduit_engine import page_populate
from conduit_engine.config import EngineConfig
from conduit_engine.kv_format import kv_element_dtype, kv_head_bytes
from conduit_engine.kv_transfer.shm_cache import SharedKvCacheFile
from conduit_engine.layers.decoder import KVCache
from conduit_engine.models.config import ArchConfig
from conduit_engine.models.facts import ModelFacts

log = logging.getLogger(__name__)

# Auto-sized caches hold at most this many full batches of full-length sequences.
_MAX_AUTO_BLOCKS_FACTOR = 2


def kv_block_bytes(arch: ArchConfig, block_size: int, dtype: str, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one KV block over all layers (keys and values) of `arch`'s KV heads, in the compute
    `dtype` or quantized (`kv_cache_dtype` int8/fp8: a byte per value plus each row's scale)."""
    head = kv_head_bytes(kv_element_dtype(dtype, kv_cache_dtype), arch.head_dim)
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * head


def host_kv_budget(config: EngineConfig) -> int:
    """Bytes of host memory the KV cache may take (--kv-cache-memory-fraction of the total)."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * config.cache.memory_fraction)


def num_kv_blocks(config: EngineConfig, max_len: int, affordable: int) -> int:
    """--kv-cache-blocks, or the `affordable` blocks of the memory budget, capped so an idle cache is not
    absurdly large (and never below one full-length sequence)."""
    cache = config.cache
    if cache.num_blocks is not None:
        return cache.num_blocks
    per_seq = (max_len + cache.block_size - 1) // cache.block_size
    cap = _MAX_AUTO_BLOCKS_FACTOR * config.scheduler.max_num_seqs * per_seq
    return max(per_seq, min(affordable, cap))


def size_kv_cache(
    config: EngineConfig, facts: ModelFacts, local: ArchConfig, world_size: int, free_device: list[int | None]
) -> int:
    """Blocks every rank can hold, each rank's cache over `local`'s KV heads: on CUDA the least free device
    memory of `free_device` (one entry per rank, after loading), on the CPU the host budget shared by all
    ranks' shards."""
    per_rank = kv_block_bytes(local, config.cache.block_size, facts.dtype, config.cache.kv_cache_dtype)
    if config.model.device == "cuda":
        free = min(int(b) for b in free_device if b is not None)
        affordable = int(free * config.cache.memory_fraction) // per_rank
    else:
        affordable = host_kv_budget(config) // (per_rank * world_size)
    return num_kv_blocks(config, facts.max_model_len, affordable)


def allocate_kv_caches(
    num_layers: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    shared: SharedKvCacheFile | None = None,
) -> list[KVCache]:
    """One zeroed (keys, values) pair of `shape` per layer; host pages are mapped on first write. On the
    host with `shared` (2 regions per layer of the pair's bytes), the tensors are its regions: the cache
    same-host pullers copy from directly (kv_transfer.shm_cache)."""
    if device.type != "cpu":
        return [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buffers = iter(shared.buffers) if shared is not None else None

    def zeros() -> torch.Tensor:
        # The tensor keeps the mapping alive; the pages stay unmapped until written.
        buffer = next(buffers) if buffers is not None else mmap.mmap(-1, nbytes)
        return torch.frombuffer(buffer, dtype=dtype).view(shape)

    return [(zeros(), zeros()) for _ in range(num_layers)]


def shared_kv_cache_file(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype) -> SharedKvCacheFile:
    """The memfd a shared host cache of `num_layers` (keys, values) pairs of `shape` lives in."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return SharedKvCacheFile(2 * num_layers, nbytes)


def populate_in_background(caches: list[KVCache]) -> threading.Thread | None:
    """Map every page of host `caches` from a daemon thread (None on a device, or without madvise)."""
    ranges = [
        (t.data_ptr(), t.numel() * t.element_size())
        for pair in caches
        for t in pair
        if t.device.type == "cpu"
    ]
    return page_populate.populate_in_background(
        ranges, page_populate.MADV_POPULATE_WRITE, "kv-cache-populate"
    )
