// The AVX2 + FMA vector of 8 floats. bf16 is widened by a shift and rounded back with integer
// arithmetic (round to nearest even, NaN to 0x7FC0, as torch converts).
// Included inside namespace conduit_cpu::CONDUIT_ISA.
#pragma once

struct Vec {
  using R = __m256;
  static constexpr int W = 8;
  static constexpr int kTileW = 4;  // 8 accumulators + 3 operands of 16 ymm registers
  static constexpr int kTileX = 2;
  static constexpr int kGemvRows = 8;
  static constexpr int kPackedRows = 3;  // 3 x 4 accumulators of 16 ymm registers

  static __m256i mask(int n) {
    alignas(32) static const int32_t table[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(table + 8 - n));
  }
  static R zero() { return _mm256_setzero_ps(); }
  static R set1(float a) { return _mm256_set1_ps(a); }
  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static R load_n(const float* p, int n) { return _mm256_maskload_ps(p, mask(n)); }
  static R widen(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
  static R load(const bf16* p) { return widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static R load_n(const bf16* p, int n) {
    alignas(16) uint16_t buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(buf, p, static_cast<size_t>(n) * 2);
    return widen(_mm_load_si128(reinterpret_cast<const __m128i*>(buf)));
  }
  static void store(float* p, R a) { _mm256_storeu_ps(p, a); }
  static void store_n(float* p, R a, int n) { _mm256_maskstore_ps(p, mask(n), a); }
  static __m128i narrow(R a) {
    __m256i u = _mm256_castps_si256(a);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
    return _mm256_castsi256_si128(packed);
  }
  static void store(bf16* p, R a) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), narrow(a)); }
  static void store_n(bf16* p, R a, int n) {
    alignas(16) uint16_t buf[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(buf), narrow(a));
    std::memcpy(p, buf, static_cast<size_t>(n) * 2);
  }
  static R round_bf16(R a) { return widen(narrow(a)); }
  // KV cache codes (common.h): 8 int8 codes sign-extended, or 8 fp8 e4m3 codes decoded with integer
  // shifts (exponent and mantissa into a float's, rescaled by 2^120, the sign or'ed back)
  static R from_i8(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }
  static R from_e4m3(__m128i b) {
    const __m256i u = _mm256_cvtepu8_epi32(b);
    const __m256i mag = _mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7F)), 20);
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x80)), 24);
    const R f = _mm256_mul_ps(_mm256_castsi256_ps(mag), _mm256_set1_ps(0x1p120f));
    return _mm256_or_ps(f, _mm256_castsi256_ps(sign));
  }
  static __m128i bytes_n(const uint8_t* p, int n) {
    alignas(16) uint8_t buf[16] = {0};
    std::memcpy(buf, p, static_cast<size_t>(n));
    return _mm_load_si128(reinterpret_cast<const __m128i*>(buf));
  }
  static R load_i8(const uint8_t* p) { return from_i8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static R load_i8_n(const uint8_t* p, int n) { return from_i8(bytes_n(p, n)); }
  static R load_e4m3(const uint8_t* p) { return from_e4m3(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static R load_e4m3_n(const uint8_t* p, int n) { return from_e4m3(bytes_n(p, n)); }

  static R add(R a, R b) { return _mm256_add_ps(a, b); }
  static R sub(R a, R b) { return _mm256_sub_ps(a, b); }
  static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static R div(R a, R b) { return _mm256_div_ps(a, b); }
  static R fma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static R max(R a, R b) { return _mm256_max_ps(a, b); }
  static R min(R a, R b) { return _mm256_min_ps(a, b); }
  static R floor(R a) { return _mm256_floor_ps(a); }
  static R pow2n(R n) {
    __m256i e = _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
  }
  static float reduce_add(R a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static float reduce_max(R a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static R exp(R x) { return exp_poly<Vec>(x); }
  static R tanh(R x) { return tanh_poly<Vec>(x); }
};
