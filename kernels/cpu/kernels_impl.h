// Every CPU kernel, written once on the `Vec` of one instruction set and compiled by each isa_*.cpp
// inside its own namespace (conduit_cpu::CONDUIT_ISA). Arithmetic is in float; bf16 values are widened
// on load and rounded (to nearest even) on store, and where torch rounds an intermediate to bf16
// (norm before its weight, activation before its product) so does the kernel.
//
// linear: dot-product tiles over the weight's own [N, K] rows (the llamafile/tinyBLAS scheme): a tile
//   keeps kTileW x kTileX accumulators, each weight row is read once per tile of input rows and stays in
//   L1 while every input tile passes, so the weights stream from memory once per call.
// attention: per (sequence, kv head), every query of the sequence in that head's group reads its keys
//   and values in place, block by block of the block table (no gather); scores go to a scratch row,
//   softmax in float, then the weighted sum of values.
#pragma once

#ifndef CONDUIT_ISA
#error "define CONDUIT_ISA (the namespace of this instruction set) before including kernels_impl.h"
#endif

namespace conduit_cpu {
namespace CONDUIT_ISA {

using R = Vec::R;
constexpr int W = Vec::W;

// ---- linear ---------------------------------------------------------------------------------------

template <class T>
struct WidenDot {  // any element type, widened to float lanes
  using X = R;
  static constexpr int step = W;
  static X load(const T* p) { return Vec::load(p); }
  static X load_n(const T* p, int n) { return Vec::load_n(p, n); }
  static R fma(R acc, X w, X x) { return Vec::fma(w, x, acc); }
};

#if CONDUIT_BF16_DOT
using Bf16Dot = NativeBf16Dot;
#else
using Bf16Dot = WidenDot<bf16>;
#endif

template <class T>
struct DotFor;
template <>
struct DotFor<float> {
  using type = WidenDot<float>;
};
template <>
struct DotFor<bf16> {
  using type = Bf16Dot;
};

// RW weight rows x RX input rows over the whole of K.
template <class T, int RW, int RX>
static void linear_tile(const T* w, int64_t ldw, const T* x, int64_t ldx, const T* bias, T* out, int64_t ldo,
                        int64_t K) {
  using D = typename DotFor<T>::type;
  R acc[RW][RX];
  for (int i = 0; i < RW; ++i)
    for (int j = 0; j < RX; ++j) acc[i][j] = Vec::zero();
  int64_t k = 0;
  for (; k + D::step <= K; k += D::step) {
    typename D::X xv[RX];
    for (int j = 0; j < RX; ++j) xv[j] = D::load(x + j * ldx + k);
    for (int i = 0; i < RW; ++i) {
      typename D::X wv = D::load(w + i * ldw + k);
      for (int j = 0; j < RX; ++j) acc[i][j] = D::fma(acc[i][j], wv, xv[j]);
    }
  }
  if (k < K) {
    const int n = static_cast<int>(K - k);
    typename D::X xv[RX];
    for (int j = 0; j < RX; ++j) xv[j] = D::load_n(x + j * ldx + k, n);
    for (int i = 0; i < RW; ++i) {
      typename D::X wv = D::load_n(w + i * ldw + k, n);
      for (int j = 0; j < RX; ++j) acc[i][j] = D::fma(acc[i][j], wv, xv[j]);
    }
  }
  for (int i = 0; i < RW; ++i) {
    const float b = bias != nullptr ? to_float(bias[i]) : 0.0f;
    for (int j = 0; j < RX; ++j) out[j * ldo + i] = from_float<T>(Vec::reduce_add(acc[i][j]) + b);
  }
}

// The tile of the largest RW' <= RW rows that is at least `rows` (templates need constant sizes).
template <class T, int RX, int RW>
static void linear_tile_rows(int rows, const T* w, int64_t ldw, const T* x, int64_t ldx, const T* bias, T* out,
                             int64_t ldo, int64_t K) {
  if constexpr (RW > 1) {
    if (rows < RW) return linear_tile_rows<T, RX, RW - 1>(rows, w, ldw, x, ldx, bias, out, ldo, K);
  }
  linear_tile<T, RW, RX>(w, ldw, x, ldx, bias, out, ldo, K);
}

template <class T, int RX>
static void linear_tile_inputs(int inputs, int rows, const T* w, int64_t ldw, const T* x, int64_t ldx,
                               const T* bias, T* out, int64_t ldo, int64_t K) {
  if constexpr (RX > 1) {
    if (inputs < RX) return linear_tile_inputs<T, RX - 1>(inputs, rows, w, ldw, x, ldx, bias, out, ldo, K);
  }
  linear_tile_rows<T, RX, Vec::kTileW>(rows, w, ldw, x, ldx, bias, out, ldo, K);
}

template <class T>
static void linear(const LinearArgs& a, int64_t n_begin, int64_t n_end) {
  const T* x = static_cast<const T*>(a.x);
  const T* w = static_cast<const T*>(a.w);
  const T* bias = static_cast<const T*>(a.bias);
  T* out = static_cast<T*>(a.out);
  if (a.M == 1) {  // GEMV: more weight rows per tile, more memory streams in flight
    for (int64_t n = n_begin; n < n_end; n += Vec::kGemvRows) {
      const int rows = static_cast<int>(std::min<int64_t>(Vec::kGemvRows, n_end - n));
      linear_tile_rows<T, 1, Vec::kGemvRows>(rows, w + n * a.ldw, a.ldw, x, a.ldx,
                                             bias != nullptr ? bias + n : nullptr, out + n, a.ldo, a.K);
    }
    return;
  }
  for (int64_t n = n_begin; n < n_end; n += Vec::kTileW) {
    const int rows = static_cast<int>(std::min<int64_t>(Vec::kTileW, n_end - n));
    for (int64_t m = 0; m < a.M; m += Vec::kTileX) {
      const int inputs = static_cast<int>(std::min<int64_t>(Vec::kTileX, a.M - m));
      linear_tile_inputs<T, Vec::kTileX>(inputs, rows, w + n * a.ldw, a.ldw, x + m * a.ldx, a.ldx,
                                         bias != nullptr ? bias + n : nullptr, out + m * a.ldo + n, a.ldo, a.K);
    }
  }
}

// ---- helpers ---------------------------------------------------------------------------------------

// acc(v) over a row in vector steps with a masked tail; `body(offset, n)` gets n == W except at the end.
template <class F>
static inline void for_chunks(int64_t cols, F body) {
  int64_t c = 0;
  for (; c + W <= cols; c += W) body(c, W);
  if (c < cols) body(c, static_cast<int>(cols - c));
}

template <class T>
static inline R load_any(const T* p, int n) {
  return n == W ? Vec::load(p) : Vec::load_n(p, n);
}

template <class T>
static inline void store_any(T* p, R v, int n) {
  if (n == W)
    Vec::store(p, v);
  else
    Vec::store_n(p, v, n);
}

template <class T>
static inline R round_as(R v) {
  if constexpr (std::is_same_v<T, bf16>)
    return Vec::round_bf16(v);
  else
    return v;
}

// ---- prepacked linear -------------------------------------------------------------------------------

constexpr int kPanelVecs = static_cast<int>(kPanel) / W;

// How far ahead of its loads a one-row tile prefetches its panel (int8_impl.h measured the distance).
constexpr int64_t kPanelPrefetch = 4096;

// RX input rows (a slice of one transposed block) times `k_rows` rows of one panel: RX x kPanelVecs
// accumulators, each k one load per panel vector and one broadcast per row. float or widened-bf16
// panels. Starts from the sums in acc_out when `accumulate` (a later slice of k), else from zero.
template <class T, int RX>
static void packed_tile(const T* panel, const float* xt, int64_t k_rows, float* acc_out, bool accumulate) {
  R acc[RX][kPanelVecs];
  for (int j = 0; j < RX; ++j)
    for (int v = 0; v < kPanelVecs; ++v) acc[j][v] = accumulate ? Vec::load(acc_out + j * kPanel + v * W) : Vec::zero();
  for (int64_t k = 0; k < k_rows; ++k) {
    if constexpr (RX == 1) {  // as int8_tile: one row keeps too few loads in flight to stream the panel
      const char* ahead = reinterpret_cast<const char*>(panel + k * kPanel) + kPanelPrefetch;
      __builtin_prefetch(ahead, 0, 3);
      if constexpr (sizeof(T) * kPanel > 64) __builtin_prefetch(ahead + 64, 0, 3);
    }
    R w[kPanelVecs];
    for (int v = 0; v < kPanelVecs; ++v) w[v] = Vec::load(panel + k * kPanel + v * W);
    for (int j = 0; j < RX; ++j) {
      const R x = Vec::set1(xt[k * kPanelRows + j]);
      for (int v = 0; v < kPanelVecs; ++v) acc[j][v] = Vec::fma(x, w[v], acc[j][v]);
    }
  }
  for (int j = 0; j < RX; ++j)
    for (int v = 0; v < kPanelVecs; ++v) Vec::store(acc_out + j * kPanel + v * W, acc[j][v]);
}

#if CONDUIT_BF16_DOT
// The same over bf16 panels of k pairs (vdpbf16ps): x comes as pairs of bf16 in one uint32; `k_rows`
// counts pairs.
template <int RX>
static void packed_tile_pairs(const bf16* panel, const uint32_t* xt, int64_t k_rows, float* acc_out, bool accumulate) {
  R acc[RX][kPanelVecs];
  for (int j = 0; j < RX; ++j)
    for (int v = 0; v < kPanelVecs; ++v) acc[j][v] = accumulate ? Vec::load(acc_out + j * kPanel + v * W) : Vec::zero();
  for (int64_t kp = 0; kp < k_rows; ++kp) {
    __m512i w[kPanelVecs];
    for (int v = 0; v < kPanelVecs; ++v) w[v] = PanelPairs::load_w(panel + kp * kPanel * 2 + v * 32);
    for (int j = 0; j < RX; ++j)
      for (int v = 0; v < kPanelVecs; ++v) acc[j][v] = PanelPairs::fma(acc[j][v], w[v], xt[kp * kPanelRows + j]);
  }
  for (int j = 0; j < RX; ++j)
    for (int v = 0; v < kPanelVecs; ++v) Vec::store(acc_out + j * kPanel + v * W, acc[j][v]);
}
#endif

// The tile for `rows` rows (templates need constant sizes): the largest RX <= rows.
template <class T, int RX = Vec::kPackedRows>
static void packed_tile_rows(int rows, const T* panel, const void* xt, int64_t k_rows, float* acc, bool accumulate) {
  if constexpr (RX > 1) {
    if (rows < RX) return packed_tile_rows<T, RX - 1>(rows, panel, xt, k_rows, acc, accumulate);
  }
#if CONDUIT_BF16_DOT
  if constexpr (std::is_same_v<T, bf16>) {
    packed_tile_pairs<RX>(panel, static_cast<const uint32_t*>(xt), k_rows, acc, accumulate);
    return;
  }
#endif
  packed_tile<T, RX>(panel, static_cast<const float*>(xt), k_rows, acc, accumulate);
}

// k rows of one slice: the slice of a panel (16 KB) and of a transposed block (8 KB) stay in L1 while
// every row tile of the block reads them, instead of streaming the whole panel from L2 once per tile.
constexpr int64_t kSliceRows = 128;

template <class T>
static void packed_linear(const PackedLinearArgs& a, int64_t p0, int64_t p1) {
  const T* w = static_cast<const T*>(a.w);
  const T* bias = static_cast<const T*>(a.bias);
  T* out = static_cast<T*>(a.out);
#if CONDUIT_BF16_DOT
  constexpr bool pairs = std::is_same_v<T, bf16>;
#else
  constexpr bool pairs = false;
#endif
  const int64_t k_rows = pairs ? (a.K + 1) / 2 : a.K;  // rows of a panel and of a transposed block
  const int64_t row_elems = kPanel * (pairs ? 2 : 1);  // panel elements of one k row
  const int64_t panel_elems = k_rows * row_elems;
  const int64_t block_elems = k_rows * kPanelRows;  // floats or uint32 pairs
  // bf16 panels without vdpbf16ps: a block of several row tiles widens each slice to float once, into
  // `wide`, instead of once per row tile inside the FMA loop.
  constexpr bool widen = std::is_same_v<T, bf16> && !pairs;
  alignas(64) float acc[kPanelRows * kPanel];
  alignas(64) float wide[widen ? kSliceRows * kPanel : 1];
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t n0 = p * kPanel, cols = std::min<int64_t>(kPanel, a.N - n0);
    for (int64_t m0 = 0; m0 < a.M; m0 += kPanelRows) {
      const int64_t block_rows = std::min<int64_t>(kPanelRows, a.M - m0);
      const char* xt = static_cast<const char*>(a.xt) + (m0 / kPanelRows) * block_elems * 4;
      if (k_rows == 0) std::fill(acc, acc + kPanelRows * kPanel, 0.0f);
      for (int64_t k0 = 0; k0 < k_rows; k0 += kSliceRows) {
        const int64_t slice = std::min<int64_t>(kSliceRows, k_rows - k0);
        const T* panel = w + p * panel_elems + k0 * row_elems;
        auto row_tiles = [&](const auto* src) {  // every row tile of the block over this slice of `src`
          for (int64_t r = 0; r < block_rows; r += Vec::kPackedRows) {
            const int rows = static_cast<int>(std::min<int64_t>(Vec::kPackedRows, block_rows - r));
            packed_tile_rows(rows, src, xt + (k0 * kPanelRows + r) * 4, slice, acc + r * kPanel, k0 > 0);
          }
        };
        if constexpr (widen) {
          if (block_rows > Vec::kPackedRows) {
            for (int64_t i = 0; i < slice * kPanel; i += W) Vec::store(wide + i, Vec::load(panel + i));
            row_tiles(static_cast<const float*>(wide));
            continue;
          }
        }
        row_tiles(panel);
      }
      for (int64_t j = 0; j < block_rows; ++j) {
        T* dst = out + (m0 + j) * a.ldo + n0;
        for (int64_t c = 0; c < cols; c += W) {
          const int n = static_cast<int>(std::min<int64_t>(W, cols - c));
          R v = Vec::load(acc + j * kPanel + c);
          if (bias != nullptr) v = Vec::add(v, load_any(bias + n0 + c, n));
          store_any(dst + c, v, n);
        }
      }
    }
  }
}

// ---- row-wise: norms and gated activations -------------------------------------------------------

template <class T>
static void rms_norm_row(const T* x, const T* weight, T* out, int64_t cols, float eps) {
  R acc = Vec::zero();
  for_chunks(cols, [&](int64_t c, int n) {
    R v = load_any(x + c, n);
    acc = Vec::fma(v, v, acc);
  });
  const float inv = 1.0f / std::sqrt(Vec::reduce_add(acc) / static_cast<float>(cols) + eps);
  const R scale = Vec::set1(inv);
  for_chunks(cols, [&](int64_t c, int n) {
    R normed = round_as<T>(Vec::mul(load_any(x + c, n), scale));  // torch: (x * rsqrt).to(dtype) * weight
    store_any(out + c, Vec::mul(load_any(weight + c, n), normed), n);
  });
}

template <class T>
static void rms_norm(const RowArgs& a, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r)
    rms_norm_row(static_cast<const T*>(a.x) + r * a.ldx, static_cast<const T*>(a.weight),
                 static_cast<T*>(a.out) + r * a.ldo, a.cols, a.eps);
}

template <class T>
static void add_rms_norm(const RowArgs& a, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* x = static_cast<const T*>(a.x) + r * a.ldx;
    const T* res = static_cast<const T*>(a.residual) + r * a.ldr;
    T* sum = static_cast<T*>(a.sum) + r * a.lds;
    for_chunks(a.cols, [&](int64_t c, int n) { store_any(sum + c, Vec::add(load_any(x + c, n), load_any(res + c, n)), n); });
    rms_norm_row(static_cast<const T*>(sum), static_cast<const T*>(a.weight), static_cast<T*>(a.out) + r * a.ldo,
                 a.cols, a.eps);
  }
}

template <class T, R (*Act)(R)>
static void act_and_mul(const RowArgs& a, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* gate = static_cast<const T*>(a.x) + r * a.ldx;
    const T* up = gate + a.cols;
    T* out = static_cast<T*>(a.out) + r * a.ldo;
    for_chunks(a.cols, [&](int64_t c, int n) {
      R activated = round_as<T>(Act(load_any(gate + c, n)));  // torch: act(gate) in the dtype, then * up
      store_any(out + c, Vec::mul(activated, load_any(up + c, n)), n);
    });
  }
}

static R silu_vec(R x) { return silu<Vec>(x); }
static R gelu_tanh_vec(R x) { return gelu_tanh<Vec>(x); }

// ---- rotary and cache writes ---------------------------------------------------------------------

template <class T>
static void rotate_heads(T* base, int64_t heads, int64_t head_dim, const float* cos, const float* sin) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* x1 = base + h * head_dim;
    T* x2 = x1 + half;
    for_chunks(half, [&](int64_t c, int n) {
      R a = load_any(x1 + c, n), b = load_any(x2 + c, n);
      R co = load_any(cos + c, n), si = load_any(sin + c, n);
      store_any(x1 + c, Vec::sub(Vec::mul(a, co), Vec::mul(b, si)), n);
      store_any(x2 + c, Vec::fma(a, si, Vec::mul(b, co)), n);
    });
  }
}

template <class T>
static void rotary(const RotaryArgs& a, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    const float* cos = a.cos_sin + a.positions[t] * a.head_dim;
    const float* sin = cos + a.head_dim / 2;
    rotate_heads(static_cast<T*>(a.q) + t * a.ldq, a.num_q_heads, a.head_dim, cos, sin);
    rotate_heads(static_cast<T*>(a.k) + t * a.ldk, a.num_kv_heads, a.head_dim, cos, sin);
  }
}

template <class T>
static void write_kv(const WriteKvArgs& a, int64_t t0, int64_t t1) {
  const size_t bytes = static_cast<size_t>(a.row) * sizeof(T);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t slot = a.slots[t];
    if (slot < 0) continue;
    std::memcpy(static_cast<T*>(a.k_cache) + slot * a.row, static_cast<const T*>(a.k) + t * a.ldk, bytes);
    std::memcpy(static_cast<T*>(a.v_cache) + slot * a.row, static_cast<const T*>(a.v) + t * a.ldv, bytes);
  }
}

// Quantizing writes (common.h's layout): every head's row of k and v as codes and its scale. Scalar:
// one token's rows per layer and step, against the attention that reads the whole context.
template <class T>
static void write_kv_quant(const WriteKvArgs& a, int64_t t0, int64_t t1) {
  const int64_t D = a.head_dim, heads = a.row / D, head_bytes = D + kKvScaleBytes;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t slot = a.slots[t];
    if (slot < 0) continue;
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t at = (slot * heads + h) * head_bytes;
      quantize_kv_row(static_cast<const T*>(a.k) + t * a.ldk + h * D, D, a.format, static_cast<uint8_t*>(a.k_cache) + at);
      quantize_kv_row(static_cast<const T*>(a.v) + t * a.ldv + h * D, D, a.format, static_cast<uint8_t*>(a.v_cache) + at);
    }
  }
}

// ---- paged attention -------------------------------------------------------------------------------

// How attention reads one layer's cache: `heads(slot, h0, n, scratch)` gives kv heads [h0, h0 + n) of a
// slot as n rows of D elements back to back; `address` is where they start (for prefetching).
template <class T>
struct PlainCache {  // values of the compute dtype, read in place
  using E = T;
  const T* base;
  int64_t slot_row, D;
  PlainCache(const void* cache, const AttentionArgs& a)
      : base(static_cast<const T*>(cache)), slot_row(a.num_kv_heads * a.head_dim), D(a.head_dim) {}
  const T* heads(int64_t slot, int64_t h0, int64_t, float*) const { return base + slot * slot_row + h0 * D; }
  const void* address(int64_t slot, int64_t h0) const { return base + slot * slot_row + h0 * D; }
};

struct Int8Codes {
  static R load(const uint8_t* p, int n) { return n == W ? Vec::load_i8(p) : Vec::load_i8_n(p, n); }
};
struct Fp8Codes {
  static R load(const uint8_t* p, int n) { return n == W ? Vec::load_e4m3(p) : Vec::load_e4m3_n(p, n); }
};

template <class Codes>
struct QuantCache {  // codes and a scale per row, dequantized into float scratch as they are read
  using E = float;
  const uint8_t* base;
  int64_t slot_row, D;  // bytes of one slot's heads; head_dim
  QuantCache(const void* cache, const AttentionArgs& a)
      : base(static_cast<const uint8_t*>(cache)),
        slot_row(a.num_kv_heads * (a.head_dim + kKvScaleBytes)),
        D(a.head_dim) {}
  const float* heads(int64_t slot, int64_t h0, int64_t n, float* scratch) const {
    for (int64_t h = 0; h < n; ++h) {
      const uint8_t* row = base + slot * slot_row + (h0 + h) * (D + kKvScaleBytes);
      bf16 bits;
      std::memcpy(&bits.bits, row + D, kKvScaleBytes);
      const R scale = Vec::set1(bf16_to_float(bits));
      float* out = scratch + h * D;
      for_chunks(D, [&](int64_t c, int w) { store_any(out + c, Vec::mul(Codes::load(row + c, w), scale), w); });
    }
    return scratch;
  }
  const void* address(int64_t slot, int64_t h0) const { return base + slot * slot_row + h0 * (D + kKvScaleBytes); }
};

template <class T>
static inline float dot_row(const float* q, const T* k, int64_t d) {
  R acc = Vec::zero();
  for_chunks(d, [&](int64_t c, int n) { acc = Vec::fma(load_any(q + c, n), load_any(k + c, n), acc); });
  return Vec::reduce_add(acc);
}

// Four keys' dot products with one query at once: four independent FMA chains, each summed in the
// order dot_row sums, so the scores are dot_row's bit for bit.
template <class T>
static inline void dot_rows4(const float* q, const T* k0, const T* k1, const T* k2, const T* k3, int64_t d,
                             float* out) {
  R a0 = Vec::zero(), a1 = Vec::zero(), a2 = Vec::zero(), a3 = Vec::zero();
  for_chunks(d, [&](int64_t c, int n) {
    const R qv = load_any(q + c, n);
    a0 = Vec::fma(qv, load_any(k0 + c, n), a0);
    a1 = Vec::fma(qv, load_any(k1 + c, n), a1);
    a2 = Vec::fma(qv, load_any(k2 + c, n), a2);
    a3 = Vec::fma(qv, load_any(k3 + c, n), a3);
  });
  out[0] = Vec::reduce_add(a0);
  out[1] = Vec::reduce_add(a1);
  out[2] = Vec::reduce_add(a2);
  out[3] = Vec::reduce_add(a3);
}

// Softmax of row[0..n) in place, unnormalised (exp(x - max)); returns the sum of the exponentials.
static float softmax_row(float* row, int64_t n) {
  const int64_t full = n - n % W;
  float m = -INFINITY;
  if (full > 0) {
    R mx = Vec::load(row);
    for (int64_t c = W; c < full; c += W) mx = Vec::max(mx, Vec::load(row + c));
    m = Vec::reduce_max(mx);
  }
  for (int64_t c = full; c < n; ++c) m = std::max(m, row[c]);
  const R mv = Vec::set1(m);
  R sum = Vec::zero();
  for (int64_t c = 0; c < full; c += W) {
    R e = Vec::exp(Vec::sub(Vec::load(row + c), mv));
    Vec::store(row + c, e);
    sum = Vec::add(sum, e);
  }
  float total = Vec::reduce_add(sum);
  if (full < n) {  // lanes past n are never stored nor summed
    const int k = static_cast<int>(n - full);
    Vec::store_n(row + full, Vec::exp(Vec::sub(Vec::load_n(row + full, k), mv)), k);
    for (int64_t c = full; c < n; ++c) total += row[c];
  }
  return total;
}

// Scores of the queries of one item against every key they see, softmax, weighted sum of values.
// Keys are visited in cache order, each slot's heads of the item read as one contiguous row.
template <class T, class Cache>
static void attention_item(const AttentionArgs& a, const Cache& k_cache, const Cache& v_cache,
                           const AttentionItem& it, std::vector<float>& buf, float* rows_buf) {
  const int64_t D = a.head_dim, group = a.num_q_heads / a.num_kv_heads, bs = a.block_size;
  const int64_t heads = it.head_end - it.head_begin;
  const int64_t rows = heads * group;  // query heads of the item
  const int64_t nq = it.query_end - it.query_begin;
  const int64_t q_len = a.query_start[it.seq + 1] - a.query_start[it.seq];
  const int64_t first = a.seq_lens[it.seq] - q_len + it.query_begin;  // position of the first query
  const int64_t key_lo = a.window > 0 ? std::max<int64_t>(0, first - a.window + 1) : 0;
  const int64_t num_keys = first + nq - key_lo;
  buf.resize(static_cast<size_t>(nq * rows * (2 * D + num_keys)));
  float* q32 = buf.data();  // [nq][rows][D]
  float* acc = q32 + nq * rows * D;  // [nq][rows][D]
  float* scores = acc + nq * rows * D;  // [nq][rows][num_keys]
  const int32_t* table = a.block_tables + it.seq * a.ldb;
  auto visible = [&](int64_t qi, int64_t& lo, int64_t& hi) {
    hi = first + qi;
    lo = a.window > 0 ? std::max<int64_t>(0, hi - a.window + 1) : 0;
  };
  for (int64_t qi = 0; qi < nq; ++qi) {
    const T* src = static_cast<const T*>(a.q) + (a.query_start[it.seq] + it.query_begin + qi) * a.ldq +
                   it.head_begin * group * D;
    for (int64_t e = 0; e < rows * D; ++e) q32[qi * rows * D + e] = to_float(src[e]);
  }
  auto slot_of = [&](int64_t p) { return static_cast<int64_t>(table[p / bs]) * bs + p % bs; };
  const int64_t key_end = key_lo + num_keys;
  auto prefetch_ahead = [&](const Cache& cache, int64_t p) {
    if (p % bs == 0 && p + bs < key_end) __builtin_prefetch(cache.address(slot_of(p + bs), it.head_begin));
  };
  auto set_score = [&](int64_t qi, int64_t r, int64_t p, float dot) {
    float score = dot * a.scale;
    if (a.softcap > 0.0f) score = a.softcap * std::tanh(score / a.softcap);
    scores[(qi * rows + r) * num_keys + (p - key_lo)] = score;
  };
  auto rows_of = [&](const Cache& cache, int64_t p) {  // key p's rows of the item's kv heads
    prefetch_ahead(cache, p);
    return cache.heads(slot_of(p), it.head_begin, heads, rows_buf);
  };
  auto score_one = [&](int64_t qi, int64_t p, const typename Cache::E* k) {
    for (int64_t r = 0; r < rows; ++r) set_score(qi, r, p, dot_row(q32 + (qi * rows + r) * D, k + (r / group) * D, D));
  };
  auto score_key = [&](int64_t p) {
    const auto* k = rows_of(k_cache, p);
    for (int64_t qi = 0; qi < nq; ++qi) {
      int64_t lo, hi;
      visible(qi, lo, hi);
      if (p >= lo && p <= hi) score_one(qi, p, k);
    }
  };
  // A plain cache is read in place, so four keys' rows can be held at once: four scores a pass (and
  // below, four values into each output), the same sums in the same order as one key at a time. A
  // query that does not see all four takes the keys it sees one at a time.
  constexpr bool in_place = std::is_same_v<Cache, PlainCache<T>>;
  int64_t p4 = key_lo;
  if constexpr (in_place) {
    for (; p4 + 4 <= key_end; p4 += 4) {
      const typename Cache::E* k[4];
      for (int u = 0; u < 4; ++u) k[u] = rows_of(k_cache, p4 + u);
      for (int64_t qi = 0; qi < nq; ++qi) {
        int64_t lo, hi;
        visible(qi, lo, hi);
        if (p4 < lo || p4 + 3 > hi) {
          for (int u = 0; u < 4; ++u)
            if (p4 + u >= lo && p4 + u <= hi) score_one(qi, p4 + u, k[u]);
          continue;
        }
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t off = (r / group) * D;
          float dots[4];
          dot_rows4(q32 + (qi * rows + r) * D, k[0] + off, k[1] + off, k[2] + off, k[3] + off, D, dots);
          for (int u = 0; u < 4; ++u) set_score(qi, r, p4 + u, dots[u]);
        }
      }
    }
  }
  for (int64_t p = p4; p < key_end; ++p) score_key(p);
  float sums[64];
  std::vector<float> many;
  float* sum = nq * rows <= 64 ? sums : (many.resize(nq * rows), many.data());
  for (int64_t qi = 0; qi < nq; ++qi) {
    int64_t lo, hi;
    visible(qi, lo, hi);
    for (int64_t r = 0; r < rows; ++r)
      sum[qi * rows + r] = softmax_row(scores + (qi * rows + r) * num_keys + (lo - key_lo), hi - lo + 1);
  }
  std::fill(acc, acc + nq * rows * D, 0.0f);
  auto weight_of = [&](int64_t qi, int64_t r, int64_t p) {
    return Vec::set1(scores[(qi * rows + r) * num_keys + (p - key_lo)]);
  };
  auto add_one = [&](int64_t qi, int64_t p, const typename Cache::E* v) {
    for (int64_t r = 0; r < rows; ++r) {
      const R weight = weight_of(qi, r, p);
      float* o = acc + (qi * rows + r) * D;
      const auto* vr = v + (r / group) * D;
      for_chunks(D, [&](int64_t c, int n) { store_any(o + c, Vec::fma(weight, load_any(vr + c, n), load_any(o + c, n)), n); });
    }
  };
  auto add_value = [&](int64_t p) {
    const auto* v = rows_of(v_cache, p);
    for (int64_t qi = 0; qi < nq; ++qi) {
      int64_t lo, hi;
      visible(qi, lo, hi);
      if (p >= lo && p <= hi) add_one(qi, p, v);
    }
  };
  p4 = key_lo;
  if constexpr (in_place) {
    for (; p4 + 4 <= key_end; p4 += 4) {
      const typename Cache::E* v[4];
      for (int u = 0; u < 4; ++u) v[u] = rows_of(v_cache, p4 + u);
      for (int64_t qi = 0; qi < nq; ++qi) {
        int64_t lo, hi;
        visible(qi, lo, hi);
        if (p4 < lo || p4 + 3 > hi) {
          for (int u = 0; u < 4; ++u)
            if (p4 + u >= lo && p4 + u <= hi) add_one(qi, p4 + u, v[u]);
          continue;
        }
        for (int64_t r = 0; r < rows; ++r) {
          const R w0 = weight_of(qi, r, p4), w1 = weight_of(qi, r, p4 + 1);
          const R w2 = weight_of(qi, r, p4 + 2), w3 = weight_of(qi, r, p4 + 3);
          float* o = acc + (qi * rows + r) * D;
          const int64_t off = (r / group) * D;
          for_chunks(D, [&](int64_t c, int n) {
            R x = load_any(o + c, n);
            x = Vec::fma(w0, load_any(v[0] + off + c, n), x);
            x = Vec::fma(w1, load_any(v[1] + off + c, n), x);
            x = Vec::fma(w2, load_any(v[2] + off + c, n), x);
            x = Vec::fma(w3, load_any(v[3] + off + c, n), x);
            store_any(o + c, x, n);
          });
        }
      }
    }
  }
  for (int64_t p = p4; p < key_end; ++p) add_value(p);
  for (int64_t qi = 0; qi < nq; ++qi) {
    T* dst = static_cast<T*>(a.out) +
             ((a.query_start[it.seq] + it.query_begin + qi) * a.num_q_heads + it.head_begin * group) * D;
    for (int64_t r = 0; r < rows; ++r) {
      const R inv = Vec::set1(1.0f / sum[qi * rows + r]);
      const float* o = acc + (qi * rows + r) * D;
      for_chunks(D, [&](int64_t c, int n) { store_any(dst + r * D + c, Vec::mul(load_any(o + c, n), inv), n); });
    }
  }
}

// Heads narrower than a vector (stories260K's 8 on AVX-512): keys go across the lanes instead. Each
// chunk of up to W keys is transposed into [D][W] scratch once per kv head; a query head then takes D
// FMAs per chunk for its scores, and its weighted sum of values accumulates per (head, d) across lanes,
// reduced once at the end. Scores of keys a query does not see are zeroed after the softmax.
template <class T, class Cache>
static void attention_item_narrow(const AttentionArgs& a, const Cache& k_cache, const Cache& v_cache,
                                  const AttentionItem& it, std::vector<float>& buf, float* rows_buf) {
  const int64_t D = a.head_dim, group = a.num_q_heads / a.num_kv_heads, bs = a.block_size;
  const int64_t heads = it.head_end - it.head_begin, rows = heads * group;
  const int64_t nq = it.query_end - it.query_begin;
  const int64_t q_len = a.query_start[it.seq + 1] - a.query_start[it.seq];
  const int64_t first = a.seq_lens[it.seq] - q_len + it.query_begin;
  const int64_t key_lo = a.window > 0 ? std::max<int64_t>(0, first - a.window + 1) : 0;
  const int64_t num_keys = first + nq - key_lo;
  buf.assign(static_cast<size_t>(nq * rows * (D + num_keys + D * W + 1) + D * W), 0.0f);
  float* q32 = buf.data();  // [nq][rows][D]
  float* scores = q32 + nq * rows * D;  // [nq][rows][num_keys]
  float* acc = scores + nq * rows * num_keys;  // [nq][rows][D][W]
  float* sum = acc + nq * rows * D * W;  // [nq][rows]
  float* t = sum + nq * rows;  // [D][W]: one chunk of keys or values of one kv head, transposed
  const int32_t* table = a.block_tables + it.seq * a.ldb;
  for (int64_t qi = 0; qi < nq; ++qi) {
    const T* src = static_cast<const T*>(a.q) + (a.query_start[it.seq] + it.query_begin + qi) * a.ldq +
                   it.head_begin * group * D;
    for (int64_t e = 0; e < rows * D; ++e) q32[qi * rows * D + e] = to_float(src[e]) * a.scale;
  }
  auto transpose = [&](const Cache& cache, int64_t p0, int n, int64_t h) {
    for (int j = 0; j < n; ++j) {
      const int64_t p = p0 + j;
      const auto* row = cache.heads(static_cast<int64_t>(table[p / bs]) * bs + p % bs, it.head_begin + h, 1, rows_buf);
      for (int64_t d = 0; d < D; ++d) t[d * W + j] = to_float(row[d]);
    }
    for (int64_t d = 0; d < D; ++d)
      for (int j = n; j < W; ++j) t[d * W + j] = 0.0f;
  };
  for (int64_t p0 = key_lo; p0 < key_lo + num_keys; p0 += W) {
    const int n = static_cast<int>(std::min<int64_t>(W, key_lo + num_keys - p0));
    for (int64_t h = 0; h < heads; ++h) {
      transpose(k_cache, p0, n, h);
      for (int64_t qi = 0; qi < nq; ++qi)
        for (int64_t r = h * group; r < (h + 1) * group; ++r) {
          const float* qr = q32 + (qi * rows + r) * D;
          R s = Vec::zero();
          for (int64_t d = 0; d < D; ++d) s = Vec::fma(Vec::set1(qr[d]), Vec::load(t + d * W), s);
          if (a.softcap > 0.0f) {
            const R cap = Vec::set1(a.softcap);
            s = Vec::mul(cap, Vec::tanh(Vec::div(s, cap)));
          }
          store_any(scores + (qi * rows + r) * num_keys + (p0 - key_lo), s, n);
        }
    }
  }
  for (int64_t qi = 0; qi < nq; ++qi) {
    const int64_t hi = first + qi, lo = a.window > 0 ? std::max<int64_t>(0, hi - a.window + 1) : 0;
    for (int64_t r = 0; r < rows; ++r) {
      float* row = scores + (qi * rows + r) * num_keys;
      sum[qi * rows + r] = softmax_row(row + (lo - key_lo), hi - lo + 1);
      std::fill(row, row + (lo - key_lo), 0.0f);
      std::fill(row + (hi - key_lo + 1), row + num_keys, 0.0f);
    }
  }
  for (int64_t p0 = key_lo; p0 < key_lo + num_keys; p0 += W) {
    const int n = static_cast<int>(std::min<int64_t>(W, key_lo + num_keys - p0));
    for (int64_t h = 0; h < heads; ++h) {
      transpose(v_cache, p0, n, h);
      for (int64_t qi = 0; qi < nq; ++qi)
        for (int64_t r = h * group; r < (h + 1) * group; ++r) {
          const R w = load_any(scores + (qi * rows + r) * num_keys + (p0 - key_lo), n);
          float* o = acc + (qi * rows + r) * D * W;
          for (int64_t d = 0; d < D; ++d) Vec::store(o + d * W, Vec::fma(w, Vec::load(t + d * W), Vec::load(o + d * W)));
        }
    }
  }
  for (int64_t qi = 0; qi < nq; ++qi) {
    T* dst = static_cast<T*>(a.out) +
             ((a.query_start[it.seq] + it.query_begin + qi) * a.num_q_heads + it.head_begin * group) * D;
    for (int64_t r = 0; r < rows; ++r) {
      const float inv = 1.0f / sum[qi * rows + r];
      for (int64_t d = 0; d < D; ++d)
        dst[r * D + d] = from_float<T>(Vec::reduce_add(Vec::load(acc + ((qi * rows + r) * D + d) * W)) * inv);
    }
  }
}

template <class T, class Cache>
static void attention_over(const AttentionArgs& a, int64_t item_begin, int64_t item_end) {
  std::vector<float> buf, rows(static_cast<size_t>(a.num_kv_heads * a.head_dim));  // rows: dequantized heads
  const Cache k_cache(a.k_cache, a), v_cache(a.v_cache, a);
  for (int64_t i = item_begin; i < item_end; ++i) {
    if (a.head_dim < W)
      attention_item_narrow<T>(a, k_cache, v_cache, a.items[i], buf, rows.data());
    else
      attention_item<T>(a, k_cache, v_cache, a.items[i], buf, rows.data());
  }
}

// ---- int8 linear ----------------------------------------------------------------------------------

#include "int8_impl.h"

template <class T>
static void attention(const AttentionArgs& a, int64_t b, int64_t e) { attention_over<T, PlainCache<T>>(a, b, e); }
template <class T>
static void attention_int8(const AttentionArgs& a, int64_t b, int64_t e) { attention_over<T, QuantCache<Int8Codes>>(a, b, e); }
template <class T>
static void attention_fp8(const AttentionArgs& a, int64_t b, int64_t e) { attention_over<T, QuantCache<Fp8Codes>>(a, b, e); }

// ---- LoRA --------------------------------------------------------------------------------------------

#include "lora_impl.h"

// ---- the table ------------------------------------------------------------------------------------

template <class T>
static constexpr TypedKernels typed_kernels() {
  return TypedKernels{
      &linear<T>,      &packed_linear<T>, &rms_norm<T>, &add_rms_norm<T>, &act_and_mul<T, silu_vec>,
      &act_and_mul<T, gelu_tanh_vec>, &rotary<T>, &write_kv<T>, &attention<T>, &int8_linear<T>,
      &write_kv_quant<T>, &attention_int8<T>, &attention_fp8<T>, &lora_shrink<T>,
      &lora_expand<T>,
  };
}

static constexpr KernelTable make_table(const char* name) {
  return KernelTable{name, typed_kernels<float>(), typed_kernels<bf16>(), Vec::kGemvRows, CONDUIT_BF16_DOT != 0,
                     CONDUIT_INT8 == 3};
}

}  // namespace CONDUIT_ISA
}  // namespace conduit_cpu
