// Tensor-core matrix multiply-accumulate for the attention kernels: one warp computes
// D[16x8] += A[16x16] * B[16x8] with 16-bit inputs (f16 or bf16) and float32 accumulation, as PTX
// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32 (sm_80+). Under the CPU emulation
// (CONDUIT_EMULATION) the same call is one warp-collective operation of kernels/emulation/cuda_emu.h.
//
// Fragments (g = lane / 4, t = lane % 4; each 32-bit register holds two elements, lower index in the low half):
//   A (row-major 16x16): a[0] = (g, 2t..2t+1), a[1] = (g + 8, 2t..), a[2] = (g, 2t + 8..), a[3] = (g + 8, 2t + 8..)
//   B (16x8, k x n):     b[0] = (k 2t..2t+1, n g), b[1] = (k 2t + 8.., n g)
//   C/D (16x8 float):    d[0], d[1] = (g, 2t), (g, 2t + 1); d[2], d[3] = (g + 8, 2t), (g + 8, 2t + 1)
// So a row-major tile in shared memory gives A, and B comes from a tile stored n-major (each of the 8
// columns' 16 k values contiguous): K rows for Q K^T, V transposed for P V. The accumulator of one mma
// (two adjacent 8-column tiles of it) is the A fragment of the next, which is how P stays in registers.
#pragma once

#include "common.cuh"

namespace conduit {

template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]);

#ifdef CONDUIT_EMULATION
template <>
__device__ __forceinline__ void mma_m16n8k16<bf16>(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  conduit_emu_mma_m16n8k16(d, a, b, true);
}
template <>
__device__ __forceinline__ void mma_m16n8k16<f16>(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  conduit_emu_mma_m16n8k16(d, a, b, false);
}
#else
template <>
__device__ __forceinline__ void mma_m16n8k16<bf16>(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <>
__device__ __forceinline__ void mma_m16n8k16<f16>(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

// D[16x8] += A[16x32] * B[32x8] in int8 with int32 accumulation (wrapping, no saturation), as PTX
// mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 (sm_80+), for the int8 linear (int8_gemm.cu). Each
// 32-bit register holds four int8 elements, the lowest index in the low byte:
//   A (row-major 16x32): a[0] = (g, 4t..4t+3), a[1] = (g + 8, 4t..), a[2] = (g, 4t + 16..), a[3] = (g + 8, 4t + 16..)
//   B (32x8, k x n):     b[0] = (k 4t..4t+3, n g), b[1] = (k 4t + 16.., n g)
//   C/D (16x8 int32):    as m16n8k16's float accumulator.
#ifdef CONDUIT_EMULATION
__device__ __forceinline__ void mma_m16n8k32_s8(int (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  conduit_emu_mma_m16n8k32_s8(d, a, b);
}
#else
__device__ __forceinline__ void mma_m16n8k32_s8(int (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

// Two adjacent 16-bit elements as one fragment register (the address must be 4-byte aligned).
template <typename T>
__device__ __forceinline__ unsigned load_pair(const T* p) {
  return *reinterpret_cast<const unsigned*>(p);
}

// Two floats rounded to T and packed as one fragment register, `lo` in the low half.
template <typename T>
__device__ __forceinline__ unsigned pack_pair(float lo, float hi) {
  return static_cast<unsigned>(from_float<T>(lo).bits) | (static_cast<unsigned>(from_float<T>(hi).bits) << 16);
}

}  // namespace conduit
