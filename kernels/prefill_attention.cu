// Prefill attention over the paged KV cache: variable-length causal attention for packed query chunks
// whose earlier tokens may already be cached (chunked prefill, prefix caching). Online softmax, float32.
//
// Layout: q [num_tokens, num_heads, head_dim] packed by sequence (`q_token_stride` between tokens);
// query_start_loc [num_seqs + 1] int32; seq_lens [num_seqs] int32 = cached + new tokens, whose K/V are
// already written to the cache; k_cache/v_cache [num_blocks, block_size, num_kv_heads, head_dim];
// block_tables [num_seqs, block_table_stride] int32; out like q (`out_token_stride`). Query i of a
// sequence sits at position seq_len - query_len + i and sees keys 0..that position, or with a sliding window
// (`sliding_window` > 0) only the last `sliding_window` of them; keys below the lowest window of a block's
// rows are never read (their cache blocks may have been freed). Soft-capping (`logit_softcap` > 0): each
// score s (q.k * scale) becomes logit_softcap * tanh(s * inv_softcap) before the softmax (inv_softcap = 1 / cap).
// Grid: (ceil(max_query_len / 16), num_seqs, num_heads). Block: 128 threads = 16 query rows x 8 lanes;
// a lane owns head_dim / 8 output dimensions. Keys are processed in tiles of prefill_tile_keys(HEAD_DIM)
// staged in shared memory as float32. Dynamic shared memory: prefill_shared_bytes() in ops/cuda_ops.py.
// Limits: HEAD_DIM a multiple of 8 (template parameter), block_size a power of two (passed as log2).
#include "common.cuh"

namespace conduit {
constexpr int kPrefillRows = 16;
constexpr int kPrefillLanes = 8;
constexpr int kPrefillThreads = kPrefillRows * kPrefillLanes;
template <int HEAD_DIM>
struct PrefillTile {
  static constexpr int kKeys = (4096 / HEAD_DIM) < 16 ? 16 : ((4096 / HEAD_DIM) > 64 ? 64 : 4096 / HEAD_DIM);
  // Row strides padded by one float so that the 4 query rows and 8 key rows a warp touches at once fall
  // into different shared memory banks.
  static constexpr int kKStride = HEAD_DIM + 1;
  static constexpr int kQStride = HEAD_DIM + 1;
  static constexpr int kPStride = kKeys + 1;
};
}  // namespace conduit

template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(128)
    paged_prefill_attention_kernel(T* __restrict__ out, long long out_token_stride, const T* __restrict__ q,
                                   long long q_token_stride, const T* __restrict__ k_cache,
                                   const T* __restrict__ v_cache, const int* __restrict__ block_tables,
                                   int block_table_stride, const int* __restrict__ seq_lens,
                                   const int* __restrict__ query_start_loc, int num_kv_heads, int group_size,
                                   int log2_block_size, float scale, int sliding_window, float logit_softcap,
                                   float inv_softcap) {
  using namespace conduit;
  static_assert(HEAD_DIM % kPrefillLanes == 0, "HEAD_DIM must be a multiple of 8");
  constexpr int BN = PrefillTile<HEAD_DIM>::kKeys;
  constexpr int KS = PrefillTile<HEAD_DIM>::kKStride;
  constexpr int QS = PrefillTile<HEAD_DIM>::kQStride;
  constexpr int PS = PrefillTile<HEAD_DIM>::kPStride;
  constexpr int DPL = HEAD_DIM / kPrefillLanes;
  constexpr int KPL = BN / kPrefillLanes;
  const int seq = blockIdx.y;
  const int head = blockIdx.z;
  const int kv_head = head / group_size;
  const int q_start = query_start_loc[seq];
  const int q_len = query_start_loc[seq + 1] - q_start;
  const int row0 = blockIdx.x * kPrefillRows;
  if (row0 >= q_len) return;  // uniform per block
  const int seq_len = seq_lens[seq];
  const int context = seq_len - q_len;
  const int tid = threadIdx.x;
  const int row = tid / kPrefillLanes;
  const int lane = tid % kPrefillLanes;
  const int qi = row0 + row;
  const bool valid = qi < q_len;
  // Rows past the chunk's end shadow its last row so that every row has a finite softmax.
  const int q_pos = context + min(qi, q_len - 1);
  const int kv_end = context + min(row0 + kPrefillRows, q_len);
  // The lowest key any row of this block sees: row0's window start.
  const int kv_begin = sliding_window > 0 ? max(0, context + row0 - sliding_window + 1) : 0;
  const int window_lo = sliding_window > 0 ? q_pos - sliding_window : -1;  // keys must be > this

  CONDUIT_DYNAMIC_SMEM(float, smem);
  float* q_s = smem;                     // [16][QS], pre-scaled
  float* k_s = q_s + kPrefillRows * QS;   // [BN][KS]
  float* v_s = k_s + BN * KS;            // [BN][HEAD_DIM]
  float* p_s = v_s + BN * HEAD_DIM;      // [16][PS]

  {
    const int src_row = q_start + min(qi, q_len - 1);
    const T* q_row = q + src_row * q_token_stride + head * HEAD_DIM;
    for (int d = lane; d < HEAD_DIM; d += kPrefillLanes) q_s[row * QS + d] = to_float(q_row[d]) * scale;
  }
  float acc[DPL];
#pragma unroll
  for (int i = 0; i < DPL; ++i) acc[i] = 0.0f;
  float run_max = neg_inf();
  float run_sum = 0.0f;
  const int block_mask = (1 << log2_block_size) - 1;
  const int* table = block_tables + static_cast<long long>(seq) * block_table_stride;
  const long long row_stride = static_cast<long long>(num_kv_heads) * HEAD_DIM;

  for (int kv0 = kv_begin; kv0 < kv_end; kv0 += BN) {
    const int n = min(BN, kv_end - kv0);
    for (int e = tid; e < n * HEAD_DIM; e += kPrefillThreads) {
      const int j = e / HEAD_DIM;
      const int d = e - j * HEAD_DIM;
      const int t = kv0 + j;
      const long long slot = (static_cast<long long>(table[t >> log2_block_size]) << log2_block_size) | (t & block_mask);
      const long long off = slot * row_stride + kv_head * HEAD_DIM + d;
      k_s[j * KS + d] = to_float(k_cache[off]);
      v_s[j * HEAD_DIM + d] = to_float(v_cache[off]);
    }
    __syncthreads();

    // Scores of this row against the lane's keys j = lane, lane + 8, ...: all of them at once, so each
    // q element is read once per tile; keys past the tile, the causal limit or the window become -inf (a
    // select, so stale shared memory in unused rows never leaks in).
    float s[KPL];
#pragma unroll
    for (int jj = 0; jj < KPL; ++jj) s[jj] = 0.0f;
#pragma unroll 4
    for (int d = 0; d < HEAD_DIM; ++d) {
      const float qd = q_s[row * QS + d];
#pragma unroll
      for (int jj = 0; jj < KPL; ++jj) s[jj] += qd * k_s[(lane + jj * kPrefillLanes) * KS + d];
    }
    if (logit_softcap > 0.0f) {  // uniform per launch
#pragma unroll
      for (int jj = 0; jj < KPL; ++jj) s[jj] = soft_cap(s[jj], logit_softcap, inv_softcap);
    }
    float tile_max = neg_inf();
#pragma unroll
    for (int jj = 0; jj < KPL; ++jj) {
      const int j = lane + jj * kPrefillLanes;
      s[jj] = (j < n && kv0 + j <= q_pos && kv0 + j > window_lo) ? s[jj] : neg_inf();
      tile_max = fmaxf(tile_max, s[jj]);
    }
#pragma unroll
    for (int offset = kPrefillLanes / 2; offset > 0; offset >>= 1)
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, offset, kPrefillLanes));
    // The first tile holds a key every row sees (key 0, or with a window key kv_begin + row, within the
    // first kPrefillRows <= BN keys), so new_max is finite from then on.
    const float new_max = fmaxf(run_max, tile_max);
    float sum = 0.0f;
#pragma unroll
    for (int jj = 0; jj < KPL; ++jj) {
      const float p = expf(s[jj] - new_max);
      p_s[row * PS + lane + jj * kPrefillLanes] = p;
      sum += p;
    }
#pragma unroll
    for (int offset = kPrefillLanes / 2; offset > 0; offset >>= 1)
      sum += __shfl_xor_sync(0xffffffffu, sum, offset, kPrefillLanes);
    const float alpha = expf(run_max - new_max);
    run_sum = run_sum * alpha + sum;
    run_max = new_max;
    __syncthreads();

#pragma unroll
    for (int i = 0; i < DPL; ++i) acc[i] *= alpha;
    for (int j = 0; j < n; ++j) {
      const float p = p_s[row * PS + j];
      const float* v_row = v_s + j * HEAD_DIM + lane;
#pragma unroll
      for (int i = 0; i < DPL; ++i) acc[i] += p * v_row[i * kPrefillLanes];
    }
    __syncthreads();
  }

  if (valid) {
    T* out_row = out + (q_start + qi) * out_token_stride + head * HEAD_DIM;
    const float inv = 1.0f / run_sum;
#pragma unroll
    for (int i = 0; i < DPL; ++i) out_row[lane + i * kPrefillLanes] = from_float<T>(acc[i] * inv);
  }
}
