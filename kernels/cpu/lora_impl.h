// The LoRA deltas (common.h: LoraArgs; Ops.lora_delta in conduit_engine/ops/base.py is the reference). Included by
// kernels_impl.h inside conduit_cpu::CONDUIT_ISA, after its helpers.
#pragma once

// Register tiles like linear's: the shrink keeps kLoraShrinkRows rows of a x kTileX input rows of
// accumulators over K; the expand keeps kTileX rows x kLoraVecs vectors of output columns over the rank,
// reading each rank row of b once per tile. Rows of a segment share the slot's matrices, so a tile's
// a rows (shrink) or b columns (expand) are read once for all the tile's rows. Rows of the step are
// reached by pointer (no gather); h stays float.

constexpr int kLoraVecs = kLoraExpandCols / W < 4 ? static_cast<int>(kLoraExpandCols / W) : 4;
constexpr int64_t kLoraPanel = 8 * kLoraExpandCols;  // columns of b: 16 ranks of float32 in 16 KiB

// Calls f(std::integral_constant<int, m>) with m = n, for 1 <= n <= N.
template <int N, class F>
static void with_count(int64_t n, const F& f) {
  if constexpr (N > 1) {
    if (n < N) return with_count<N - 1>(n, f);
  }
  f(std::integral_constant<int, N>{});
}

template <class T, int RW, int RX>
static void lora_shrink_tile(const T* a, int64_t K, const T* const* x, float* const* h) {
  R acc[RW][RX];
  for (int i = 0; i < RW; ++i)
    for (int j = 0; j < RX; ++j) acc[i][j] = Vec::zero();
  int64_t k = 0;
  for (; k + W <= K; k += W) {
    R xv[RX];
    for (int j = 0; j < RX; ++j) xv[j] = Vec::load(x[j] + k);
    for (int i = 0; i < RW; ++i) {
      const R wv = Vec::load(a + i * K + k);
      for (int j = 0; j < RX; ++j) acc[i][j] = Vec::fma(wv, xv[j], acc[i][j]);
    }
  }
  if (k < K) {
    const int n = static_cast<int>(K - k);
    R xv[RX];
    for (int j = 0; j < RX; ++j) xv[j] = Vec::load_n(x[j] + k, n);
    for (int i = 0; i < RW; ++i) {
      const R wv = Vec::load_n(a + i * K + k, n);
      for (int j = 0; j < RX; ++j) acc[i][j] = Vec::fma(wv, xv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < RW; ++i)
    for (int j = 0; j < RX; ++j) h[j][i] = Vec::reduce_add(acc[i][j]);
}

template <class T>
static void lora_shrink(const LoraArgs& a, int64_t item_begin, int64_t item_end) {
  const int64_t SR = a.S * a.R, tiles = (SR + kLoraShrinkRows - 1) / kLoraShrinkRows;
  const T* x = static_cast<const T*>(a.x);
  for (int64_t item = item_begin; item < item_end; ++item) {
    const int64_t s = item / tiles, j0 = (item % tiles) * kLoraShrinkRows;
    const T* rows_a = static_cast<const T*>(a.a) + (static_cast<int64_t>(a.seg_slot[s]) * SR + j0) * a.K;
    const int64_t end = a.seg_begin[s + 1];
    for (int64_t i = a.seg_begin[s]; i < end; i += Vec::kTileX) {
      const int64_t m = std::min<int64_t>(Vec::kTileX, end - i);
      const T* xr[Vec::kTileX];
      float* hr[Vec::kTileX];
      for (int64_t q = 0; q < m; ++q) {
        xr[q] = x + a.rows[i + q] * a.ldx;
        hr[q] = a.h + (i + q) * SR + j0;
      }
      with_count<static_cast<int>(kLoraShrinkRows)>(std::min(kLoraShrinkRows, SR - j0), [&](auto rw) {
        with_count<Vec::kTileX>(m, [&](auto rx) { lora_shrink_tile<T, decltype(rw)::value, decltype(rx)::value>(rows_a, a.K, xr, hr); });
      });
    }
  }
}

// y[q][n ..] += sum over r of h[q][r] b[r][n ..]: CV vectors, or (CV = 1) the `tail` < W columns.
template <class T, int RX, int CV>
static void lora_expand_tile(const T* b, int64_t ldb, int64_t rank, const float* const* h, T* const* y,
                             int64_t n, int tail) {
  R acc[RX][CV];
  for (int q = 0; q < RX; ++q)
    for (int c = 0; c < CV; ++c) acc[q][c] = Vec::zero();
  for (int64_t r = 0; r < rank; ++r) {
    R bv[CV];
    for (int c = 0; c < CV; ++c)
      bv[c] = tail != 0 ? Vec::load_n(b + r * ldb + n, tail) : Vec::load(b + r * ldb + n + c * W);
    for (int q = 0; q < RX; ++q) {
      const R hv = Vec::set1(h[q][r]);
      for (int c = 0; c < CV; ++c) acc[q][c] = Vec::fma(hv, bv[c], acc[q][c]);
    }
  }
  for (int q = 0; q < RX; ++q)
    for (int c = 0; c < CV; ++c) {
      T* p = y[q] + n + c * W;
      if (tail != 0)
        Vec::store_n(p, Vec::add(Vec::load_n(p, tail), acc[q][c]), tail);
      else
        Vec::store(p, Vec::add(Vec::load(p), acc[q][c]));
    }
}

template <class T>
static void lora_expand(const LoraArgs& a, int64_t block_begin, int64_t block_end) {
  const int64_t SR = a.S * a.R;
  const int64_t c0 = block_begin * kLoraExpandCols, c1 = std::min(a.N, block_end * kLoraExpandCols);
  const int64_t bounds[4] = {0, a.S > 1 ? a.split1 : a.N, a.S > 2 ? a.split2 : a.N, a.N};
  T* y = static_cast<T*>(a.y);
  for (int64_t s = 0; s < a.segments; ++s) {
    const T* b = static_cast<const T*>(a.b) + static_cast<int64_t>(a.seg_slot[s]) * SR * a.N;
    const int64_t begin = a.seg_begin[s], end = a.seg_begin[s + 1];
    for (int64_t j = 0; j < a.S; ++j) {  // slice j: its columns read shrink rows [j R, (j + 1) R)
      const int64_t lo = std::max(c0, bounds[j]), hi = std::min(c1, j + 1 < a.S ? bounds[j + 1] : a.N);
      const T* bj = b + j * a.R * a.N;
      // panels of kLoraPanel columns, rows inner: a panel's b columns stay in L1 while every row of the
      // segment passes, and each row's y is read along contiguous columns
      for (int64_t p = lo; p < hi; p += kLoraPanel) {
        const int64_t p_end = std::min(hi, p + kLoraPanel);
        for (int64_t i = begin; i < end; i += Vec::kTileX) {
          const int64_t m = std::min<int64_t>(Vec::kTileX, end - i);
          const float* hr[Vec::kTileX];
          T* yr[Vec::kTileX];
          for (int64_t q = 0; q < m; ++q) {
            hr[q] = a.h + (i + q) * SR + j * a.R;
            yr[q] = y + a.rows[i + q] * a.ldy;
          }
          with_count<Vec::kTileX>(m, [&](auto rx) {
            constexpr int RX = decltype(rx)::value;
            int64_t n = p;
            for (; n + kLoraVecs * W <= p_end; n += kLoraVecs * W)
              lora_expand_tile<T, RX, kLoraVecs>(bj, a.N, a.R, hr, yr, n, 0);
            for (; n + W <= p_end; n += W) lora_expand_tile<T, RX, 1>(bj, a.N, a.R, hr, yr, n, 0);
            if (n < p_end) lora_expand_tile<T, RX, 1>(bj, a.N, a.R, hr, yr, n, static_cast<int>(p_end - n));
          });
        }
      }
    }
  }
}
