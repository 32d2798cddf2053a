// The CPU kernels as torch-level ops: argument checks (a clear message naming the argument), raw
// pointers, and threads from ATen's intra-op pool (the one torch itself uses). One KernelTable is one
// instruction set (common.h); bindings.cpp exposes these per set, decoder.cpp composes them.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <optional>
#include <tuple>

#include "common.h"

namespace conduit_cpu {

// Work (multiply-adds) of a call from which it is worth letting other Python threads run meanwhile.
constexpr int64_t kReleaseGilWork = 1 << 18;

// x [M, K] @ w[N, K]^T + bias: the kernel's tiles whatever M is.
at::Tensor linear_kernel(const KernelTable& table, const at::Tensor& x, const at::Tensor& w,
                         const std::optional<at::Tensor>& bias);
// The same, through torch (oneDNN/MKL) when M is past the rows where the tiles are faster.
at::Tensor linear(const KernelTable& table, const at::Tensor& x, const at::Tensor& w,
                  const std::optional<at::Tensor>& bias);
// A linear layer's weight packed once (common.h: panels) for the packed tiles, which stream it once
// per call whatever the batch and keep every multiply-add in vector lanes.
class PackedLinear {
 public:
  PackedLinear(const KernelTable& table, const at::Tensor& weight);
  // int8 weight [N, K] with float32 per-output-channel scales [N] (W8A8: int8_impl.h)
  PackedLinear(const KernelTable& table, const at::Tensor& weight, const at::Tensor& scale);
  // x [M, K] -> x @ weight^T + bias [M, N] in x's dtype
  at::Tensor forward(const at::Tensor& x, const std::optional<at::Tensor>& bias) const;
  int64_t out_features() const { return N_; }
  int64_t in_features() const { return K_; }
  bool is_int8() const { return int8_; }

 private:
  at::Tensor forward_int8(const at::Tensor& x, const void* bias) const;

  const KernelTable& table_;
  at::Tensor panels_;
  at::Tensor weight_;  // float32 weights as loaded (not a copy), for torch's GEMM on many rows
  int64_t N_, K_;
  bool pairs_ = false;  // bf16 panels of k pairs
  bool int8_ = false;  // int8 panels, with w_comp_ and w_scale_
  at::Tensor w_comp_, w_scale_;
  int64_t K4_ = 0;
};

// x [M, K] float32 or bf16 -> (int8 [M, K], float32 scales [M]): ops/quant.py quantize_rows, bit for bit
// (weights at load: one scale per output channel).
std::tuple<at::Tensor, at::Tensor> quantize_rows_int8(const at::Tensor& x);

at::Tensor rms_norm(const KernelTable& table, const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const KernelTable& table, const at::Tensor& x,
                                                const at::Tensor& residual, const at::Tensor& weight, double eps);
at::Tensor act_and_mul(const KernelTable& table, const at::Tensor& x, bool gelu);
void rotary(const KernelTable& table, at::Tensor& q, at::Tensor& k, const at::Tensor& positions,
            const at::Tensor& cos_sin);
void write_kv(const KernelTable& table, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
              at::Tensor& v_cache, const at::Tensor& slots);
at::Tensor attention(const KernelTable& table, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& query_start, const at::Tensor& seq_lens,
                     const at::Tensor& block_tables, double scale, int64_t window, double softcap);

}  // namespace conduit_cpu
