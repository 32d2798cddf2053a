// Shared device helpers for kernels/*.cu: dtype conversion (types in dtypes.cuh), 16-byte vector packs, warp and block
// reductions, and the dynamic shared memory declaration. Compiles under nvcc, NVRTC (CuPy) and the CPU
// emulation header (kernels/emulation/cuda_emu.h), which defines CONDUIT_EMULATION and is included first.
#pragma once

#include "dtypes.cuh"

namespace conduit {

// NVRTC has no <cmath>, so INFINITY is spelled through its bit pattern.
__device__ __forceinline__ float neg_inf() { return __int_as_float(static_cast<int>(0xff800000u)); }

// Element type <-> float. All arithmetic in the kernels is float32; storage is the model dtype.
template <typename T>
struct Convert;
template <>
struct Convert<float> {
  static __device__ __forceinline__ float to_float(float v) { return v; }
  static __device__ __forceinline__ float from_float(float v) { return v; }
};
template <>
struct Convert<f16> {
  static __device__ __forceinline__ float to_float(f16 v) { return f16_to_float(v); }
  static __device__ __forceinline__ f16 from_float(float v) { return float_to_f16(v); }
};
template <>
struct Convert<bf16> {
  static __device__ __forceinline__ float to_float(bf16 v) { return bf16_to_float(v); }
  static __device__ __forceinline__ bf16 from_float(float v) { return float_to_bf16(v); }
};

template <typename T>
__device__ __forceinline__ float to_float(T v) {
  return Convert<T>::to_float(v);
}
template <typename T>
__device__ __forceinline__ T from_float(float v) {
  return Convert<T>::from_float(v);
}
// Round a float through T and back: the value a T tensor would hold.
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return to_float<T>(from_float<T>(v));
}

// 16 bytes of T, loaded and stored as one vector instruction when the address is 16-byte aligned.
template <typename T>
struct __align__(16) Pack {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

template <typename T>
__device__ __forceinline__ Pack<T> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T>*>(p);
}
template <typename T>
__device__ __forceinline__ void store_pack(T* p, const Pack<T>& x) {
  *reinterpret_cast<Pack<T>*>(p) = x;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}
__device__ __forceinline__ double warp_sum_double(double v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Block-wide reductions for blockDim.x a multiple of 32 (<= 1024). `scratch` holds 32 values; the
// result is returned to every thread. The leading barrier lets callers reuse scratch back to back.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int num_warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < num_warps ? scratch[lane] : 0.0f;
  return warp_sum(v);
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int num_warps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < num_warps ? scratch[lane] : neg_inf();
  return warp_max(v);
}
__device__ __forceinline__ double block_sum_double(double v, double* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int num_warps = blockDim.x >> 5;
  v = warp_sum_double(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < num_warps ? scratch[lane] : 0.0;
  return warp_sum_double(v);
}

// Attention: the first context token a query at the end of `seq_len` tokens sees (0: no window).
__device__ __forceinline__ int visible_start(int seq_len, int sliding_window) {
  return sliding_window > 0 && seq_len > sliding_window ? seq_len - sliding_window : 0;
}
// Attention logit soft-capping: cap * tanh(s / cap), or s itself when cap <= 0. Kernels take 1 / cap from
// the host: a float division compiles to a call to a slow path, which costs registers (and spills).
// tanh as 1 - 2 / (exp(2x) + 1) with the fast intrinsics: tanhf's accurate path spills registers in the
// attention kernels; this is within a few float32 ulps of it (exact at the +-1 limits).
__device__ __forceinline__ float soft_cap(float s, float cap, float inv_cap) {
  return cap > 0.0f ? cap * (1.0f - __fdividef(2.0f, __expf(2.0f * s * inv_cap) + 1.0f)) : s;
}

}  // namespace conduit

// Dynamic shared memory, sized by the launch: `CONDUIT_DYNAMIC_SMEM(float, buf);` declares `buf`.
#ifdef CONDUIT_EMULATION
#define CONDUIT_DYNAMIC_SMEM(type, name) type* name = reinterpret_cast<type*>(::emu::dynamic_shared())
#else
#define CONDUIT_DYNAMIC_SMEM(type, name) \
  extern __shared__ __align__(16) unsigned char conduit_dynamic_smem_[]; \
  type* name = reinterpret_cast<type*>(conduit_dynamic_smem_)
#endif
