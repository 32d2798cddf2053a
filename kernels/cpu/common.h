// Shared by every translation unit of the CPU kernels: the bf16 storage type, the argument structs
// and the table of entry points that each ISA file (isa_*.cpp) fills in. No torch header: the ISA files
// compile in seconds and never see ATen; bindings.cpp alone includes torch and does the threading.
//
// Layout: every tensor is row-major; a "row stride" (ld*) is counted in elements. Weights of a linear
// layer are [N, K] (nn.Linear's layout, used as it is: no prepacking is needed for dot-product tiles).
// The paged KV cache of one layer is [num_blocks, block_size, num_kv_heads, head_dim], contiguous.
// A quantized cache (--kv-cache-dtype int8 | fp8) is [num_blocks, block_size, num_kv_heads, head_dim + 2]
// bytes: each (token, kv head) row is head_dim codes (int8, or fp8 e4m3fn), then its scale as a bf16
// (ops/kv_quant.py is the reference: scale = bf16(amax / QMAX), code = round(x / scale), value = code * scale).
// Limits: sizes fit int64; head_dim <= 512; attention scratch is num_keys floats per query head.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace conduit_cpu {

// bit-compatible with torch.bfloat16 (c10::BFloat16 stores its 16 bits the same way)
struct bf16 {
  uint16_t bits;
};

inline float bf16_to_float(bf16 h) {
  uint32_t u = static_cast<uint32_t>(h.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, NaN to the quiet NaN 0x7FC0: torch's float -> bfloat16 conversion.
inline bf16 float_to_bf16(float f) {
  if (std::isnan(f)) return bf16{0x7FC0};
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return bf16_to_float(x); }
// fp8 e4m3fn (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinities) in software. Decoding
// shifts the exponent and mantissa into a float's and rescales by 2^(127 - 7), which also gives the
// subnormals exactly; the NaN codes (0x7F, 0xFF) are never written (codes are clamped to +-448).
inline float fp8_e4m3_to_float(uint8_t x) {
  const uint32_t bits = static_cast<uint32_t>(x & 0x7Fu) << 20;
  float f;
  std::memcpy(&f, &bits, 4);
  f *= 0x1p120f;
  return (x & 0x80u) ? -f : f;
}

// Round to nearest even, as torch (c10::Float8_e4m3fn) converts; |f| >= 480 becomes NaN, as there.
inline uint8_t float_to_fp8_e4m3(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  uint8_t result;
  if (bits >= (1087u << 20)) {
    result = 0x7F;
  } else if (bits < (121u << 23)) {  // below the smallest normal: add 2^-6 * 2^... (denorm trick)
    constexpr uint32_t denorm_mask = 141u << 23;
    float magnitude, denorm;
    std::memcpy(&magnitude, &bits, 4);
    std::memcpy(&denorm, &denorm_mask, 4);
    magnitude += denorm;
    std::memcpy(&bits, &magnitude, 4);
    result = static_cast<uint8_t>(bits - denorm_mask);
  } else {
    const uint32_t mant_odd = (bits >> 20) & 1u;
    bits += (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu + mant_odd;
    result = static_cast<uint8_t>(bits >> 20);
  }
  return static_cast<uint8_t>(result | (sign >> 24));
}

// Formats of a KV cache's elements (WriteKvArgs.format).
enum KvFormat : int32_t { kKvPlain = 0, kKvInt8 = 1, kKvFp8 = 2 };
constexpr int64_t kKvScaleBytes = 2;

template <class T>
inline T from_float(float x);
template <>
inline float from_float<float>(float x) { return x; }
template <>
inline bf16 from_float<bf16>(float x) { return float_to_bf16(x); }

// One head's row x [D] as codes and scale (the layout above): dst [D + kKvScaleBytes].
template <class T>
inline void quantize_kv_row(const T* x, int64_t D, int32_t format, uint8_t* dst) {
  float amax = 0.0f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(to_float(x[d])));
  const float qmax = format == kKvInt8 ? 127.0f : 448.0f;
  const bf16 scale_bits = float_to_bf16(amax / qmax);
  const float scale = bf16_to_float(scale_bits);
  for (int64_t d = 0; d < D; ++d) {
    const float y = scale > 0.0f ? std::min(std::max(to_float(x[d]) / scale, -qmax), qmax) : 0.0f;
    dst[d] = format == kKvInt8 ? static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(y))) : float_to_fp8_e4m3(y);
  }
  std::memcpy(dst + D, &scale_bits.bits, kKvScaleBytes);
}

// out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), for the output columns n in [n_begin, n_end).
struct LinearArgs {
  const void* x;
  int64_t ldx;
  const void* w;
  int64_t ldw;
  const void* bias;  // nullptr: none
  void* out;
  int64_t ldo;
  int64_t M, N, K;
};

// Prepacked linear (ops.h PackedLinear): the weight [N, K] as panels of kPanel output columns, each
// stored K-major, [ceil(N / kPanel)][K][kPanel] (zero columns past N), so a tile reads one contiguous
// panel row per k and every input row's broadcast value multiplies all kPanel columns at once (no
// horizontal sums). With `bf16_pairs` (AVX512_BF16) bf16 panels pair consecutive k instead,
// [panels][ceil(K / 2)][kPanel][2], the operand layout of vdpbf16ps. The input is handed over transposed
// in blocks of kPanelRows rows: float [blocks][K][kPanelRows], or (bf16 pairs) uint32 pairs of bf16
// [blocks][ceil(K / 2)][kPanelRows].
constexpr int64_t kPanel = 32;
constexpr int64_t kPanelRows = 16;

struct PackedLinearArgs {
  const void* xt;  // the transposed input blocks
  const void* w;  // the panels
  const void* bias;  // [N] or nullptr
  void* out;  // [M, N], row stride ldo
  int64_t ldo;
  int64_t M, N, K;
};

// Int8 linear (W8A8, int8_impl.h): x quantized per row to int8 [M, ldx] (ldx = 4 * K4 bytes, zero
// padded; biased by 128 where `int8_unsigned_x`), times int8 panels [ceil(N / kPanel)][K4][kPanel][4]
// (k in quads: the operand layout of vpdpbusd, zero past N and K), summed in int32;
// out[m, n] = float(acc - w_comp[n]) * (x_scale[m] * w_scale[n]) + bias[n].
struct Int8LinearArgs {
  const int8_t* xq;
  int64_t ldx;
  const float* x_scale;  // [M]
  const void* w;  // the panels
  const int32_t* w_comp;  // [panels * kPanel]: 128 * sum_k w[n, k] when x is biased, else nullptr
  const float* w_scale;  // [panels * kPanel], zero past N
  const void* bias;  // [N] in the output dtype, or nullptr
  void* out;  // [M, N], row stride ldo
  int64_t ldo;
  int64_t M, N, K4;
};

// Row-wise ops over `rows` rows of `cols` values; strides in elements.
struct RowArgs {
  const void* x;
  int64_t ldx;
  const void* residual;  // add_rms_norm: x + residual is written to `sum` and normalised
  int64_t ldr;
  void* sum;
  int64_t lds;
  const void* weight;  // rms norm weight [cols]
  void* out;
  int64_t ldo;
  int64_t cols;
  float eps;
};

// Rotate-half RoPE in place on q [T, Hq, D] and k [T, Hk, D] (head stride D, token strides ldq, ldk).
struct RotaryArgs {
  void* q;
  int64_t ldq;
  int64_t num_q_heads;
  void* k;
  int64_t ldk;
  int64_t num_kv_heads;
  int64_t head_dim;
  const int64_t* positions;
  const float* cos_sin;  // [max_positions, head_dim]: cos in [:, :D/2], sin in [:, D/2:]
  int64_t max_positions;
};

// k, v [T, Hk, D] (token strides ldk, ldv) into the caches at slot_mapping[t]; slot -1 is skipped.
struct WriteKvArgs {
  const void* k;
  int64_t ldk;
  const void* v;
  int64_t ldv;
  void* k_cache;
  void* v_cache;
  const int64_t* slots;
  int64_t row;  // Hk * D: one token's values
  int64_t head_dim;
  int32_t format;  // KvFormat: quantized caches take rows of head_dim + kKvScaleBytes bytes per head
};

// One unit of attention work: queries [query_begin, query_end) of sequence `seq` (indices within its
// chunk of this step) in the query heads of kv heads [head_begin, head_end).
struct AttentionItem {
  int32_t seq, head_begin, head_end, query_begin, query_end;
};

// Causal attention of packed queries over the paged cache, one AttentionItem at a time.
struct AttentionArgs {
  const void* q;  // [T, Hq, D], token stride ldq, head stride D
  int64_t ldq;
  const void* k_cache;
  const void* v_cache;
  void* out;  // [T, Hq, D] contiguous
  const int32_t* query_start;  // [S + 1]
  const int32_t* seq_lens;  // [S]
  const int32_t* block_tables;  // [S, ldb]
  int64_t ldb;
  int64_t block_size;
  int64_t num_q_heads, num_kv_heads, head_dim;
  float scale;
  int64_t window;  // 0: none
  float softcap;  // 0: none
  const AttentionItem* items;
};

using LinearFn = void (*)(const LinearArgs&, int64_t n_begin, int64_t n_end);
using PackedLinearFn = void (*)(const PackedLinearArgs&, int64_t panel_begin, int64_t panel_end);
using Int8LinearFn = void (*)(const Int8LinearArgs&, int64_t panel_begin, int64_t panel_end);
using RowFn = void (*)(const RowArgs&, int64_t row_begin, int64_t row_end);
// LoRA deltas, the punica / S-LoRA grouping: the step's adapter rows grouped by slot, in segments of at
// most kLoraSegmentRows rows (lora.cpp: made once per step). Segment s runs slot seg_slot[s] over the
// rows rows[seg_begin[s] .. seg_begin[s + 1]). a [slots, S*R, K] is the shrink, b [slots, S*R, N] the
// expand, block-diagonal: columns [0, split1) read shrink rows [0, R), [split1, split2) the next R, the
// rest the last R. h [rows.size(), S*R] float is the shrink's output, row i for the row rows[i].
//   shrink, items (segment, kLoraShrinkRows rows of a): h[i] = a[slot] x[rows[i]], in float
//   expand, items kLoraExpandCols output columns: y[rows[i]] += h[i] b[slot] over those columns
constexpr int64_t kLoraSegmentRows = 64;
constexpr int64_t kLoraShrinkRows = 4;
constexpr int64_t kLoraExpandCols = 32;

struct LoraArgs {
  const void* x;
  int64_t ldx;
  const void* a;
  const void* b;
  void* y;
  int64_t ldy;
  const int64_t* rows;
  const int64_t* seg_begin;  // [segments + 1]
  const int32_t* seg_slot;  // [segments]
  int64_t segments;
  float* h;
  int64_t K, N, S, R, split1, split2;
};

using LoraFn = void (*)(const LoraArgs&, int64_t item_begin, int64_t item_end);
using RotaryFn = void (*)(const RotaryArgs&, int64_t token_begin, int64_t token_end);
using WriteKvFn = void (*)(const WriteKvArgs&, int64_t token_begin, int64_t token_end);
using AttentionFn = void (*)(const AttentionArgs&, int64_t item_begin, int64_t item_end);

// One dtype's entry points.
struct TypedKernels {
  LinearFn linear;
  PackedLinearFn packed_linear;
  RowFn rms_norm;
  RowFn add_rms_norm;
  RowFn silu_and_mul;  // x [rows, 2 * cols] -> out [rows, cols]
  RowFn gelu_tanh_and_mul;
  RotaryFn rotary;
  WriteKvFn write_kv;
  AttentionFn attention;
  Int8LinearFn int8_linear;  // output (and bias) in this dtype
  WriteKvFn write_kv_quant;  // into an int8 or fp8 cache (WriteKvArgs.format)
  AttentionFn attention_int8;  // over an int8 cache (q and out in this dtype)
  AttentionFn attention_fp8;  // over an fp8 e4m3 cache
  LoraFn lora_shrink;  // items: (segment, kLoraShrinkRows rows of a)
  LoraFn lora_expand;  // items: blocks of kLoraExpandCols output columns
};

// Everything one instruction set offers; `linear_rows` is the output-column granularity of `linear`
// (ranges handed to it should be multiples of it, except at the end).
struct KernelTable {
  const char* name;
  TypedKernels f32;
  TypedKernels bf16;
  int64_t linear_rows;
  bool bf16_pairs;  // bf16 panels pair consecutive k (vdpbf16ps); else they are widened per value
  bool int8_unsigned_x;  // the int8 linear takes x biased by 128 (vpdpbusd: unsigned times signed bytes)
};

extern const KernelTable avx512bf16_table;
extern const KernelTable avx512_table;
extern const KernelTable avx2_table;
extern const KernelTable scalar_table;

}  // namespace conduit_cpu
