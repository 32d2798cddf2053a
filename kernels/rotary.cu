// Rotary position embedding (rotate-half / NeoX convention), applied in place to q and k.
//
// Layout: q [num_tokens, num_q_heads, head_dim] and k [num_tokens, num_kv_heads, head_dim] with unit
// stride inside a head, `head_dim` between heads and `q_token_stride` / `k_token_stride` between tokens
// (so views into a fused qkv projection work). positions [num_tokens] int64. cos_sin_cache
// [max_positions, head_dim] float32: cos in [:, :head_dim/2], sin in [:, head_dim/2:]; Llama 3 style
// frequency scaling is baked into that cache by the caller.
// For each pair (x1 = x[i], x2 = x[i + head_dim/2]): x1' = x1*cos_i - x2*sin_i, x2' = x2*cos_i + x1*sin_i,
// computed in float32 and rounded to T.
// Grid: one block per token. Block: any size; threads stride over (head, i) pairs of q then k.
// Limits: head_dim even; positions must be < max_positions (checked by the wrapper on the host).
#include "common.cuh"

namespace conduit {
// One rotate-half pair of a head: reads src[i], src[i + half], writes the rotated values to dst (may be src).
template <typename T>
__device__ __forceinline__ void rotate_pair(const T* src, T* dst, int i, int half, float c, float s) {
  const float x1 = to_float(src[i]);
  const float x2 = to_float(src[i + half]);
  dst[i] = from_float<T>(x1 * c - x2 * s);
  dst[i + half] = from_float<T>(x2 * c + x1 * s);
}
}  // namespace conduit

template <typename T>
__global__ void rotary_embedding_kernel(T* q, T* k, const long long* __restrict__ positions,
                                        const float* __restrict__ cos_sin_cache, int num_q_heads,
                                        int num_kv_heads, int head_dim, long long q_token_stride,
                                        long long k_token_stride) {
  using namespace conduit;
  const int token = blockIdx.x;
  const int half = head_dim / 2;
  const float* cos_row = cos_sin_cache + positions[token] * head_dim;
  const float* sin_row = cos_row + half;
  const int q_pairs = num_q_heads * half;
  const int total = (num_q_heads + num_kv_heads) * half;
  for (int p = threadIdx.x; p < total; p += blockDim.x) {
    T* base;
    int pair;
    if (p < q_pairs) {
      base = q + token * q_token_stride;
      pair = p;
    } else {
      base = k + token * k_token_stride;
      pair = p - q_pairs;
    }
    const int head = pair / half;
    const int i = pair - head * half;
    T* x = base + head * head_dim;
    rotate_pair(x, x, i, half, cos_row[i], sin_row[i]);
  }
}

// Rotary on q (in place) and k fused with the KV write: the rotated key goes straight into the cache at
// slot_mapping[token] (k itself is left as it was), the value is copied beside it; slot -1 stores nothing
// (q is still rotated). One launch instead of rotary_embedding_kernel + write_kv_kernel per layer.
// Layout: q, k as above; v like k (`v_token_stride`); k_cache/v_cache [num_blocks, block_size,
// num_kv_heads, head_dim] contiguous. Grid: one block per token. Block: any size.
template <typename T>
__global__ void rotary_write_kv_kernel(T* q, const T* __restrict__ k, const T* __restrict__ v,
                                       T* __restrict__ k_cache, T* __restrict__ v_cache,
                                       const long long* __restrict__ positions,
                                       const float* __restrict__ cos_sin_cache,
                                       const long long* __restrict__ slot_mapping, int num_q_heads,
                                       int num_kv_heads, int head_dim, long long q_token_stride,
                                       long long k_token_stride, long long v_token_stride) {
  using namespace conduit;
  const int token = blockIdx.x;
  const int half = head_dim / 2;
  const float* cos_row = cos_sin_cache + positions[token] * head_dim;
  const float* sin_row = cos_row + half;
  const long long slot = slot_mapping[token];
  const int row_elems = num_kv_heads * head_dim;
  const int q_pairs = num_q_heads * half;
  const int total = slot < 0 ? q_pairs : q_pairs + num_kv_heads * half;
  for (int p = threadIdx.x; p < total; p += blockDim.x) {
    const bool is_q = p < q_pairs;
    const int pair = is_q ? p : p - q_pairs;
    const int head = pair / half;
    const int i = pair - head * half;
    const T* src = (is_q ? q + token * q_token_stride : k + token * k_token_stride) + head * head_dim;
    T* dst = is_q ? q + token * q_token_stride + head * head_dim : k_cache + slot * row_elems + head * head_dim;
    rotate_pair(src, dst, i, half, cos_row[i], sin_row[i]);
  }
  if (slot < 0) return;
  const T* v_src = v + token * v_token_stride;
  T* v_dst = v_cache + slot * row_elems;
  for (int e = threadIdx.x; e < row_elems; e += blockDim.x) v_dst[e] = v_src[e];
}
