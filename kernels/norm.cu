// RMSNorm and fused residual-add + RMSNorm.
//
// Layout: x, residual and outputs are [num_tokens, hidden] with unit stride along hidden and
// `row_stride` elements between rows; weight is [hidden]. Result: weight * round_T(x * rsqrt(mean(x^2) + eps)),
// as the torch reference computes it (normalise in float32, round to T, multiply by the weight in T).
// Grid: one block per token. Block: a multiple of 32 threads (<= 1024). Vector path: `vectorized` != 0
// requires hidden and row_stride to be multiples of 16 / sizeof(T) and 16-byte aligned base pointers;
// the wrapper checks this and otherwise passes 0. Limits: hidden < 2^31.
#include "common.cuh"

namespace conduit {

template <typename T>
__device__ __forceinline__ void normalize_row(const T* in, T* out, const T* weight, int hidden, float inv_rms,
                                              int vectorized) {
  if (vectorized) {
    constexpr int V = Pack<T>::kSize;
    for (int i = threadIdx.x * V; i < hidden; i += blockDim.x * V) {
      Pack<T> x = load_pack(in + i);
      Pack<T> w = load_pack(weight + i);
      Pack<T> y;
#pragma unroll
      for (int j = 0; j < V; ++j)
        y.v[j] = from_float<T>(to_float(w.v[j]) * round_to<T>(to_float(x.v[j]) * inv_rms));
      store_pack(out + i, y);
    }
  } else {
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
      out[i] = from_float<T>(to_float(weight[i]) * round_to<T>(to_float(in[i]) * inv_rms));
  }
}

}  // namespace conduit

template <typename T>
__global__ void rms_norm_kernel(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ weight,
                                int hidden, long long row_stride, long long out_row_stride, float eps,
                                int vectorized) {
  using namespace conduit;
  __shared__ float scratch[32];
  const T* row = x + blockIdx.x * row_stride;
  float sum_sq = 0.0f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    float v = to_float(row[i]);
    sum_sq += v * v;
  }
  sum_sq = block_sum(sum_sq, scratch);
  const float inv_rms = rsqrtf(sum_sq / static_cast<float>(hidden) + eps);
  normalize_row(row, out + blockIdx.x * out_row_stride, weight, hidden, inv_rms, vectorized);
}

// residual_out = round_T(x + residual); out = rms_norm(residual_out). residual_out may alias residual.
template <typename T>
__global__ void add_rms_norm_kernel(T* __restrict__ out, T* residual_out, const T* __restrict__ x,
                                    const T* residual, const T* __restrict__ weight, int hidden,
                                    long long row_stride, long long out_row_stride, float eps, int vectorized) {
  using namespace conduit;
  __shared__ float scratch[32];
  const T* x_row = x + blockIdx.x * row_stride;
  const T* r_row = residual + blockIdx.x * row_stride;
  T* sum_row = residual_out + blockIdx.x * out_row_stride;
  float sum_sq = 0.0f;
  // Each thread re-reads only the elements it wrote itself, so no barrier is needed before the norm's
  // block reduction (which has its own).
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    float v = round_to<T>(to_float(x_row[i]) + to_float(r_row[i]));
    sum_row[i] = from_float<T>(v);
    sum_sq += v * v;
  }
  sum_sq = block_sum(sum_sq, scratch);
  const float inv_rms = rsqrtf(sum_sq / static_cast<float>(hidden) + eps);
  // The vector path reads sum_row elements written by other threads: the barrier in block_sum orders
  // those writes before these reads within the block.
  normalize_row<T>(sum_row, out + blockIdx.x * out_row_stride, weight, hidden, inv_rms, vectorized);
}
