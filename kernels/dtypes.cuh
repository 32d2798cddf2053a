// Storage types of the model dtypes float16 (conduit::f16) and bfloat16 (conduit::bf16) with their
// float32 conversions (round to nearest even), defined here instead of taken from cuda_fp16.h /
// cuda_bf16.h: NVRTC (CuPy) does not ship those headers, and a CuPy wheel install may have no CUDA
// toolkit. Bit layouts are IEEE binary16 and bfloat16, so torch.float16 / torch.bfloat16 tensors are
// passed as is. On the GPU the conversions are single PTX cvt instructions (bf16 needs sm_80+); under
// the CPU emulation (CONDUIT_EMULATION) they use the emulator's __float2half_rn and friends.
#pragma once

namespace conduit {

struct __align__(2) f16 {
  unsigned short bits;
};
struct __align__(2) bf16 {
  unsigned short bits;
};

#ifdef CONDUIT_EMULATION
__device__ __forceinline__ float f16_to_float(f16 h) { return __half2float(__half{h.bits}); }
__device__ __forceinline__ f16 float_to_f16(float f) { return f16{__float2half_rn(f).bits}; }
__device__ __forceinline__ float bf16_to_float(bf16 b) { return __bfloat162float(__nv_bfloat16{b.bits}); }
__device__ __forceinline__ bf16 float_to_bf16(float f) { return bf16{__float2bfloat16_rn(f).bits}; }
#else
__device__ __forceinline__ float f16_to_float(f16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.bits));
  return f;
}
__device__ __forceinline__ f16 float_to_f16(float f) {
  f16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
  return h;
}
__device__ __forceinline__ float bf16_to_float(bf16 b) { return __uint_as_float(static_cast<unsigned>(b.bits) << 16); }
__device__ __forceinline__ bf16 float_to_bf16(float f) {
  bf16 b;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b.bits) : "f"(f));
  return b;
}
#endif

}  // namespace conduit
