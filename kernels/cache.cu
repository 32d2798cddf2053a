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
#include "kv_quant.cuh"

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

// write_kv into a quantized cache (kv_quant.cuh): each (token, K or V, kv head) row quantized by one
// thread. Grid: one block per token. Block: any size; threads stride over the 2 * num_kv_heads rows.
// `KV` is kKvInt8 or kKvFp8; the caches are bytes [num_blocks, block_size, num_kv_heads, head_dim + 2].
template <typename T, int KV>
__global__ void write_kv_quant_kernel(const T* __restrict__ key, const T* __restrict__ value,
                                      unsigned char* __restrict__ k_cache, unsigned char* __restrict__ v_cache,
                                      const long long* __restrict__ slot_mapping, int num_kv_heads, int head_dim,
                                      long long key_token_stride, long long value_token_stride) {
  using namespace conduit;
  const long long slot = slot_mapping[blockIdx.x];
  if (slot < 0) return;
  for (int r = threadIdx.x; r < 2 * num_kv_heads; r += blockDim.x) {
    const bool is_v = r >= num_kv_heads;
    const int head = is_v ? r - num_kv_heads : r;
    const T* src = (is_v ? value + blockIdx.x * value_token_stride : key + blockIdx.x * key_token_stride) +
                   head * head_dim;
    unsigned char* dst = const_cast<unsigned char*>(kv_row(is_v ? v_cache : k_cache, slot, num_kv_heads, head, head_dim));
    kv_quantize_row<KV>(src, dst, head_dim);
  }
}
