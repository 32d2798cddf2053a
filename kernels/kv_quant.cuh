// Quantized KV caches (--kv-cache-dtype int8 | fp8): the row format and its arithmetic on the device,
// bit for bit as ops/kv_quant.py (the reference) and kernels/cpu compute it.
//
// A quantized cache is [num_blocks, block_size, num_kv_heads, head_dim + 2] bytes: each (token, kv head)
// row holds head_dim codes (int8, or fp8 e4m3fn), then its scale as a bfloat16 (little endian). Writing a
// row x: scale = bf16(max|x| / QMAX) (QMAX 127 or 448), code = round_half_even(x / scale) clamped to
// +-127 (int8) or e4m3fn(clamp(x / scale, -448, 448)) (fp8, round to nearest even); a row of zeros has
// scale 0 and codes 0. Reading: value = code * scale. Rows are only 2-byte aligned, so codes are read
// byte by byte (a quarter or an eighth of the bytes a float32 / bfloat16 row costs).
#pragma once

#include "common.cuh"

namespace conduit {

// Formats of a KV cache (the KV template parameter of the attention kernels).
constexpr int kKvPlain = 0;
constexpr int kKvInt8 = 1;
constexpr int kKvFp8 = 2;
constexpr int kKvScaleBytes = 2;

// Element type of a cache of format KV for a model of dtype T: T itself, or bytes (codes and scales).
template <typename T, int KV>
struct KvElem {
  using type = unsigned char;
};
template <typename T>
struct KvElem<T, kKvPlain> {
  using type = T;
};
template <typename T, int KV>
using kv_elem_t = typename KvElem<T, KV>::type;

__device__ __forceinline__ float fp8_e4m3_to_float(unsigned char x) {
  // exponent and mantissa into a float's, rescaled by 2^(127 - 7): exact for normals and subnormals
  const float f = __uint_as_float(static_cast<unsigned>(x & 0x7Fu) << 20) * 1.329227995784916e36f;  // 2^120
  return (x & 0x80u) ? -f : f;
}

// c10::Float8_e4m3fn's conversion (round to nearest even; |f| >= 480 to NaN, never reached after clamping).
__device__ __forceinline__ unsigned char float_to_fp8_e4m3(float f) {
  unsigned bits = __float_as_uint(f);
  const unsigned sign = bits & 0x80000000u;
  bits ^= sign;
  unsigned result;
  if (bits >= (1087u << 20)) {
    result = 0x7Fu;
  } else if (bits < (121u << 23)) {
    const unsigned denorm_mask = 141u << 23;
    result = __float_as_uint(__uint_as_float(bits) + __uint_as_float(denorm_mask)) - denorm_mask;
  } else {
    const unsigned mant_odd = (bits >> 20) & 1u;
    bits += (static_cast<unsigned>(7 - 127) << 23) + 0x7FFFFu + mant_odd;
    result = bits >> 20;
  }
  return static_cast<unsigned char>((result & 0xFFu) | (sign >> 24));
}

template <int KV>
__device__ __forceinline__ float kv_decode(unsigned char code) {
  // int8: 2^23 + (code ^ 0x80) as a float's bits, less 2^23 + 128 (exact; the fp8 path's instruction mix)
  if (KV == kKvInt8) return __uint_as_float(0x4B000000u | (code ^ 0x80u)) - 8388736.0f;
  return fp8_e4m3_to_float(code);
}

// The scale after a row's `head_dim` codes (2-byte aligned: rows and head_dim are even).
__device__ __forceinline__ float kv_row_scale(const unsigned char* row, int head_dim) {
  const unsigned bits = *reinterpret_cast<const unsigned short*>(row + head_dim);
  return __uint_as_float(bits << 16);
}

// Start of the row of (slot, kv head) in a quantized cache.
__device__ __forceinline__ const unsigned char* kv_row(const void* cache, long long slot, int num_kv_heads,
                                                       int kv_head, int head_dim) {
  return static_cast<const unsigned char*>(cache) +
         (slot * num_kv_heads + kv_head) * static_cast<long long>(head_dim + kKvScaleBytes);
}

// Quantize one row src [head_dim] (any element type) into dst [head_dim + 2], by one thread.
template <int KV, typename T>
__device__ __forceinline__ void kv_quantize_row(const T* src, unsigned char* dst, int head_dim) {
  float amax = 0.0f;
  for (int d = 0; d < head_dim; ++d) amax = fmaxf(amax, fabsf(to_float(src[d])));
  const float qmax = KV == kKvInt8 ? 127.0f : 448.0f;
  const bf16 scale_bits = float_to_bf16(amax / qmax);
  const float scale = bf16_to_float(scale_bits);
  for (int d = 0; d < head_dim; ++d) {
    const float y = scale > 0.0f ? fminf(fmaxf(to_float(src[d]) / scale, -qmax), qmax) : 0.0f;
    dst[d] = KV == kKvInt8 ? static_cast<unsigned char>(static_cast<signed char>(rintf(y))) : float_to_fp8_e4m3(y);
  }
  dst[head_dim] = static_cast<unsigned char>(scale_bits.bits & 0xFFu);
  dst[head_dim + 1] = static_cast<unsigned char>(scale_bits.bits >> 8);
}

}  // namespace conduit
