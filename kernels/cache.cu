// write_kv: store the new tokens' keys and values into the paged KV cache.
//
// Layout: key/value [num_tokens, num_kv_heads, head_dim] with unit stride inside a token's heads and
// `key_token_stride` / `value_token_stride` between tokens; k_cache/v_cache [num_blocks, block_size,
// num_kv_heads, head_dim] contiguous, so slot s = block * block_size + offset starts at s * row_elems
// with row_elems = num_kv_heads * head_dim. slot_mapping [num_tokens] int64; slot -1 means "do not store"
// (padding, or a token whose KV is already cached).
// Grid: one block per token. Block: any size; threads stride over the row in 16-byte packs when
// `vectorized` != 0 (row_elems and both token strides multiples of 16 / sizeof(T), aligned pointers).
// Limits: row_elems < 2^31; slots must lie inside the cache (the block manager's invariant).
#include "common.cuh"

template <typename T>
__global__ void write_kv_kernel(const T* __restrict__ key, const T* __restrict__ value, T* __restrict__ k_cache,
                                T* __restrict__ v_cache, const long long* __restrict__ slot_mapping, int row_elems,
                                long long key_token_stride, long long value_token_stride, int vectorized) {
  using namespace conduit;
  const long long slot = slot_mapping[blockIdx.x];
  if (slot < 0) return;
  const T* k_src = key + blockIdx.x * key_token_stride;
  const T* v_src = value + blockIdx.x * value_token_stride;
  T* k_dst = k_cache + slot * row_elems;
  T* v_dst = v_cache + slot * row_elems;
  if (vectorized) {
    constexpr int V = Pack<T>::kSize;
    for (int i = threadIdx.x * V; i < row_elems; i += blockDim.x * V) {
      store_pack(k_dst + i, load_pack(k_src + i));
      store_pack(v_dst + i, load_pack(v_src + i));
    }
  } else {
    for (int i = threadIdx.x; i < row_elems; i += blockDim.x) {
      k_dst[i] = k_src[i];
      v_dst[i] = v_src[i];
    }
  }
}
