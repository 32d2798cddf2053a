// Shared by every translation unit of the CPU kernels: the bf16 storage type, the argument structs
// and the table of entry points that each ISA file (isa_*.cpp) fills in. No torch header: the ISA files
// compile in seconds and never see ATen; bindings.cpp alone includes torch and does the threading.
//
// Layout: every tensor is row-major; a "row stride" (ld*) is counted in elements. Weights of a linear
// layer are [N, K] (nn.Linear's layout, used as it is: no prepacking is needed for dot-product tiles).
// The paged KV cache of one layer is [num_blocks, block_size, num_kv_heads, head_dim], contiguous.
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
template <class T>
inline T from_float(float x);
template <>
inline float from_float<float>(float x) { return x; }
template <>
inline bf16 from_float<bf16>(float x) { return float_to_bf16(x); }

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
using RowFn = void (*)(const RowArgs&, int64_t row_begin, int64_t row_end);
// LoRA per row (BGMV): y[t] += (a[slot] x[t]) b[slot] for the rows t whose slot is >= 0. a [slots, SR, K],
// b [slots, SR, N] block-diagonal (columns [0, split1) read shrink rows [0, R), [split1, split2) the next R,
// the rest the last R).
struct LoraRowArgs {
  const void* x;
  int64_t ldx;
  const void* a;
  const void* b;
  void* y;
  int64_t ldy;
  const int32_t* row_slots;
  int64_t K, N, S, R, split1, split2;
};

using LoraRowsFn = void (*)(const LoraRowArgs&, int64_t row_begin, int64_t row_end);
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
  LoraRowsFn lora_rows;
};

// Everything one instruction set offers; `linear_rows` is the output-column granularity of `linear`
// (ranges handed to it should be multiples of it, except at the end).
struct KernelTable {
  const char* name;
  TypedKernels f32;
  TypedKernels bf16;
  int64_t linear_rows;
  bool bf16_pairs;  // bf16 panels pair consecutive k (vdpbf16ps); else they are widened per value
};

extern const KernelTable avx512bf16_table;
extern const KernelTable avx512_table;
extern const KernelTable avx2_table;
extern const KernelTable scalar_table;

}  // namespace conduit_cpu
