// The Python module of the CPU kernels: one submodule per instruction set this build carries
// (avx512bf16, avx512, avx2, scalar), each with the ops of ops.h and the DecoderStack of decoder.h, and
// `supported_isas()`: the sets this CPU (and its OS) can run, best first. conduit_engine/ops/cpu_ops.py
// picks one at start-up. Calls with enough work let other Python threads run meanwhile.
//
// Layout, grid and limits: common.h (layouts), ops.cpp (how each op splits over threads).
#include <torch/extension.h>

#include <optional>
#include <string>
#include <vector>

#include "decoder.h"
#include "ops.h"

namespace {

using conduit_cpu::KernelTable;

// Releases the GIL for the scope when the call has kReleaseGilWork multiply-adds or more.
class MaybeReleaseGil {
 public:
  explicit MaybeReleaseGil(int64_t work) {
    if (work >= conduit_cpu::kReleaseGilWork) release_.emplace();
  }

 private:
  std::optional<pybind11::gil_scoped_release> release_;
};

// q . k multiply-adds of an attention call, roughly: every query over its sequence's mean length.
int64_t attention_work(const at::Tensor& q, const at::Tensor& seq_lens) {
  if (q.dim() != 3 || seq_lens.scalar_type() != at::kInt || !seq_lens.is_contiguous() || seq_lens.numel() == 0)
    return 0;  // the op reports the bad argument
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  int64_t total = 0;
  for (int64_t s = 0; s < seq_lens.numel(); ++s) total += lens[s];
  return q.size(0) * q.size(1) * q.size(2) * (total / seq_lens.numel());
}

void add_isa(pybind11::module_& m, const KernelTable& table) {
  namespace py = pybind11;
  auto sub = m.def_submodule(table.name, "the CPU kernels built for this instruction set");
  const KernelTable* t = &table;
  using Bias = const std::optional<at::Tensor>&;
  sub.def("linear_kernel", [t](const at::Tensor& x, const at::Tensor& w, Bias b) {
    MaybeReleaseGil gil(x.size(0) * w.numel());
    return conduit_cpu::linear_kernel(*t, x, w, b);
  });
  sub.def("linear", [t](const at::Tensor& x, const at::Tensor& w, Bias b) {
    MaybeReleaseGil gil(x.size(0) * w.numel());
    return conduit_cpu::linear(*t, x, w, b);
  });
  sub.def("rms_norm", [t](const at::Tensor& x, const at::Tensor& w, double eps) {
    return conduit_cpu::rms_norm(*t, x, w, eps);
  });
  sub.def("add_rms_norm", [t](const at::Tensor& x, const at::Tensor& r, const at::Tensor& w, double eps) {
    return conduit_cpu::add_rms_norm(*t, x, r, w, eps);
  });
  sub.def("silu_and_mul", [t](const at::Tensor& x) { return conduit_cpu::act_and_mul(*t, x, false); });
  sub.def("gelu_tanh_and_mul", [t](const at::Tensor& x) { return conduit_cpu::act_and_mul(*t, x, true); });
  sub.def("rotary", [t](at::Tensor& q, at::Tensor& k, const at::Tensor& p, const at::Tensor& cs) {
    conduit_cpu::rotary(*t, q, k, p, cs);
  });
  sub.def("write_kv", [t](const at::Tensor& k, const at::Tensor& v, at::Tensor& kc, at::Tensor& vc,
                          const at::Tensor& s) { conduit_cpu::write_kv(*t, k, v, kc, vc, s); });
  sub.def("attention", [t](const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& qs,
                           const at::Tensor& sl, const at::Tensor& bt, double scale, int64_t window,
                           double softcap) {
    MaybeReleaseGil gil(attention_work(q, sl));
    return conduit_cpu::attention(*t, q, kc, vc, qs, sl, bt, scale, window, softcap);
  });
  sub.def("lora_delta", [t](at::Tensor& y, const at::Tensor& x, const conduit_cpu::LoraLayer& w,
                            const at::Tensor& row_slots) {
    conduit_cpu::lora_delta(*t, y, x, w, conduit_cpu::lora_groups(row_slots));
  });
  sub.def("pack_linear", [t](const at::Tensor& w) { return std::make_shared<conduit_cpu::PackedLinear>(*t, w); });
  sub.def("pack_linear_int8", [t](const at::Tensor& w, const at::Tensor& scale) {
    return std::make_shared<conduit_cpu::PackedLinear>(*t, w, scale);
  });
  sub.def("decoder_stack", [t](std::vector<conduit_cpu::LayerWeights> layers) {
    return std::make_shared<conduit_cpu::DecoderStack>(*t, std::move(layers));
  });
}

std::vector<std::string> supported_isas() {
  __builtin_cpu_init();
  std::vector<std::string> isas;
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("fma");
  if (avx512 && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni")) isas.emplace_back("avx512bf16");
  if (avx512) isas.emplace_back("avx512");
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) isas.emplace_back("avx2");
  isas.emplace_back("scalar");
  return isas;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "Conduit's CPU kernels (kernels/cpu): one submodule per instruction set";
  py::class_<conduit_cpu::StepTensors>(m, "StepTensors", "what every layer of one step reads")
      .def(py::init([](at::Tensor positions, at::Tensor cos_sin, at::Tensor slot_mapping, at::Tensor query_start,
                       at::Tensor seq_lens, at::Tensor block_tables, std::optional<at::Tensor> lora_slots) {
             return conduit_cpu::StepTensors{positions,      cos_sin,  slot_mapping, query_start,
                                             seq_lens,       block_tables, lora_slots};
           }),
           py::arg("positions"), py::arg("cos_sin"), py::arg("slot_mapping"), py::arg("query_start"),
           py::arg("seq_lens"), py::arg("block_tables"), py::arg("lora_slots") = py::none());
  py::class_<conduit_cpu::LoraLayer>(m, "LoraLayer", "one projection's adapter pool (a, b, output slices)")
      .def(py::init([](at::Tensor a, at::Tensor b, std::vector<int64_t> splits) {
        return conduit_cpu::LoraLayer{a, b, splits};
      }));
  py::class_<conduit_cpu::PackedLinear, std::shared_ptr<conduit_cpu::PackedLinear>>(
      m, "PackedLinear", "a linear layer's weight, packed once for the packed tiles")
      .def("forward",
           [](const conduit_cpu::PackedLinear& w, const at::Tensor& x, const std::optional<at::Tensor>& bias) {
             MaybeReleaseGil gil(x.size(0) * w.out_features() * w.in_features());
             return w.forward(x, bias);
           })
      .def_property_readonly("out_features", &conduit_cpu::PackedLinear::out_features)
      .def_property_readonly("in_features", &conduit_cpu::PackedLinear::in_features)
      .def_property_readonly("is_int8", &conduit_cpu::PackedLinear::is_int8);
  py::class_<conduit_cpu::LayerWeights>(m, "LayerWeights", "one decoder layer's weights and shape")
      .def(py::init<>())
#define CONDUIT_FIELD(name) .def_readwrite(#name, &conduit_cpu::LayerWeights::name)
          CONDUIT_FIELD(input_norm) CONDUIT_FIELD(post_attention_norm) CONDUIT_FIELD(pre_feedforward_norm)
              CONDUIT_FIELD(post_feedforward_norm) CONDUIT_FIELD(qkv) CONDUIT_FIELD(o) CONDUIT_FIELD(gate_up)
                  CONDUIT_FIELD(down) CONDUIT_FIELD(qkv_bias) CONDUIT_FIELD(o_bias) CONDUIT_FIELD(gate_up_bias)
                      CONDUIT_FIELD(down_bias) CONDUIT_FIELD(q_norm) CONDUIT_FIELD(k_norm) CONDUIT_FIELD(num_heads)
                          CONDUIT_FIELD(num_kv_heads) CONDUIT_FIELD(head_dim) CONDUIT_FIELD(scale)
                              CONDUIT_FIELD(eps) CONDUIT_FIELD(window) CONDUIT_FIELD(softcap) CONDUIT_FIELD(gelu)
                                  CONDUIT_FIELD(qkv_lora) CONDUIT_FIELD(o_lora) CONDUIT_FIELD(gate_up_lora)
                                      CONDUIT_FIELD(down_lora);
#undef CONDUIT_FIELD
  py::class_<conduit_cpu::DecoderStack, std::shared_ptr<conduit_cpu::DecoderStack>>(
      m, "DecoderStack", "a model's decoder layers, run as one call per step")
      .def("forward", [](const conduit_cpu::DecoderStack& stack, const at::Tensor& x,
                         const conduit_cpu::KvCaches& kv_caches, const conduit_cpu::StepTensors& step) {
        MaybeReleaseGil gil(x.size(0) * stack.macs_per_token());
        return stack.forward(x, kv_caches, step);
      });
  for (const KernelTable* table : {&conduit_cpu::avx512bf16_table, &conduit_cpu::avx512_table,
                                   &conduit_cpu::avx2_table, &conduit_cpu::scalar_table})
    add_isa(m, *table);
  m.def(
      "quantize_rows",
      [](const at::Tensor& x) {
        MaybeReleaseGil gil(x.numel());
        return conduit_cpu::quantize_rows_int8(x);
      },
      "x [M, K] -> (int8 [M, K], float32 scales [M]), per row (ops/quant.py quantize_rows)");
  m.def("supported_isas", &supported_isas, "instruction sets this CPU runs, best first");
}
