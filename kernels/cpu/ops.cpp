// The torch-level ops of ops.h: checks, pointers, and the split of each call over ATen's thread pool.
// Grid: linear splits output columns, row ops split rows, rotary splits tokens, attention splits
// (sequence, query block, kv heads) items; calls under kMinParallelWork run on the calling thread.
#include "ops.h"

#include <ATen/Parallel.h>

#include "parallel.h"

namespace conduit_cpu {
namespace {

// Rows of float32 input from which PackedLinear hands the product to torch's GEMM.
constexpr int64_t kTorchGemmRows = 32;

// Most rows of x for which the tiles beat torch's GEMM, measured on AVX-512 (Zen 5): float32 tiles stay
// ahead up to 64 rows; oneDNN's bfloat16 GEMM (packed weights, AVX512_BF16) wins from a few rows.
int64_t linear_max_rows(at::ScalarType dtype) { return dtype == at::kBFloat16 ? 4 : 64; }

const TypedKernels& kernels_for(const KernelTable& table, const at::Tensor& t, const char* what) {
  if (t.scalar_type() == at::kFloat) return table.f32;
  if (t.scalar_type() == at::kBFloat16) return table.bf16;
  TORCH_CHECK(false, what, ": the CPU kernels take float32 or bfloat16, got ", t.scalar_type());
}

void check_cpu(const at::Tensor& t, const char* what, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), what, ": expected a CPU tensor");
  TORCH_CHECK(t.dim() == dim, what, ": expected ", dim, " dimensions, got ", t.dim());
}

void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* what) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), what, ": dtype ", b.scalar_type(), " differs from ",
              a.scalar_type());
}

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.stride(-1) == 1, what, ": the last dimension must be contiguous");
}

RowArgs row_args(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, float eps) {
  RowArgs a{};
  a.x = x.data_ptr();
  a.ldx = x.stride(0);
  a.weight = weight.data_ptr();
  a.out = out.data_ptr();
  a.ldo = out.stride(0);
  a.cols = out.size(1);
  a.eps = eps;
  return a;
}

void run_rows(RowFn fn, const RowArgs& args, int64_t rows) {
  parallel_chunks(rows, grain(rows, args.cols), [&](int64_t b, int64_t e) { fn(args, b, e); });
}

void check_norm(const at::Tensor& x, const at::Tensor& weight) {
  check_cpu(x, "rms_norm: x", 2);
  check_rows(x, "rms_norm: x");
  check_same_dtype(x, weight, "rms_norm: weight");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "rms_norm: weight must be contiguous [", x.size(1), "]");
}




void check_heads(const at::Tensor& t, const char* what) {
  check_cpu(t, what, 3);
  TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == t.size(2), what, ": heads must be contiguous [T, H, D] rows");
}


// The cache's element format: the compute dtype (that of `like`), or int8 / fp8 codes with scales.
KvFormat kv_format(const at::Tensor& cache) {
  if (cache.scalar_type() == at::kChar) return kKvInt8;
  if (cache.scalar_type() == at::ScalarType::Float8_e4m3fn) return kKvFp8;
  return kKvPlain;
}

// A cache of `like`'s dtype [.., head_dim], or quantized [.., head_dim + 2]; returns its format.
KvFormat check_cache(const at::Tensor& cache, const at::Tensor& like, const char* what) {
  check_cpu(cache, what, 4);
  TORCH_CHECK(cache.is_contiguous(), what, ": must be contiguous [blocks, block_size, kv_heads, head_dim]");
  const KvFormat format = kv_format(cache);
  if (format == kKvPlain) check_same_dtype(like, cache, what);
  return format;
}

// Elements of the cache's last dimension for heads of `head_dim` values.
int64_t cache_row(KvFormat format, int64_t head_dim) {
  return format == kKvPlain ? head_dim : head_dim + kKvScaleBytes;
}


// Queries of one prefill chunk handled by one work item: its keys are read once for all of them.
constexpr int64_t kQueryBlock = 16;

// The work items of a step: every sequence's queries in blocks of kQueryBlock, over all kv heads, or
// over slices of them when there are too few items to keep every thread busy.
std::vector<AttentionItem> attention_items(const int32_t* qs, int64_t S, int64_t Hk) {
  int64_t blocks = 0;
  for (int64_t s = 0; s < S; ++s) blocks += (qs[s + 1] - qs[s] + kQueryBlock - 1) / kQueryBlock;
  const int64_t wanted = 2 * static_cast<int64_t>(at::get_num_threads());
  const int64_t slices = blocks >= wanted ? 1 : std::min(Hk, (wanted + blocks - 1) / std::max<int64_t>(1, blocks));
  std::vector<AttentionItem> items;
  items.reserve(static_cast<size_t>(blocks * slices));
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q_len = qs[s + 1] - qs[s];
    for (int64_t q0 = 0; q0 < q_len; q0 += kQueryBlock)
      for (int64_t h = 0; h < slices; ++h)
        items.push_back({static_cast<int32_t>(s), static_cast<int32_t>(Hk * h / slices),
                         static_cast<int32_t>(Hk * (h + 1) / slices), static_cast<int32_t>(q0),
                         static_cast<int32_t>(std::min(q_len, q0 + kQueryBlock))});
  }
  return items;
}


template <class T>
void pack_panels(const T* w, T* out, int64_t N, int64_t K, bool pairs) {
  const int64_t panels = (N + kPanel - 1) / kPanel, k_rows = pairs ? (K + 1) / 2 : K;
  const int64_t per_panel = k_rows * kPanel * (pairs ? 2 : 1);
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      T* dst = out + p * per_panel;
      for (int64_t kr = 0; kr < k_rows; ++kr)
        for (int64_t c = 0; c < kPanel; ++c) {
          const int64_t n = p * kPanel + c;
          for (int64_t e = 0; e < (pairs ? 2 : 1); ++e) {
            const int64_t k = pairs ? 2 * kr + e : kr;
            *dst++ = (n < N && k < K) ? w[n * K + k] : T{};
          }
        }
    }
  });
}

// x [M, K] -> the transposed blocks the packed tiles read (common.h)
template <class T>
at::Tensor transpose_blocks(const at::Tensor& x, bool pairs) {
  const int64_t M = x.size(0), K = x.size(1), ld = x.stride(0);
  const int64_t blocks = (M + kPanelRows - 1) / kPanelRows, k_rows = pairs ? (K + 1) / 2 : K;
  at::Tensor xt = at::zeros({blocks * k_rows * kPanelRows}, x.options().dtype(at::kFloat));
  const T* src = static_cast<const T*>(x.data_ptr());
  if (pairs) {
    uint32_t* dst = reinterpret_cast<uint32_t*>(xt.data_ptr<float>());
    for (int64_t m = 0; m < M; ++m) {
      const uint16_t* row = reinterpret_cast<const uint16_t*>(src + m * ld);
      uint32_t* col = dst + (m / kPanelRows) * k_rows * kPanelRows + m % kPanelRows;
      for (int64_t kp = 0; kp < k_rows; ++kp) {
        const uint32_t hi = 2 * kp + 1 < K ? row[2 * kp + 1] : 0;
        col[kp * kPanelRows] = static_cast<uint32_t>(row[2 * kp]) | (hi << 16);
      }
    }
  } else {
    float* dst = xt.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m) {
      float* col = dst + (m / kPanelRows) * K * kPanelRows + m % kPanelRows;
      for (int64_t k = 0; k < K; ++k) col[k * kPanelRows] = to_float(src[m * ld + k]);
    }
  }
  return xt;
}

// int8 w [N, K] -> panels [P][K4][kPanel][4], the column sums (times 128) and the scales padded to P * kPanel
void pack_int8_panels(const int8_t* w, int8_t* out, int32_t* comp, const float* scale, float* scale_out, int64_t N,
                      int64_t K, int64_t K4) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      int8_t* dst = out + p * K4 * kPanel * 4;
      for (int64_t c = 0; c < kPanel; ++c) {
        const int64_t n = p * kPanel + c;
        int32_t sum = 0;
        if (n < N) {
          const int8_t* row = w + n * K;
          for (int64_t k = 0; k < K; ++k) sum += row[k];
          const int64_t whole = K / 4;  // quads copied as 4 bytes, the last one padded with zeros
          for (int64_t q = 0; q < whole; ++q) std::memcpy(dst + (q * kPanel + c) * 4, row + 4 * q, 4);
          for (int64_t k = 4 * whole; k < K4 * 4; ++k) dst[((k / 4) * kPanel + c) * 4 + k % 4] = k < K ? row[k] : 0;
        } else {
          for (int64_t q = 0; q < K4; ++q) std::memset(dst + (q * kPanel + c) * 4, 0, 4);
        }
        comp[n] = 128 * sum;
        scale_out[n] = n < N ? scale[n] : 0.0f;
      }
    }
  });
}

// x [M, K] float32 or bf16 -> int8 rows [M, ldq >= K] (ops/quant.py quantize_rows: scale max|x| / 127,
// q = round-half-even(x * (127 / max|x|)), |q| <= 127), biased by 128 when `biased`; scales [M]
template <class T>
void quantize_rows(const at::Tensor& x, int64_t ldq, bool biased, int8_t* q, float* scales) {
  const int64_t M = x.size(0), K = x.size(1), ld = x.stride(0);
  const T* src = static_cast<const T*>(x.data_ptr());
  auto rows = [&](int64_t m0, int64_t m1) {
    std::vector<float> row(static_cast<size_t>(K));
    for (int64_t m = m0; m < m1; ++m) {
      float amax = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        row[k] = to_float(src[m * ld + k]);
        amax = std::max(amax, std::fabs(row[k]));
      }
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int8_t* dst = q + m * ldq;
      const int8_t bias = biased ? int8_t(-128) : int8_t(0);
      for (int64_t k = 0; k < K; ++k) {
        // round half to even by the 1.5 * 2^23 trick (exact for |v| < 2^22; here |v| <= 127): nearbyint's
        // result without its library call, so the loop vectorizes
        const float v = std::min(127.0f, std::max(-127.0f, (row[k] * inv + 12582912.0f) - 12582912.0f));
        dst[k] = static_cast<int8_t>(static_cast<int>(v) ^ (biased ? 0x80 : 0));
      }
      for (int64_t k = K; k < ldq; ++k) dst[k] = bias;  // q = 0 (its weights are zero anyway)
      scales[m] = amax / 127.0f;
    }
  };
  parallel_chunks(M, grain(M, K), rows);
}

}  // namespace

PackedLinear::PackedLinear(const KernelTable& table, const at::Tensor& weight, const at::Tensor& scale)
    : table_(table), int8_(true) {
  check_cpu(weight, "pack_linear_int8: weight", 2);
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == at::kChar,
              "pack_linear_int8: weight must be contiguous int8");
  N_ = weight.size(0);
  K_ = weight.size(1);
  TORCH_CHECK(scale.device().is_cpu() && scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.numel() == N_,
              "pack_linear_int8: scale must be contiguous float32 [", N_, "]");
  K4_ = (K_ + 3) / 4;
  const int64_t panels = (N_ + kPanel - 1) / kPanel;
  panels_ = at::empty({panels * K4_ * kPanel * 4}, weight.options());
  w_comp_ = at::empty({panels * kPanel}, weight.options().dtype(at::kInt));
  w_scale_ = at::empty({panels * kPanel}, scale.options());
  pack_int8_panels(weight.data_ptr<int8_t>(), panels_.data_ptr<int8_t>(), w_comp_.data_ptr<int32_t>(),
                   scale.data_ptr<float>(), w_scale_.data_ptr<float>(), N_, K_, K4_);
}

std::tuple<at::Tensor, at::Tensor> quantize_rows_int8(const at::Tensor& x) {
  check_cpu(x, "quantize_rows: x", 2);
  check_rows(x, "quantize_rows: x");
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor s = at::empty({M}, x.options().dtype(at::kFloat));
  if (x.scalar_type() == at::kFloat)
    quantize_rows<float>(x, K, false, q.data_ptr<int8_t>(), s.data_ptr<float>());
  else if (x.scalar_type() == at::kBFloat16)
    quantize_rows<bf16>(x, K, false, q.data_ptr<int8_t>(), s.data_ptr<float>());
  else
    TORCH_CHECK(false, "quantize_rows: x must be float32 or bfloat16, got ", x.scalar_type());
  return {q, s};
}

at::Tensor PackedLinear::forward_int8(const at::Tensor& x, const void* bias) const {
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, N_}, x.options());
  if (M == 0 || N_ == 0) return out;
  at::Tensor xq = at::empty({M, 4 * K4_}, x.options().dtype(at::kChar));
  at::Tensor xs = at::empty({M}, x.options().dtype(at::kFloat));
  const bool biased = table_.int8_unsigned_x;
  if (x.scalar_type() == at::kFloat)
    quantize_rows<float>(x, 4 * K4_, biased, xq.data_ptr<int8_t>(), xs.data_ptr<float>());
  else
    quantize_rows<bf16>(x, 4 * K4_, biased, xq.data_ptr<int8_t>(), xs.data_ptr<float>());
  const Int8LinearArgs args{xq.data_ptr<int8_t>(), 4 * K4_, xs.data_ptr<float>(), panels_.data_ptr(),
                            biased ? w_comp_.data_ptr<int32_t>() : nullptr, w_scale_.data_ptr<float>(), bias,
                            out.data_ptr(), N_, M, N_, K4_};
  const auto fn = kernels_for(table_, x, "linear").int8_linear;
  const int64_t panels = (N_ + kPanel - 1) / kPanel;
  parallel_chunks(panels, grain(panels, kPanel * K_ * M), [&](int64_t b, int64_t e) { fn(args, b, e); });
  return out;
}

PackedLinear::PackedLinear(const KernelTable& table, const at::Tensor& weight) : table_(table) {
  check_cpu(weight, "pack_linear: weight", 2);
  TORCH_CHECK(weight.is_contiguous(), "pack_linear: weight must be contiguous");
  kernels_for(table, weight, "pack_linear");
  N_ = weight.size(0);
  K_ = weight.size(1);
  pairs_ = weight.scalar_type() == at::kBFloat16 && table.bf16_pairs;
  const int64_t panels = (N_ + kPanel - 1) / kPanel;
  const int64_t k_rows = pairs_ ? (K_ + 1) / 2 : K_;
  panels_ = at::empty({panels * k_rows * kPanel * (pairs_ ? 2 : 1)}, weight.options());
  if (weight.scalar_type() == at::kFloat) {
    weight_ = weight;
    pack_panels(weight.data_ptr<float>(), panels_.data_ptr<float>(), N_, K_, false);
  } else {
    pack_panels(static_cast<const bf16*>(weight.data_ptr()), static_cast<bf16*>(panels_.data_ptr()), N_, K_, pairs_);
  }
}

at::Tensor PackedLinear::forward(const at::Tensor& x, const std::optional<at::Tensor>& bias) const {
  check_cpu(x, "linear: x", 2);
  check_rows(x, "linear: x");
  TORCH_CHECK(int8_ || x.scalar_type() == panels_.scalar_type(), "linear: x is ", x.scalar_type(),
              ", the weight ", panels_.scalar_type());
  kernels_for(table_, x, "linear");
  TORCH_CHECK(x.size(1) == K_, "linear: the weight is [", N_, ", ", K_, "], x has ", x.size(1), " columns");
  const void* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    check_cpu(*bias, "linear: bias", 1);
    check_same_dtype(x, *bias, "linear: bias");
    TORCH_CHECK(bias->size(0) == N_ && bias->is_contiguous(), "linear: bias must be contiguous [", N_, "]");
    bias_ptr = bias->data_ptr();
  }
  if (int8_) return forward_int8(x, bias_ptr);
  const int64_t M = x.size(0);
  // From kTorchGemmRows rows of float32 (prefill chunks, large batches) torch's blocked GEMM beats the
  // panels (1.5x at 32 rows, 1.9x at 256 on AVX2: bench/cpu_linear.py); below, and in bf16 at every
  // size measured, the panels win.
  if (weight_.defined() && M >= kTorchGemmRows)
    return at::linear(x, weight_, bias.has_value() && bias->defined() ? bias : std::nullopt);
  at::Tensor out = at::empty({M, N_}, x.options());
  if (M == 0 || N_ == 0) return out;
  const at::Tensor xt = x.scalar_type() == at::kFloat ? transpose_blocks<float>(x, false)
                                                      : transpose_blocks<bf16>(x, pairs_);
  const PackedLinearArgs args{xt.data_ptr(), panels_.data_ptr(), bias_ptr, out.data_ptr(), N_, M, N_, K_};
  const auto fn = kernels_for(table_, x, "linear").packed_linear;
  const int64_t panels = (N_ + kPanel - 1) / kPanel;
  parallel_chunks(panels, grain(panels, kPanel * K_ * M), [&](int64_t b, int64_t e) { fn(args, b, e); });
  return out;
}

at::Tensor linear_kernel(const KernelTable& table, const at::Tensor& x, const at::Tensor& w,
                         const std::optional<at::Tensor>& bias) {
  check_cpu(x, "linear: x", 2);
  check_cpu(w, "linear: weight", 2);
  check_same_dtype(x, w, "linear: weight");
  check_rows(x, "linear: x");
  TORCH_CHECK(w.is_contiguous(), "linear: weight must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "linear: weight is [", N, ", ", w.size(1), "], x has ", K, " columns");
  const void* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    check_cpu(*bias, "linear: bias", 1);
    check_same_dtype(x, *bias, "linear: bias");
    TORCH_CHECK(bias->size(0) == N && bias->is_contiguous(), "linear: bias must be contiguous [", N, "]");
    bias_ptr = bias->data_ptr();
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const LinearArgs args{x.data_ptr(), x.stride(0), w.data_ptr(), K, bias_ptr, out.data_ptr(), N,
                                     M, N, K};
  const auto fn = kernels_for(table, x, "linear").linear;
  const int64_t rows = table.linear_rows, blocks = (N + rows - 1) / rows;
  parallel_chunks(blocks, grain(blocks, rows * K * M), [&](int64_t b, int64_t e) {
    fn(args, b * rows, std::min(e * rows, N));
  });
  return out;
}

at::Tensor rms_norm(const KernelTable& table, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  run_rows(kernels_for(table, x, "rms_norm").rms_norm, row_args(x, weight, out, static_cast<float>(eps)),
           x.size(0));
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const KernelTable& table, const at::Tensor& x,
                                                const at::Tensor& residual, const at::Tensor& weight,
                                                double eps) {
  check_norm(x, weight);
  check_cpu(residual, "add_rms_norm: residual", 2);
  check_rows(residual, "add_rms_norm: residual");
  check_same_dtype(x, residual, "add_rms_norm: residual");
  TORCH_CHECK(residual.sizes() == x.sizes(), "add_rms_norm: residual shape differs from x");
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor sum = at::empty_like(x, at::MemoryFormat::Contiguous);
  auto args = row_args(x, weight, out, static_cast<float>(eps));
  args.residual = residual.data_ptr();
  args.ldr = residual.stride(0);
  args.sum = sum.data_ptr();
  args.lds = sum.stride(0);
  run_rows(kernels_for(table, x, "add_rms_norm").add_rms_norm, args, x.size(0));
  return {out, sum};
}

at::Tensor act_and_mul(const KernelTable& table, const at::Tensor& x, bool gelu) {
  check_cpu(x, "act_and_mul: x", 2);
  check_rows(x, "act_and_mul: x");
  TORCH_CHECK(x.size(1) % 2 == 0, "act_and_mul: x must have an even number of columns");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  auto args = row_args(x, x, out, 0.0f);
  const auto& k = kernels_for(table, x, "act_and_mul");
  run_rows(gelu ? k.gelu_tanh_and_mul : k.silu_and_mul, args, x.size(0));
  return out;
}

void rotary(const KernelTable& table, at::Tensor& q, at::Tensor& k, const at::Tensor& positions,
            const at::Tensor& cos_sin) {
  check_heads(q, "rotary: q");
  check_heads(k, "rotary: k");
  check_same_dtype(q, k, "rotary: k");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(2) == k.size(2), "rotary: q and k disagree on tokens or head_dim");
  TORCH_CHECK(q.size(2) % 2 == 0, "rotary: head_dim must be even");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == q.size(0),
              "rotary: positions must be contiguous int64 [T]");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous() && cos_sin.dim() == 2 &&
                  cos_sin.size(1) == q.size(2),
              "rotary: cos_sin must be contiguous float32 [P, head_dim]");
  const int64_t T = q.size(0);
  if (T == 0) return;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos_sin.size(0);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "rotary: position ", pos[t], " outside [0, ", max_pos, ")");
  const RotaryArgs args{q.data_ptr(), q.stride(0), q.size(1), k.data_ptr(), k.stride(0), k.size(1),
                                     q.size(2),    pos,         cos_sin.data_ptr<float>(), max_pos};
  const auto fn = kernels_for(table, q, "rotary").rotary;
  const int64_t per_token = (q.size(1) + k.size(1)) * q.size(2);
  parallel_chunks(T, grain(T, per_token), [&](int64_t b, int64_t e) { fn(args, b, e); });
}

void write_kv(const KernelTable& table, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
              at::Tensor& v_cache, const at::Tensor& slots) {
  check_heads(k, "write_kv: k");
  check_heads(v, "write_kv: v");
  const KvFormat format = check_cache(k_cache, k, "write_kv: k_cache");
  TORCH_CHECK(check_cache(v_cache, k, "write_kv: v_cache") == format, "write_kv: k and v caches differ in dtype");
  TORCH_CHECK(k.sizes() == v.sizes() && k_cache.sizes() == v_cache.sizes(), "write_kv: k/v shapes differ");
  TORCH_CHECK(k_cache.size(2) == k.size(1) && k_cache.size(3) == cache_row(format, k.size(2)),
              "write_kv: cache heads differ from k");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == k.size(0),
              "write_kv: slot_mapping must be contiguous int64 [T]");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < k.size(0); ++t)
    TORCH_CHECK(s[t] >= -1 && s[t] < num_slots, "write_kv: slot ", s[t], " outside [-1, ", num_slots, ")");
  const WriteKvArgs args{k.data_ptr(),       k.stride(0),        v.data_ptr(), v.stride(0),
                         k_cache.data_ptr(), v_cache.data_ptr(), s,            k.size(1) * k.size(2),
                         k.size(2),          format};
  const auto& fns = kernels_for(table, k, "write_kv");
  (format == kKvPlain ? fns.write_kv : fns.write_kv_quant)(args, 0, k.size(0));
}

at::Tensor attention(const KernelTable& table, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& query_start, const at::Tensor& seq_lens,
                     const at::Tensor& block_tables, double scale, int64_t window, double softcap) {
  check_heads(q, "attention: q");
  const KvFormat format = check_cache(k_cache, q, "attention: k_cache");
  TORCH_CHECK(check_cache(v_cache, q, "attention: v_cache") == format && k_cache.sizes() == v_cache.sizes(),
              "attention: k and v caches differ in dtype or shape");
  const int64_t Hq = q.size(1), Hk = k_cache.size(2), D = q.size(2);
  TORCH_CHECK(k_cache.size(3) == cache_row(format, D) && Hk > 0 && Hq % Hk == 0,
              "attention: cache heads do not fit q");
  const int64_t S = seq_lens.numel();
  for (const auto* t : {&query_start, &seq_lens, &block_tables})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "attention: metadata must be contiguous int32");
  TORCH_CHECK(query_start.numel() == S + 1 && block_tables.dim() == 2 && block_tables.size(0) == S,
              "attention: query_start_loc [S+1], seq_lens [S], block_tables [S, B] disagree");
  const int32_t* qs = query_start.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t bs = k_cache.size(1), max_blocks = block_tables.size(1), num_blocks = k_cache.size(0);
  TORCH_CHECK(qs[0] == 0 && qs[S] == q.size(0), "attention: query_start_loc must run from 0 to ", q.size(0));
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  int64_t work = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q_len = qs[s + 1] - qs[s];
    TORCH_CHECK(q_len >= 0 && lens[s] >= q_len && lens[s] <= max_blocks * bs, "attention: sequence ", s, " has ",
                q_len, " queries, length ", lens[s], " and ", max_blocks, " blocks");
    // blocks before the window of the sequence's first query may have been freed (-1): never read
    const int64_t first_key = window > 0 ? std::max<int64_t>(0, lens[s] - q_len - window + 1) : 0;
    for (int64_t b = first_key / bs; b < (lens[s] + bs - 1) / bs; ++b)
      TORCH_CHECK(tables[s * max_blocks + b] >= 0 && tables[s * max_blocks + b] < num_blocks,
                  "attention: block table of sequence ", s, " names block ", tables[s * max_blocks + b]);
    work += q_len * lens[s];
  }
  at::Tensor out = at::empty({q.size(0), Hq, D}, q.options());
  const auto items = attention_items(qs, S, Hk);
  if (items.empty()) return out;
  const AttentionArgs args{q.data_ptr(),      q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                                        out.data_ptr(),    qs,          lens,               tables,
                                        max_blocks,        bs,          Hq,                 Hk,
                                        D,                 static_cast<float>(scale),      window,
                                        static_cast<float>(softcap),    items.data()};
  const auto& fns = kernels_for(table, q, "attention");
  const auto fn = format == kKvInt8 ? fns.attention_int8 : format == kKvFp8 ? fns.attention_fp8 : fns.attention;
  const int64_t count = static_cast<int64_t>(items.size());
  parallel_chunks(count, grain(count, work * Hq * D / count), [&](int64_t b, int64_t e) { fn(args, b, e); });
  return out;
}

at::Tensor linear(const KernelTable& table, const at::Tensor& x, const at::Tensor& w,
                  const std::optional<at::Tensor>& bias) {
  if (x.dim() == 2 && x.size(0) > linear_max_rows(x.scalar_type())) return at::linear(x, w, bias);
  return linear_kernel(table, x, w, bias);
}

}  // namespace conduit_cpu
