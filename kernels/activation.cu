// Gated activations: out = act(gate) * up for x = [gate | up], with act = silu (SwiGLU) or the tanh
// approximation of GELU (GeGLU, gelu_tanh_and_mul_kernel).
//
// Layout: x [num_tokens, 2 * inter] (row stride `x_row_stride`, unit stride inside), out
// [num_tokens, inter] (row stride `out_row_stride`). Matches the torch reference's rounding: the activation
// is computed in float32 and rounded to T, then multiplied by up and rounded again.
// Grid: (num_tokens, ceil(inter / (blockDim.x * elements per thread))). Block: any size, 256 by default.
// Vector path (`vectorized` != 0): inter and both row strides are multiples of 16 / sizeof(T) and base
// pointers are 16-byte aligned (checked by the wrapper).
// Limits: inter <= 65535 * blockDim.x * elements per thread (grid.y), num_tokens < 2^31.
#include "common.cuh"

namespace conduit {
struct Silu {
  static __device__ __forceinline__ float apply(float g) { return g / (1.0f + expf(-g)); }
};
struct GeluTanh {
  static __device__ __forceinline__ float apply(float g) {
    const float kSqrt2OverPi = 0.7978845608028654f;
    return 0.5f * g * (1.0f + tanhf(kSqrt2OverPi * (g + 0.044715f * g * g * g)));
  }
};

template <typename Act, typename T>
__device__ __forceinline__ void gated_and_mul(T* __restrict__ out, const T* __restrict__ x, int inter,
                                              long long x_row_stride, long long out_row_stride, int vectorized) {
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
      for (int j = 0; j < V; ++j) y.v[j] = from_float<T>(round_to<T>(Act::apply(to_float(g.v[j]))) * to_float(u.v[j]));
      store_pack(dst + i, y);
    }
  } else {
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i < inter) dst[i] = from_float<T>(round_to<T>(Act::apply(to_float(gate[i]))) * to_float(up[i]));
  }
}
}  // namespace conduit

template <typename T>
__global__ void silu_and_mul_kernel(T* __restrict__ out, const T* __restrict__ x, int inter,
                                    long long x_row_stride, long long out_row_stride, int vectorized) {
  conduit::gated_and_mul<conduit::Silu>(out, x, inter, x_row_stride, out_row_stride, vectorized);
}

template <typename T>
__global__ void gelu_tanh_and_mul_kernel(T* __restrict__ out, const T* __restrict__ x, int inter,
                                         long long x_row_stride, long long out_row_stride, int vectorized) {
  conduit::gated_and_mul<conduit::GeluTanh>(out, x, inter, x_row_stride, out_row_stride, vectorized);
}
