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

// One step's rows grouped by slot, made once per step: a contiguous run [begin, begin + count) when
// the slot's rows are one, else their indices.
struct LoraGroups {
  struct Group {
    int64_t slot = 0, begin = 0, count = 0;
    at::Tensor rows;  // int64 row indices; undefined for a contiguous run
  };
  std::vector<Group> groups;
  at::Tensor row_slots;  // [T] int32, the slots they were made from
};

LoraGroups lora_groups(const at::Tensor& row_slots);
void lora_delta(const KernelTable& table, at::Tensor& y, const at::Tensor& x, const LoraLayer& w,
                const LoraGroups& groups);

}  // namespace conduit_cpu
