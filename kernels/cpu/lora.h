// LoRA deltas (conduit_engine/ops/base.py: Ops.lora_delta): y [T, N] += each row's (x a[s]^T) b[s],
// for the rows of each adapter slot s; rows of slot -1 (the base model) are untouched.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "ops.h"

namespace conduit_cpu {

// One layer's adapter pool: a [slots, S, R, K] (shrink per output slice), b [slots, S*R, N] (scale * expand,
// transposed, block-diagonal: the columns of slice j read shrink slice j), the widths of its S output slices.
struct LoraLayer {
  at::Tensor a, b;
  std::vector<int64_t> splits;
};

// One step's adapter rows grouped by slot, made once per step and read by every projection of every
// layer: segment s runs slot seg_slot[s] over rows[seg_begin[s] .. seg_begin[s + 1]), at most
// kLoraSegmentRows rows (common.h: LoraArgs).
struct LoraGroups {
  std::vector<int64_t> rows;
  std::vector<int64_t> seg_begin{0};
  std::vector<int32_t> seg_slot;
  int32_t max_slot = -1;
  int64_t max_row = -1;
};

LoraGroups lora_groups(const at::Tensor& row_slots);
void lora_delta(const KernelTable& table, at::Tensor& y, const at::Tensor& x, const LoraLayer& w,
                const LoraGroups& groups);

}  // namespace conduit_cpu
