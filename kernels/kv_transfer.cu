// gather_kv_blocks / scatter_kv_blocks: copy whole KV blocks of every layer between the paged caches and
// one contiguous transfer buffer (prefill/decode disaggregation: the buffer is a KvChunk's payload).
//
// Layout: the cache is 2 * num_layers tensors [num_cache_blocks, block_size, num_kv_heads, head_dim], each
// contiguous, named by `cache_ptrs` [2 * num_layers] int64 device addresses in the order layer 0 K,
// layer 0 V, layer 1 K, ... A block is `block_elems` = block_size * num_kv_heads * head_dim consecutive
// elements. The buffer is [num_layers][k, v][num_blocks][block_size][num_kv_heads][head_dim] contiguous,
// so cache c's copy of transfer block j starts at (c * num_blocks + j) * block_elems. block_ids
// [num_blocks] int64 gives the cache block of each transfer block, in any order (a scatter's ids must be
// distinct, or two thread blocks race on one cache block).
// Grid: (num_blocks, 2 * num_layers): one thread block copies one block of one cache. Block: any size;
// threads stride over the block in 16-byte packs when `vectorized` != 0 (block_elems a multiple of
// 16 / sizeof(T); buffer and every cache 16-byte aligned), else element by element.
// Limits: 2 * num_layers <= 65535 (grid.y); block_elems < 2^31; block ids must lie inside the caches
// (ops/cuda_ops.py checks them before the launch).
#include "common.cuh"

namespace conduit {

template <typename T>
__device__ __forceinline__ void copy_kv_block(T* __restrict__ dst, const T* __restrict__ src, int block_elems,
                                              int vectorized) {
  if (vectorized) {
    constexpr int V = Pack<T>::kSize;
    for (int i = threadIdx.x * V; i < block_elems; i += blockDim.x * V) store_pack(dst + i, load_pack(src + i));
  } else {
    for (int i = threadIdx.x; i < block_elems; i += blockDim.x) dst[i] = src[i];
  }
}

// Start of cache `cache`'s block `block_id`: the address table holds raw device pointers.
template <typename T>
__device__ __forceinline__ T* cache_block(const long long* __restrict__ cache_ptrs, int cache, long long block_id,
                                          int block_elems) {
  return reinterpret_cast<T*>(cache_ptrs[cache]) + block_id * block_elems;
}

}  // namespace conduit

template <typename T>
__global__ void gather_kv_blocks_kernel(T* __restrict__ buffer, const long long* __restrict__ cache_ptrs,
                                        const long long* __restrict__ block_ids, int num_blocks, int block_elems,
                                        int vectorized) {
  using namespace conduit;
  const int cache = blockIdx.y;
  const T* src = cache_block<T>(cache_ptrs, cache, block_ids[blockIdx.x], block_elems);
  T* dst = buffer + (static_cast<long long>(cache) * num_blocks + blockIdx.x) * block_elems;
  copy_kv_block(dst, src, block_elems, vectorized);
}

template <typename T>
__global__ void scatter_kv_blocks_kernel(const T* __restrict__ buffer, const long long* __restrict__ cache_ptrs,
                                         const long long* __restrict__ block_ids, int num_blocks, int block_elems,
                                         int vectorized) {
  using namespace conduit;
  const int cache = blockIdx.y;
  const T* src = buffer + (static_cast<long long>(cache) * num_blocks + blockIdx.x) * block_elems;
  T* dst = cache_block<T>(cache_ptrs, cache, block_ids[blockIdx.x], block_elems);
  copy_kv_block(dst, src, block_elems, vectorized);
}
