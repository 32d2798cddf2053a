// The int8 linear (W8A8, conduit_engine/ops/quant.py is the reference): int8 weight panels times the
// per-token int8 rows of x, summed exactly in int32, scaled back in float. Included by kernels_impl.h
// inside conduit_cpu::CONDUIT_ISA; CONDUIT_INT8 says which multiply each ISA file uses:
//   3  AVX-512 VNNI: vpdpbusd multiplies unsigned bytes by signed ones, so x comes biased by 128
//      (q ^ 0x80) and the bias is taken back with the panel's column sums (w_comp = 128 * sum_k w);
//   2  AVX-512 BW: |x| times w with x's sign moved onto w (a masked negation), vpmaddubsw into int16
//      pairs, vpmaddwd by ones into int32; |x|, |w| <= 127 so a pair (<= 2 * 127^2) never saturates;
//   1  AVX2: the same with vpsignb;
//   0  portable C++.
// Layout (common.h Int8LinearArgs): panels of kPanel columns, k in quads, [panels][K4][kPanel][4] bytes.
#pragma once

#ifndef CONDUIT_INT8
#error "define CONDUIT_INT8 before including kernels_impl.h"
#endif

struct I8Dot {
#if CONDUIT_INT8 >= 2
  using I = __m512i;
  static constexpr int kVecs = static_cast<int>(kPanel) / 16;  // int32 vectors per panel quad
  static constexpr int kRows = CONDUIT_INT8 == 3 ? 8 : 6;
  static I zero() { return _mm512_setzero_si512(); }
  static I load(const int8_t* p) { return _mm512_loadu_si512(p); }
  static void store(int32_t* p, I v) { _mm512_storeu_si512(p, v); }
  static I bcast(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
#if CONDUIT_INT8 == 3
  struct X {
    I u;
  };
  static X prep(I xb) { return {xb}; }
  static I dot(I acc, const X& x, I w) { return _mm512_dpbusd_epi32(acc, x.u, w); }
#else
  struct X {
    I abs;
    __mmask64 neg;
  };
  static X prep(I xb) { return {_mm512_abs_epi8(xb), _mm512_movepi8_mask(xb)}; }
  static I dot(I acc, const X& x, I w) {
    const I sw = _mm512_mask_sub_epi8(w, x.neg, _mm512_setzero_si512(), w);
    const I pairs = _mm512_maddubs_epi16(x.abs, sw);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
  }
#endif
#elif CONDUIT_INT8 == 1
  using I = __m256i;
  static constexpr int kVecs = static_cast<int>(kPanel) / 8;
  static constexpr int kRows = 2;  // 2 x 4 accumulators, 4 panel vectors, x, |x|, ones of 16 ymm
  static I zero() { return _mm256_setzero_si256(); }
  static I load(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static void store(int32_t* p, I v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
  static I bcast(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }
  struct X {
    I x, abs;
  };
  static X prep(I xb) { return {xb, _mm256_sign_epi8(xb, xb)}; }
  static I dot(I acc, const X& x, I w) {
    const I pairs = _mm256_maddubs_epi16(x.abs, _mm256_sign_epi8(w, x.x));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
#endif
};

#if CONDUIT_INT8 >= 1
// How far ahead of its loads a one-row tile prefetches its panel: 4 KiB measured best at one row on a
// Sapphire Rapids VM (2 KiB within 2%, none 5% slower); from two rows on, prefetching cost 5-12%.
constexpr int64_t kInt8Prefetch = 4096;
static_assert(kPanel * 4 == 128, "the one-row prefetch fetches the two cache lines of a panel quad");

// RX rows of x times one panel over all K4 quads: RX x kVecs int32 accumulators into acc_out [RX][kPanel].
template <int RX>
static void int8_tile(const int8_t* panel, const int8_t* x, int64_t ldx, int64_t k4, int32_t* acc_out) {
  using D = I8Dot;
  typename D::I acc[RX][D::kVecs];
  for (int j = 0; j < RX; ++j)
    for (int v = 0; v < D::kVecs; ++v) acc[j][v] = D::zero();
  for (int64_t q = 0; q < k4; ++q) {
    if constexpr (RX == 1) {  // one row does too little per load to keep enough loads in flight
      __builtin_prefetch(panel + q * kPanel * 4 + kInt8Prefetch, 0, 3);
      __builtin_prefetch(panel + q * kPanel * 4 + kInt8Prefetch + 64, 0, 3);
    }
    typename D::I w[D::kVecs];
    for (int v = 0; v < D::kVecs; ++v) w[v] = D::load(panel + q * kPanel * 4 + v * (kPanel * 4 / D::kVecs));
    for (int j = 0; j < RX; ++j) {
      const typename D::X xv = D::prep(D::bcast(x + j * ldx + 4 * q));
      for (int v = 0; v < D::kVecs; ++v) acc[j][v] = D::dot(acc[j][v], xv, w[v]);
    }
  }
  for (int j = 0; j < RX; ++j)
    for (int v = 0; v < D::kVecs; ++v) D::store(acc_out + j * kPanel + v * (kPanel / D::kVecs), acc[j][v]);
}

template <int RX = I8Dot::kRows>
static void int8_tile_rows(int rows, const int8_t* panel, const int8_t* x, int64_t ldx, int64_t k4, int32_t* acc) {
  if constexpr (RX > 1) {
    if (rows < RX) return int8_tile_rows<RX - 1>(rows, panel, x, ldx, k4, acc);
  }
  int8_tile<RX>(panel, x, ldx, k4, acc);
}
constexpr int kInt8Rows = I8Dot::kRows;
#else
static void int8_tile_rows(int rows, const int8_t* panel, const int8_t* x, int64_t ldx, int64_t k4, int32_t* acc) {
  for (int j = 0; j < rows; ++j) {
    int32_t* a = acc + j * kPanel;
    for (int64_t c = 0; c < kPanel; ++c) a[c] = 0;
    for (int64_t q = 0; q < k4; ++q) {
      const int8_t* xq = x + j * ldx + 4 * q;
      const int8_t* wq = panel + q * kPanel * 4;
      for (int64_t c = 0; c < kPanel; ++c)
        for (int e = 0; e < 4; ++e) a[c] += static_cast<int32_t>(xq[e]) * static_cast<int32_t>(wq[c * 4 + e]);
    }
  }
}
constexpr int kInt8Rows = 4;
#endif

// out = float(acc - comp) * (x_scale * w_scale) + bias, rounded as the reference rounds: no fused
// multiply-add, so the float32 results are the torch reference's bit for bit.
template <class T>
__attribute__((optimize("fp-contract=off"))) static void int8_store(const int32_t* acc, const int32_t* comp,
                                                                     const float* w_scale, float x_scale,
                                                                     const T* bias, T* dst, int64_t cols) {
  for (int64_t c = 0; c < cols; ++c) {
    float v = static_cast<float>(acc[c] - comp[c]) * (x_scale * w_scale[c]);
    if (bias != nullptr) v = v + to_float(bias[c]);
    dst[c] = from_float<T>(v);
  }
}

template <class T>
static void int8_linear(const Int8LinearArgs& a, int64_t p0, int64_t p1) {
  const int8_t* w = static_cast<const int8_t*>(a.w);
  const T* bias = static_cast<const T*>(a.bias);
  T* out = static_cast<T*>(a.out);
  alignas(64) int32_t acc[kInt8Rows * kPanel];
  alignas(64) static const int32_t no_comp[kPanel] = {};
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t n0 = p * kPanel, cols = std::min<int64_t>(kPanel, a.N - n0);
    const int8_t* panel = w + p * a.K4 * kPanel * 4;
    const int32_t* comp = a.w_comp != nullptr ? a.w_comp + n0 : no_comp;
    for (int64_t m0 = 0; m0 < a.M; m0 += kInt8Rows) {
      const int rows = static_cast<int>(std::min<int64_t>(kInt8Rows, a.M - m0));
      int8_tile_rows(rows, panel, a.xq + m0 * a.ldx, a.ldx, a.K4, acc);
      for (int j = 0; j < rows; ++j)
        int8_store<T>(acc + j * kPanel, comp, a.w_scale + n0, a.x_scale[m0 + j], bias == nullptr ? nullptr : bias + n0,
                      out + (m0 + j) * a.ldo + n0, cols);
    }
  }
}
