// Grammar masking: logits of tokens a row's grammar disallows become -inf, in place, in listed rows only.
//
// Layout: logits [num_logit_rows, vocab] float32 (`logits_row_stride` between rows, unit stride inside);
// bitmask [num_mask_rows, words] int32 contiguous, words = ceil(vocab / 32); token t is allowed when bit
// t % 32 (least significant first) of bitmask[i, t / 32] is set, and bits past vocab are ignored;
// rows [num_mask_rows] int64: the logits row bitmask row i applies to (distinct, any order).
// Grid: (ceil(vocab / blockDim.x) capped by the wrapper, num_mask_rows); each block strides over the
// vocabulary. Block: a multiple of 32 threads, one token per thread per pass: the 32 threads of a warp
// read the same bitmask word (one broadcast load) and write 32 consecutive logits (coalesced); allowed
// tokens are not written at all. Rows outside [0, num_logit_rows) are skipped, never written.
// Limits: vocab <= 2^30; num_mask_rows <= 65535 (grid.y).
#include "common.cuh"

__global__ void apply_token_bitmask_kernel(float* __restrict__ logits, long long logits_row_stride, int vocab,
                                           const int* __restrict__ bitmask, int words,
                                           const long long* __restrict__ rows, int num_logit_rows) {
  using namespace conduit;
  const long long row = rows[blockIdx.y];
  if (row < 0 || row >= num_logit_rows) return;
  const int* mask = bitmask + static_cast<long long>(blockIdx.y) * words;
  float* x = logits + row * logits_row_stride;
  const int stride = gridDim.x * blockDim.x;
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < vocab; t += stride) {
    const unsigned word = static_cast<unsigned>(mask[t >> 5]);
    if (((word >> (t & 31)) & 1u) == 0u) x[t] = neg_inf();
  }
}
