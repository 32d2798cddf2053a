// A model's decoder layers as one call per step on the CPU kernels: every layer composes the ops of
// ops.h exactly as layers/decoder.py composes the Ops (pre-norms on a fused residual stream, fused qkv
// and gate|up projections, optional biases, per-head q/k norms, Gemma 2's sandwich norms, per-layer
// sliding windows and soft-capping, SiLU or tanh-GELU), without a Python call per op.
#pragma once

#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "lora.h"
#include "ops.h"

namespace conduit_cpu {

// What every layer of one step reads: the tensors of Ops.begin_step's StepContext.
struct StepTensors {
  at::Tensor positions, cos_sin, slot_mapping, query_start, seq_lens, block_tables;
  std::optional<at::Tensor> lora_slots;  // [T] int32: each row's adapter slot (-1: none); unset: no LoRA
};

// One decoder layer's weights and shape, taken from the loaded module (no copies).
struct LayerWeights {
  at::Tensor input_norm, post_attention_norm;
  std::optional<at::Tensor> pre_feedforward_norm, post_feedforward_norm;  // both or neither
  std::shared_ptr<PackedLinear> qkv, o, gate_up, down;
  std::optional<at::Tensor> qkv_bias, o_bias, gate_up_bias, down_bias, q_norm, k_norm;
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;
  double scale = 1.0, eps = 1e-6;
  int64_t window = 0;  // 0: none
  double softcap = 0.0;  // 0: none
  bool gelu = false;  // tanh-GELU gate instead of SiLU
  std::optional<LoraLayer> qkv_lora, o_lora, gate_up_lora, down_lora;  // the adapter pool, with LoRA on
};

using KvCaches = std::vector<std::pair<at::Tensor, at::Tensor>>;

class DecoderStack {
 public:
  DecoderStack(const KernelTable& table, std::vector<LayerWeights> layers);
  // x [T, H] (the embedded tokens) -> (the last layer's output, the residual stream without it)
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x, const KvCaches& kv_caches,
                                             const StepTensors& step) const;
  // multiply-adds of one token through every layer's projections (to decide on releasing the GIL)
  int64_t macs_per_token() const { return macs_per_token_; }

 private:
  at::Tensor attention_block(const LayerWeights& layer, const at::Tensor& x, const std::pair<at::Tensor, at::Tensor>& kv,
                             const StepTensors& step, const LoraGroups* lora) const;
  at::Tensor mlp(const LayerWeights& layer, const at::Tensor& x, const LoraGroups* lora) const;
  // a projection, plus its LoRA delta when the step has adapter rows and the layer a pool
  at::Tensor project(const PackedLinear& w, const std::optional<at::Tensor>& bias,
                     const std::optional<LoraLayer>& pool, const at::Tensor& x, const LoraGroups* lora) const;

  const KernelTable& table_;
  std::vector<LayerWeights> layers_;
  int64_t macs_per_token_ = 0;
};

}  // namespace conduit_cpu
