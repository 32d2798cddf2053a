// Sampling: temperature, top-k, top-p, min-p and seeded selection, one row per block.
//
// Layout: logits [num_rows, vocab] float32 (`logits_row_stride` between rows); temperature, top_p,
// min_p, uniform [num_rows] float32; top_k [num_rows] int32; out [num_rows] int64.
// Algorithm (the torch reference in the tests implements the same steps):
//   temperature <= 0: greedy, the first index of the maximum logit.
//   z = logits / temperature (IEEE division); z_max = max z.
//   top-k (0 < k < vocab): keep z >= the k-th largest z (ties kept), found exactly by a binary search
//     over the order-preserving integer keys of the floats.
//   min-p (> 0): keep z - z_max >= log(min_p), i.e. p >= min_p * p_max.
//   p = exp(z - z_max) over the kept tokens, sums in float64.
//   top-p (0 < top_p < 1): keep z >= the largest threshold whose kept mass is >= top_p * total (ties kept).
//   selection: the first index (in vocabulary order) whose running kept mass exceeds uniform * total;
//     the caller draws `uniform` in [0, 1) per row from the request's seed, so results are reproducible.
// Grid: num_rows blocks. Block: a multiple of 32 threads (<= 1024); each thread owns a contiguous chunk
// of the vocabulary for the selection scan. Limits: vocab < 2^24 (counts are exact in float32).
#include "common.cuh"

namespace conduit {

// Order-preserving map float -> uint32 (a < b  <=>  key(a) < key(b) for non-NaN values).
__device__ __forceinline__ unsigned order_key(float f) {
  const unsigned u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ int warp_min_int(int v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}
__device__ __forceinline__ int warp_max_int(int v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}
__device__ __forceinline__ int block_min_int(int v, int* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  v = warp_min_int(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x >> 5) ? scratch[lane] : 0x7fffffff;
  return warp_min_int(v);
}
__device__ __forceinline__ int block_max_int(int v, int* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  v = warp_max_int(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x >> 5) ? scratch[lane] : -1;
  return warp_max_int(v);
}

// Exclusive prefix sum over the block's threads (in thread order); `total` receives the block sum.
__device__ __forceinline__ double block_exclusive_scan(double v, double* scratch, double* total) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int num_warps = blockDim.x >> 5;
  double x = v;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const double y = __shfl_up_sync(0xffffffffu, x, offset);
    if (lane >= offset) x += y;
  }
  __syncthreads();
  if (lane == 31) scratch[warp] = x;
  __syncthreads();
  if (warp == 0) {
    double w = lane < num_warps ? scratch[lane] : 0.0;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const double y = __shfl_up_sync(0xffffffffu, w, offset);
      if (lane >= offset) w += y;
    }
    scratch[lane] = w;
  }
  __syncthreads();
  *total = scratch[num_warps - 1];
  return (warp > 0 ? scratch[warp - 1] : 0.0) + x - v;
}

}  // namespace conduit

__global__ void sample_kernel(long long* __restrict__ out, const float* __restrict__ logits,
                              long long logits_row_stride, int vocab, const float* __restrict__ temperature,
                              const int* __restrict__ top_k, const float* __restrict__ top_p,
                              const float* __restrict__ min_p, const float* __restrict__ uniform) {
  using namespace conduit;
  __shared__ float f_scratch[32];
  __shared__ int i_scratch[32];
  __shared__ double d_scratch[32];
  const int row = blockIdx.x;
  const int tid = threadIdx.x;
  const int nt = blockDim.x;
  const float* x = logits + row * logits_row_stride;
  const float temp = temperature[row];

  if (!(temp > 0.0f)) {
    float best = neg_inf();
    for (int i = tid; i < vocab; i += nt) best = fmaxf(best, x[i]);  // fmaxf ignores NaN
    best = block_max(best, f_scratch);
    int first = 0x7fffffff;
    for (int i = tid; i < vocab; i += nt)
      if (x[i] == best) first = min(first, i);
    first = block_min_int(first, i_scratch);
    if (tid == 0) out[row] = first == 0x7fffffff ? 0 : first;
    return;
  }

  float z_max = neg_inf();
  for (int i = tid; i < vocab; i += nt) z_max = fmaxf(z_max, x[i] / temp);
  z_max = block_max(z_max, f_scratch);

  // top-k threshold as an order key: the largest key with at least k values at or above it.
  unsigned threshold = 0;
  const int k = top_k[row];
  if (k > 0 && k < vocab) {
    unsigned lo = 0, hi = 0xffffffffu;
    while (lo < hi) {
      const unsigned mid = lo + (hi - lo) / 2 + 1;
      float count = 0.0f;
      for (int i = tid; i < vocab; i += nt) {
        const float z = x[i] / temp;
        count += (z == z && order_key(z) >= mid) ? 1.0f : 0.0f;
      }
      count = block_sum(count, f_scratch);
      if (count >= static_cast<float>(k)) lo = mid;
      else hi = mid - 1;
    }
    threshold = lo;
  }
  const float mp = min_p[row];
  const float log_min_p = mp > 0.0f ? logf(mp) : neg_inf();

  // Mass of the kept tokens at or above `key`.
  auto kept_mass = [&](unsigned key) {
    double s = 0.0;
    for (int i = tid; i < vocab; i += nt) {
      const float z = x[i] / temp;
      const unsigned kz = order_key(z);
      if (z == z && kz >= threshold && kz >= key && z - z_max >= log_min_p) s += static_cast<double>(expf(z - z_max));
    }
    return block_sum_double(s, d_scratch);
  };

  const double total = kept_mass(0);
  const float tp = top_p[row];
  if (tp > 0.0f && tp < 1.0f) {
    const double target = static_cast<double>(tp) * total;
    unsigned lo = threshold, hi = 0xffffffffu;
    while (lo < hi) {
      const unsigned mid = lo + (hi - lo) / 2 + 1;
      if (kept_mass(mid) >= target) lo = mid;
      else hi = mid - 1;
    }
    threshold = lo;
  }

  // Selection: scan the kept mass in vocabulary order; each thread owns one contiguous chunk.
  const int chunk = (vocab + nt - 1) / nt;
  const int begin = min(vocab, tid * chunk);
  const int end = min(vocab, begin + chunk);
  double mine = 0.0;
  int last_kept = -1;
  for (int i = begin; i < end; ++i) {
    const float z = x[i] / temp;
    if (z == z && order_key(z) >= threshold && z - z_max >= log_min_p) {
      mine += static_cast<double>(expf(z - z_max));
      last_kept = i;
    }
  }
  double kept_total = 0.0;
  double running = block_exclusive_scan(mine, d_scratch, &kept_total);
  const double target = static_cast<double>(uniform[row]) * kept_total;
  int chosen = 0x7fffffff;
  if (running + mine > target) {
    for (int i = begin; i < end; ++i) {
      const float z = x[i] / temp;
      if (z == z && order_key(z) >= threshold && z - z_max >= log_min_p) {
        running += static_cast<double>(expf(z - z_max));
        if (running > target) {
          chosen = i;
          break;
        }
      }
    }
  }
  chosen = block_min_int(chosen, i_scratch);
  last_kept = block_max_int(last_kept, i_scratch);
  // Rounding can leave uniform * total at or past the final running sum: take the last kept token.
  if (tid == 0) out[row] = chosen != 0x7fffffff ? chosen : last_kept;
}
