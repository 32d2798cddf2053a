// LoRA deltas on the CPU kernels (lora.h): per adapter slot, one shrink and one (block-diagonal) expand
// over that slot's rows (the punica / S-LoRA grouping), each a call of the linear kernels (ops.h).
#include "lora.h"

#include <ATen/Parallel.h>

#include <map>

namespace conduit_cpu {

LoraGroups lora_groups(const at::Tensor& row_slots) {
  TORCH_CHECK(row_slots.dim() == 1 && row_slots.scalar_type() == at::kInt && row_slots.is_contiguous(),
              "lora row_slots: expected a contiguous 1-D int32 tensor");
  const int32_t* slots = row_slots.data_ptr<int32_t>();
  const int64_t T = row_slots.numel();
  std::map<int32_t, std::vector<int64_t>> rows;
  for (int64_t t = 0; t < T; ++t)
    if (slots[t] >= 0) rows[slots[t]].push_back(t);
  LoraGroups groups;
  groups.row_slots = row_slots;
  for (auto& [slot, list] : rows) {
    LoraGroups::Group g;
    g.slot = slot;
    if (list.back() - list.front() + 1 == static_cast<int64_t>(list.size())) {
      g.begin = list.front();
      g.count = static_cast<int64_t>(list.size());
    } else {
      g.rows = at::tensor(list, at::TensorOptions().dtype(at::kLong));
      g.count = static_cast<int64_t>(list.size());
    }
    groups.groups.push_back(std::move(g));
  }
  return groups;
}

namespace {

// Up to this many rows (decodes, short chunks), a step of several adapters runs the per-row kernel: one pass
// over the rows, each reading its own slot, no gather and no per-adapter call. Beyond, or with one adapter
// (whose matrices one product then reads once for all its rows), each adapter's rows are one shrink on the
// linear kernels and one expand (a GEMM).
constexpr int64_t kLoraRowsMax = 64;

void lora_delta_rows(const KernelTable& table, at::Tensor& y, const at::Tensor& x, const LoraLayer& w,
                     const LoraGroups& groups) {
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1 && w.a.is_contiguous() && w.b.is_contiguous(),
              "lora_delta: x, y rows and the pool must be contiguous");
  TORCH_CHECK(groups.row_slots.defined(), "lora_delta: the groups lack their row slots");
  const int64_t S = w.a.size(1);
  TORCH_CHECK(S <= 3, "lora_delta: at most 3 output slices, got ", S);
  const int64_t N = w.b.size(2);
  LoraRowArgs args{x.data_ptr(),  x.stride(0), w.a.data_ptr(), w.b.data_ptr(), y.data_ptr(), y.stride(0),
                   groups.row_slots.data_ptr<int32_t>(), w.a.size(3), N, S, w.a.size(2),
                   S > 1 ? w.splits[0] : N, S > 2 ? w.splits[0] + w.splits[1] : N};
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "lora_delta: the CPU kernels take float32 or bfloat16, got ", x.scalar_type());
  const LoraRowsFn rows = x.scalar_type() == at::kFloat ? table.f32.lora_rows : table.bf16.lora_rows;
  at::parallel_for(0, x.size(0), 1, [&](int64_t begin, int64_t end) { rows(args, begin, end); });
}

}  // namespace

void lora_delta(const KernelTable& table, at::Tensor& y, const at::Tensor& x, const LoraLayer& w,
                const LoraGroups& groups) {
  TORCH_CHECK(w.a.dim() == 4 && w.b.dim() == 3, "lora_delta: a must be [slots, S, R, K] and b [slots, S*R, N]");
  const int64_t S = w.a.size(1), R = w.a.size(2), K = w.a.size(3), N = w.b.size(2);
  TORCH_CHECK(static_cast<int64_t>(w.splits.size()) == S, "lora_delta: ", w.splits.size(), " splits for ", S,
              " slices");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && y.dim() == 2 && y.size(1) == N && y.size(0) == x.size(0),
              "lora_delta: x [T, ", K, "] and y [T, ", N, "] expected");
  TORCH_CHECK(x.scalar_type() == w.a.scalar_type() && y.scalar_type() == w.b.scalar_type(),
              "lora_delta: x, y and the pool must share a dtype");
  for (const auto& g : groups.groups)
    TORCH_CHECK(g.slot < w.a.size(0), "lora_delta: slot ", g.slot, " outside the pool");
  if (groups.groups.empty()) return;
  if (x.size(0) <= kLoraRowsMax && groups.groups.size() > 1) {
    lora_delta_rows(table, y, x, w, groups);
    return;
  }
  for (const auto& g : groups.groups) {
    const at::Tensor xs = g.rows.defined() ? x.index_select(0, g.rows) : x.narrow(0, g.begin, g.count).contiguous();
    const at::Tensor h = linear(table, xs, w.a[g.slot].view({S * R, K}), std::nullopt);  // [m, S*R]
    const at::Tensor delta = at::mm(h, w.b[g.slot]);  // [m, N]: b [S*R, N] is block-diagonal
    if (g.rows.defined()) {
      y.index_add_(0, g.rows, delta);
    } else {
      y.narrow(0, g.begin, g.count).add_(delta);
    }
  }
}

}  // namespace conduit_cpu
