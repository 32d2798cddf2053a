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
    const float c = cos_row[i];
    const float s = sin_row[i];
    const float x1 = to_float(x[i]);
    const float x2 = to_float(x[i + half]);
    x[i] = from_float<T>(x1 * c - x2 * s);
    x[i + half] = from_float<T>(x2 * c + x1 * s);
  }
}
