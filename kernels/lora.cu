// LoRA deltas per row (the punica BGMV way: each row reads its own adapter slot's matrices), in two
// launches: shrink h = x a[slot]^T, then expand y += h b[slot]^T. Rows of slot -1 (the base model) do
// nothing. The torch reference is Ops.lora_delta (conduit_engine/ops/base.py).
//
// Layout: x [T, K] (row stride `x_row_stride`, unit stride inside); a [slots, S*R, K] contiguous (the
// shrink of each of the S output slices, rank R padded with zeros); h [T, S*R] float32 contiguous;
// b [slots, S*R, N] contiguous (scale * lora_B transposed, block-diagonal: column n of slice j has its R
// values in rows [j*R, (j+1)*R), zeros elsewhere, which this kernel skips); y [T, N] (row stride `y_row_stride`). Output column n
// belongs to slice (n >= split1) + (n >= split2): a fused qkv projection has three slices, the others
// one (split1 = split2 = N).
// Grid: lora_shrink_kernel (T, ceil(S*R / warps per block)); block: a multiple of 32 threads, one warp
// per h element, lanes striding over K. lora_expand_kernel grid: (T, ceil(N / blockDim.x)); one thread
// per output column. Rounding: h is kept in float32 and the delta added to y in float32, rounded once.
// Limits: T < 2^31, S*R <= 65535 * warps per block, N <= 65535 * blockDim.x.
#include "common.cuh"

template <typename T>
__global__ void lora_shrink_kernel(float* __restrict__ h, const T* __restrict__ x, const T* __restrict__ a,
                                   const int* __restrict__ row_slots, int K, int SR, long long x_row_stride) {
  const int row = blockIdx.x;
  const int slot = row_slots[row];
  const int warps = blockDim.x / 32;
  const int j = blockIdx.y * warps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (slot < 0 || j >= SR) return;  // whole warps leave together: the shuffles below stay converged
  const T* xr = x + row * x_row_stride;
  const T* ar = a + (static_cast<long long>(slot) * SR + j) * K;
  float acc = 0.0f;
  for (int k = lane; k < K; k += 32) acc += conduit::to_float(xr[k]) * conduit::to_float(ar[k]);
  acc = conduit::warp_sum(acc);
  if (lane == 0) h[static_cast<long long>(row) * SR + j] = acc;
}

template <typename T>
__global__ void lora_expand_kernel(T* __restrict__ y, const float* __restrict__ h, const T* __restrict__ b,
                                   const int* __restrict__ row_slots, int N, int R, int SR, int split1,
                                   int split2, long long y_row_stride) {
  const int row = blockIdx.x;
  const int slot = row_slots[row];
  const int n = blockIdx.y * blockDim.x + threadIdx.x;
  if (slot < 0 || n >= N) return;
  const int slice = (n >= split1) + (n >= split2);
  const float* hr = h + static_cast<long long>(row) * SR + slice * R;
  const T* bc = b + (static_cast<long long>(slot) * SR + slice * R) * N + n;  // neighbouring threads: n + 1
  float acc = 0.0f;
  for (int r = 0; r < R; ++r) acc += hr[r] * conduit::to_float(bc[static_cast<long long>(r) * N]);
  T* out = y + row * y_row_stride + n;
  *out = conduit::from_float<T>(conduit::to_float(*out) + acc);
}
