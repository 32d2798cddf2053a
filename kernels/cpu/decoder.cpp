// DecoderStack (decoder.h): layers/decoder.py, layers/attention.py and layers/mlp.py on ops.h.
#include "decoder.h"

namespace conduit_cpu {

DecoderStack::DecoderStack(const KernelTable& table, std::vector<LayerWeights> layers)
    : table_(table), layers_(std::move(layers)) {
  for (const auto& layer : layers_) {
    TORCH_CHECK(layer.pre_feedforward_norm.has_value() == layer.post_feedforward_norm.has_value(),
                "DecoderStack: sandwich norms come in pairs (pre and post feed-forward)");
    TORCH_CHECK(layer.q_norm.has_value() == layer.k_norm.has_value(), "DecoderStack: q_norm and k_norm go together");
    TORCH_CHECK(layer.num_kv_heads > 0 && layer.num_heads % layer.num_kv_heads == 0 && layer.head_dim > 0,
                "DecoderStack: bad head counts");
    TORCH_CHECK(layer.qkv && layer.o && layer.gate_up && layer.down, "DecoderStack: a projection is missing");
    TORCH_CHECK(layer.qkv->out_features() == (layer.num_heads + 2 * layer.num_kv_heads) * layer.head_dim,
                "DecoderStack: qkv weight rows differ from (heads + 2 kv heads) * head_dim");
    for (const auto* w : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down})
      macs_per_token_ += (*w)->out_features() * (*w)->in_features();
  }
}

at::Tensor DecoderStack::project(const PackedLinear& w, const std::optional<at::Tensor>& bias,
                                 const std::optional<LoraLayer>& pool, const at::Tensor& x,
                                 const LoraGroups* lora) const {
  at::Tensor out = w.forward(x, bias);
  if (lora != nullptr && pool.has_value()) lora_delta(table_, out, x, *pool, *lora);
  return out;
}

at::Tensor DecoderStack::attention_block(const LayerWeights& layer, const at::Tensor& x,
                                         const std::pair<at::Tensor, at::Tensor>& kv, const StepTensors& step,
                                         const LoraGroups* lora) const {
  const int64_t T = x.size(0), D = layer.head_dim, Hq = layer.num_heads, Hk = layer.num_kv_heads;
  const at::Tensor qkv = project(*layer.qkv, layer.qkv_bias, layer.qkv_lora, x, lora);
  at::Tensor q = qkv.narrow(1, 0, Hq * D).view({T, Hq, D});
  at::Tensor k = qkv.narrow(1, Hq * D, Hk * D).view({T, Hk, D});
  const at::Tensor v = qkv.narrow(1, (Hq + Hk) * D, Hk * D).view({T, Hk, D});
  if (layer.q_norm.has_value()) {
    q = rms_norm(table_, q.reshape({-1, D}), *layer.q_norm, layer.eps).view({T, Hq, D});
    k = rms_norm(table_, k.reshape({-1, D}), *layer.k_norm, layer.eps).view({T, Hk, D});
  }
  rotary(table_, q, k, step.positions, step.cos_sin);
  at::Tensor k_cache = kv.first, v_cache = kv.second;
  write_kv(table_, k, v, k_cache, v_cache, step.slot_mapping);
  const at::Tensor out = attention(table_, q, k_cache, v_cache, step.query_start, step.seq_lens,
                                   step.block_tables, layer.scale, layer.window, layer.softcap);
  return project(*layer.o, layer.o_bias, layer.o_lora, out.view({T, Hq * D}), lora);
}

at::Tensor DecoderStack::mlp(const LayerWeights& layer, const at::Tensor& x, const LoraGroups* lora) const {
  const at::Tensor gate_up = project(*layer.gate_up, layer.gate_up_bias, layer.gate_up_lora, x, lora);
  return project(*layer.down, layer.down_bias, layer.down_lora, act_and_mul(table_, gate_up, layer.gelu), lora);
}

std::tuple<at::Tensor, at::Tensor> DecoderStack::forward(const at::Tensor& x, const KvCaches& kv_caches,
                                                         const StepTensors& step) const {
  TORCH_CHECK(kv_caches.size() == layers_.size(), "DecoderStack: ", kv_caches.size(), " KV caches for ",
              layers_.size(), " layers");
  at::Tensor h = x, residual, normed;
  std::optional<LoraGroups> groups;
  if (step.lora_slots.has_value()) groups = lora_groups(*step.lora_slots);
  const LoraGroups* lora = groups.has_value() ? &*groups : nullptr;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const LayerWeights& layer = layers_[i];
    if (i == 0) {
      normed = rms_norm(table_, h, layer.input_norm, layer.eps);
      residual = h;
    } else {
      std::tie(normed, residual) = add_rms_norm(table_, h, residual, layer.input_norm, layer.eps);
    }
    const at::Tensor attended = attention_block(layer, normed, kv_caches[i], step, lora);
    if (!layer.pre_feedforward_norm.has_value()) {
      std::tie(normed, residual) = add_rms_norm(table_, attended, residual, layer.post_attention_norm, layer.eps);
      h = mlp(layer, normed, lora);
    } else {
      const at::Tensor post = rms_norm(table_, attended, layer.post_attention_norm, layer.eps);
      std::tie(normed, residual) = add_rms_norm(table_, post, residual, *layer.pre_feedforward_norm, layer.eps);
      h = rms_norm(table_, mlp(layer, normed, lora), *layer.post_feedforward_norm, layer.eps);
    }
  }
  return {h, residual};
}

}  // namespace conduit_cpu
