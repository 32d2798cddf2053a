// The AVX-512 vector of 16 floats (AVX512F/BW/VL/DQ). With CONDUIT_BF16_DOT the bf16 linear uses
// AVX512_BF16's vdpbf16ps (pairs of bf16 products summed into float lanes) and vcvtneps2bf16;
// without it, bf16 is widened to float by a shift and rounded back with integer arithmetic.
// Included inside namespace conduit_cpu::CONDUIT_ISA.
#pragma once

struct Vec {
  using R = __m512;
  static constexpr int W = 16;
  static constexpr int kTileW = 4;  // weight rows x input rows of one linear tile: 16 accumulators
  static constexpr int kTileX = 4;
  static constexpr int kGemvRows = 8;  // weight rows of one tile when there is one input row
  static constexpr int kPackedRows = 16;  // input rows of one packed tile: 16 x 2 accumulators

  static __mmask16 mask(int n) { return static_cast<__mmask16>((1u << n) - 1u); }
  static R zero() { return _mm512_setzero_ps(); }
  static R set1(float a) { return _mm512_set1_ps(a); }
  static R load(const float* p) { return _mm512_loadu_ps(p); }
  static R load_n(const float* p, int n) { return _mm512_maskz_loadu_ps(mask(n), p); }
  static R widen(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
  static R load(const bf16* p) { return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static R load_n(const bf16* p, int n) { return widen(_mm256_maskz_loadu_epi16(mask(n), p)); }
  static void store(float* p, R a) { _mm512_storeu_ps(p, a); }
  static void store_n(float* p, R a, int n) { _mm512_mask_storeu_ps(p, mask(n), a); }
  static __m256i narrow(R a) {
#if CONDUIT_BF16_DOT
    return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(a));
#else
    __m512i u = _mm512_castps_si512(a);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
#endif
  }
  static void store(bf16* p, R a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow(a)); }
  static void store_n(bf16* p, R a, int n) { _mm256_mask_storeu_epi16(p, mask(n), narrow(a)); }
  // a rounded to bf16 precision, kept as float (where torch rounds an intermediate to bf16)
  static R round_bf16(R a) { return widen(narrow(a)); }
  // KV cache codes (common.h): 16 int8 codes sign-extended, or 16 fp8 e4m3 codes decoded with integer
  // shifts (exponent and mantissa into a float's, rescaled by 2^120, the sign or'ed back)
  static R from_i8(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)); }
  static R from_e4m3(__m128i b) {
    const __m512i u = _mm512_cvtepu8_epi32(b);
    const __m512i mag = _mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x7F)), 20);
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x80)), 24);
    const R f = _mm512_mul_ps(_mm512_castsi512_ps(mag), _mm512_set1_ps(0x1p120f));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(f), sign));
  }
  static R load_i8(const uint8_t* p) { return from_i8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static R load_i8_n(const uint8_t* p, int n) { return from_i8(_mm_maskz_loadu_epi8(mask(n), p)); }
  static R load_e4m3(const uint8_t* p) { return from_e4m3(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static R load_e4m3_n(const uint8_t* p, int n) { return from_e4m3(_mm_maskz_loadu_epi8(mask(n), p)); }

  static R add(R a, R b) { return _mm512_add_ps(a, b); }
  static R sub(R a, R b) { return _mm512_sub_ps(a, b); }
  static R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static R div(R a, R b) { return _mm512_div_ps(a, b); }
  static R fma(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static R max(R a, R b) { return _mm512_max_ps(a, b); }
  static R min(R a, R b) { return _mm512_min_ps(a, b); }
  static R floor(R a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  static R pow2n(R n) {
    __m512i e = _mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
  }
  static float reduce_add(R a) { return _mm512_reduce_add_ps(a); }
  static float reduce_max(R a) { return _mm512_reduce_max_ps(a); }
  static R exp(R x) { return exp_poly<Vec>(x); }
  static R tanh(R x) { return tanh_poly<Vec>(x); }
};

#if CONDUIT_BF16_DOT
// Packed bf16 panels of k pairs: one 32-bit broadcast (two bf16 of x) times 16 columns' pairs.
struct PanelPairs {
  static constexpr int k_step = 2;
  static __m512i load_w(const bf16* p) { return _mm512_loadu_si512(p); }
  static __m512 fma(__m512 acc, __m512i w, uint32_t x_pair) {
    return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(w), reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x_pair))));
  }
};

// bf16 x bf16 linear: 32 values of K per instruction, products summed in float lanes.
struct NativeBf16Dot {
  using X = __m512i;
  static constexpr int step = 32;
  static X load(const bf16* p) { return _mm512_loadu_si512(p); }
  static X load_n(const bf16* p, int n) {
    return _mm512_maskz_loadu_epi16(static_cast<__mmask32>((n >= 32) ? ~0u : ((1u << n) - 1u)), p);
  }
  static __m512 fma(__m512 acc, X w, X x) {
    return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(w), reinterpret_cast<__m512bh>(x));
  }
};
#endif
