// SwiGLU activation: out = silu(gate) * up for x = [gate | up].
//
// Layout: x [num_tokens, 2 * inter] (row stride `x_row_stride`, unit stride inside), out
// [num_tokens, inter] (row stride `out_row_stride`). Matches the torch reference's rounding: silu is
// computed in float32 and rounded to T, then multiplied by up and rounded again.
// Grid: (num_tokens, ceil(inter / (blockDim.x * elements per thread))). Block: any size, 256 by default.
// Vector path (`vectorized` != 0): inter and both row strides are multiples of 16 / sizeof(T) and base
// pointers are 16-byte aligned (checked by the wrapper).
// Limits: inter <= 65535 * blockDim.x * elements per thread (grid.y), num_tokens < 2^31.
#include "common.cuh"

namespace conduit {
__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }
}  // namespace conduit

template <typename T>
__global__ void silu_and_mul_kernel(T* __restrict__ out, const T* __restrict__ x, int inter,
                                    long long x_row_stride, long long out_row_stride, int vectorized) {
  using namespace conduit;
  const T* gate = x + blockIdx.x * x_row_stride;
  const T* up = gate + inter;
  T* dst = out + blockIdx.x * out_row_stride;
  if (vectorized) {
    constexpr int V = Pack<T>::kSize;
    const int i = (blockIdx.y * blockDim.x + threadIdx.x) * V;
    if (i < inter) {
      Pack<T> g = load_pack(gate + i);
      Pack<T> u = load_pack(up + i);
      Pack<T> y;
#pragma unroll
      for (int j = 0; j < V; ++j) y.v[j] = from_float<T>(round_to<T>(silu(to_float(g.v[j]))) * to_float(u.v[j]));
      store_pack(dst + i, y);
    }
  } else {
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i < inter) dst[i] = from_float<T>(round_to<T>(silu(to_float(gate[i]))) * to_float(up[i]));
  }
}
