// LoRA deltas on the CPU kernels (lora.h), the punica / S-LoRA grouping whatever the rows and the adapter
// mix: one shrink over every adapter row (items: a segment of one slot's rows x a few rows of its a),
// into a float scratch, then one block-diagonal expand (items: blocks of output columns, each over every
// segment), both kernels_impl.h's register tiles on ATen's thread pool.
#include "lora.h"

#include <algorithm>
#include <utility>

#include "parallel.h"

namespace conduit_cpu {

LoraGroups lora_groups(const at::Tensor& row_slots) {
  TORCH_CHECK(row_slots.dim() == 1 && row_slots.scalar_type() == at::kInt && row_slots.is_contiguous(),
              "lora row_slots: expected a contiguous 1-D int32 tensor");
  const int32_t* slots = row_slots.data_ptr<int32_t>();
  const int64_t T = row_slots.numel();
  std::vector<std::pair<int32_t, int64_t>> order;  // (slot, row) of the adapter rows
  for (int64_t t = 0; t < T; ++t)
    if (slots[t] >= 0) order.emplace_back(slots[t], t);
  std::sort(order.begin(), order.end());
  LoraGroups groups;
  groups.rows.reserve(order.size());
  for (size_t i = 0; i < order.size();) {  // one slot's rows: ceil(count / kLoraSegmentRows) even segments
    size_t e = i;
    while (e < order.size() && order[e].first == order[i].first) ++e;
    const int64_t count = static_cast<int64_t>(e - i);
    const int64_t parts = (count + kLoraSegmentRows - 1) / kLoraSegmentRows;
    for (int64_t p = 0; p < parts; ++p) {
      groups.seg_slot.push_back(order[i].first);
      groups.seg_begin.push_back(static_cast<int64_t>(groups.rows.size()) + count * (p + 1) / parts);
    }
    for (; i < e; ++i) {
      groups.rows.push_back(order[i].second);
      groups.max_row = std::max(groups.max_row, order[i].second);
    }
  }
  if (!order.empty()) groups.max_slot = order.back().first;
  return groups;
}

void lora_delta(const KernelTable& table, at::Tensor& y, const at::Tensor& x, const LoraLayer& w,
                const LoraGroups& groups) {
  TORCH_CHECK(w.a.dim() == 4 && w.b.dim() == 3, "lora_delta: a must be [slots, S, R, K] and b [slots, S*R, N]");
  const int64_t S = w.a.size(1), R = w.a.size(2), K = w.a.size(3), N = w.b.size(2);
  TORCH_CHECK(static_cast<int64_t>(w.splits.size()) == S, "lora_delta: ", w.splits.size(), " splits for ", S,
              " slices");
  TORCH_CHECK(S <= 3, "lora_delta: at most 3 output slices, got ", S);
  TORCH_CHECK(w.b.size(1) == S * R, "lora_delta: b has ", w.b.size(1), " rank rows, a ", S * R);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && y.dim() == 2 && y.size(1) == N && y.size(0) == x.size(0),
              "lora_delta: x [T, ", K, "] and y [T, ", N, "] expected");
  TORCH_CHECK(x.scalar_type() == w.a.scalar_type() && y.scalar_type() == w.b.scalar_type() &&
                  x.scalar_type() == y.scalar_type(),
              "lora_delta: x, y and the pool must share a dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "lora_delta: the CPU kernels take float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(groups.max_slot < w.a.size(0), "lora_delta: slot ", groups.max_slot, " outside the pool");
  if (groups.rows.empty()) return;
  TORCH_CHECK(groups.max_row < x.size(0), "lora_delta: the groups name row ", groups.max_row, ", x has ",
              x.size(0));
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1 && w.a.is_contiguous() && w.b.is_contiguous(),
              "lora_delta: x, y rows and the pool must be contiguous");
  const int64_t SR = S * R, rows = static_cast<int64_t>(groups.rows.size());
  const int64_t segments = static_cast<int64_t>(groups.seg_slot.size());
  std::vector<float> h(static_cast<size_t>(rows * SR));
  const LoraArgs args{x.data_ptr(),
                      x.stride(0),
                      w.a.data_ptr(),
                      w.b.data_ptr(),
                      y.data_ptr(),
                      y.stride(0),
                      groups.rows.data(),
                      groups.seg_begin.data(),
                      groups.seg_slot.data(),
                      segments,
                      h.data(),
                      K,
                      N,
                      S,
                      R,
                      S > 1 ? w.splits[0] : N,
                      S > 2 ? w.splits[0] + w.splits[1] : N};
  const TypedKernels& k = x.scalar_type() == at::kFloat ? table.f32 : table.bf16;
  const int64_t shrink_items = segments * ((SR + kLoraShrinkRows - 1) / kLoraShrinkRows);
  parallel_chunks(shrink_items, grain(shrink_items, rows / segments * kLoraShrinkRows * K),
                  [&](int64_t b, int64_t e) { k.lora_shrink(args, b, e); });
  const int64_t blocks = (N + kLoraExpandCols - 1) / kLoraExpandCols;
  parallel_chunks(blocks, grain(blocks, rows * kLoraExpandCols * R),
                  [&](int64_t b, int64_t e) { k.lora_expand(args, b, e); });
}

}  // namespace conduit_cpu
