// Paged decode attention: one query token per sequence over its paged KV cache, grouped-query
// attention, split-K over the context with a separate reduction kernel. Softmax is online, in float32.
//
// Layout: q [num_seqs, num_heads, head_dim] (unit stride inside a token, `q_token_stride` between tokens);
// k_cache/v_cache [num_blocks, block_size, num_kv_heads, head_dim] contiguous; block_tables
// [num_seqs, block_table_stride] int32; seq_lens [num_seqs] int32 (context length including the new
// token, whose K/V are already in the cache); out [num_seqs, num_heads, head_dim] (`out_token_stride`).
// Query head h reads KV head h / group_size.
// Sliding window (`sliding_window` > 0): the query sees only the last `sliding_window` tokens of its context,
// [seq_len - sliding_window, seq_len); tokens before that are never read (their cache blocks may have been
// freed). Partitions tile that visible span. Soft-capping (`logit_softcap` > 0): each score s (q.k * scale)
// becomes logit_softcap * tanh(s * inv_softcap) before the softmax (inv_softcap = 1 / logit_softcap).
//
// Grid of paged_decode_attention_kernel: (num_seqs, num_kv_heads, num_partitions); block: a multiple of 32
// threads, which is also the tile of tokens processed per step. Each block serves all `group_size` query
// heads of one KV head (K/V are read once per group) over tokens [first + p * partition_size, first + (p + 1) *
// partition_size) of its sequence, where `first` is the first visible token (0 without a window). With num_partitions == 1 it writes `out` directly; otherwise it writes
// the normalised partial output, its running max and its sum to the float32 partial_* buffers
// ([num_seqs, num_heads, num_partitions(, head_dim)]) and paged_decode_reduce_kernel (grid (num_seqs,
// num_heads), any block size) combines them. Partitions past a sequence's end exit at once, so the grid
// may be sized for the longest possible context (what CUDA graph capture needs).
// Dynamic shared memory: decode_shared_bytes() in services/engine/src/conduit_engine/ops/cuda_ops.py.
// Limits: block_size a power of two (passed as log2), head_dim a multiple of 16 / sizeof(T),
// partition_size a multiple of blockDim.x, slots (block * block_size + offset) < 2^31.
#include "common.cuh"

namespace conduit {
constexpr int kDecodeMaxGroupChunk = 8;  // query heads scored per pass over a K row (registers)
}  // namespace conduit

template <typename T>
__global__ void paged_decode_attention_kernel(T* __restrict__ out, long long out_token_stride,
                                              float* __restrict__ partial_out, float* __restrict__ partial_max,
                                              float* __restrict__ partial_sum, const T* __restrict__ q,
                                              long long q_token_stride, const T* __restrict__ k_cache,
                                              const T* __restrict__ v_cache, const int* __restrict__ block_tables,
                                              int block_table_stride, const int* __restrict__ seq_lens,
                                              int num_kv_heads, int head_dim, int group_size, int log2_block_size,
                                              float scale, int partition_size, int sliding_window,
                                              float logit_softcap, float inv_softcap) {
  using namespace conduit;
  const int seq = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int part = blockIdx.z;
  const int num_parts = gridDim.z;
  const int num_heads = num_kv_heads * group_size;
  const int tile = blockDim.x;
  const int tid = threadIdx.x;
  const int G = group_size;
  const int D = head_dim;
  const int seq_len = seq_lens[seq];
  const int first = visible_start(seq_len, sliding_window);
  const int start = first + part * partition_size;
  if (start >= seq_len) {
    // Nothing to attend to: leave an empty partial (weight 0) for the reduction. Uniform per block.
    if (num_parts > 1) {
      for (int g = tid; g < G; g += tile) {
        const long long idx = (static_cast<long long>(seq) * num_heads + kv_head * G + g) * num_parts + part;
        partial_max[idx] = neg_inf();
        partial_sum[idx] = 0.0f;
      }
    }
    return;
  }
  const int end = min(start + partition_size, seq_len);

  CONDUIT_DYNAMIC_SMEM(unsigned char, smem);
  int* slots = reinterpret_cast<int*>(smem);               // [tile]
  float* q_s = reinterpret_cast<float*>(slots + tile);     // [G][D], pre-scaled
  float* acc = q_s + G * D;                                // [G][D]
  float* scores = acc + G * D;                             // [G][tile]
  float* run_max = scores + G * tile;                      // [G]
  float* run_sum = run_max + G;                            // [G]
  float* rescale = run_sum + G;                            // [G]

  const T* q_seq = q + seq * q_token_stride + kv_head * G * D;
  for (int e = tid; e < G * D; e += tile) {
    q_s[e] = to_float(q_seq[e]) * scale;
    acc[e] = 0.0f;
  }
  for (int g = tid; g < G; g += tile) {
    run_max[g] = neg_inf();
    run_sum[g] = 0.0f;
  }
  __syncthreads();

  const int block_mask = (1 << log2_block_size) - 1;
  const int* table = block_tables + static_cast<long long>(seq) * block_table_stride;
  const long long row_stride = static_cast<long long>(num_kv_heads) * D;  // elements per slot
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int num_warps = tile >> 5;
  constexpr int V = Pack<T>::kSize;

  for (int tile_start = start; tile_start < end; tile_start += tile) {
    // 1. Scores: each thread owns one token of the tile and scores it against every head of the group.
    const int t = tile_start + tid;
    if (t < end) {
      const int slot = (table[t >> log2_block_size] << log2_block_size) | (t & block_mask);
      slots[tid] = slot;
      const T* k_row = k_cache + slot * row_stride + kv_head * D;
      for (int g0 = 0; g0 < G; g0 += kDecodeMaxGroupChunk) {
        float s[kDecodeMaxGroupChunk];
#pragma unroll
        for (int j = 0; j < kDecodeMaxGroupChunk; ++j) s[j] = 0.0f;
        for (int c = 0; c < D; c += V) {
          const Pack<T> k = load_pack(k_row + c);
#pragma unroll
          for (int i = 0; i < V; ++i) {
            const float kf = to_float(k.v[i]);
#pragma unroll
            for (int j = 0; j < kDecodeMaxGroupChunk; ++j)
              if (g0 + j < G) s[j] += q_s[(g0 + j) * D + c + i] * kf;
          }
        }
#pragma unroll
        for (int j = 0; j < kDecodeMaxGroupChunk; ++j)
          if (g0 + j < G) scores[(g0 + j) * tile + tid] = soft_cap(s[j], logit_softcap, inv_softcap);
      }
    } else {
      for (int g = 0; g < G; ++g) scores[g * tile + tid] = neg_inf();
    }
    __syncthreads();

    // 2. Online softmax: one warp per head updates the running max and sum and turns scores into p.
    for (int g = warp; g < G; g += num_warps) {
      float* row = scores + g * tile;
      float tile_max = neg_inf();
      for (int i = lane; i < tile; i += 32) tile_max = fmaxf(tile_max, row[i]);
      tile_max = warp_max(tile_max);
      const float old_max = run_max[g];
      const float new_max = fmaxf(old_max, tile_max);  // finite: the tile holds at least one token
      float sum = 0.0f;
      for (int i = lane; i < tile; i += 32) {
        const float p = expf(row[i] - new_max);
        row[i] = p;
        sum += p;
      }
      sum = warp_sum(sum);
      if (lane == 0) {
        const float alpha = expf(old_max - new_max);
        run_sum[g] = run_sum[g] * alpha + sum;
        run_max[g] = new_max;
        rescale[g] = alpha;
      }
    }
    __syncthreads();

    // 3. acc = acc * alpha + p @ V; thread owns fixed (head, dim) elements, V rows are read coalesced.
    const int n = min(tile, end - tile_start);
    for (int e = tid; e < G * D; e += tile) {
      const int g = e / D;
      const int d = e - g * D;
      const float* p = scores + g * tile;
      const T* v_col = v_cache + kv_head * D + d;
      float a = acc[e] * rescale[g];
      // Unrolled so several independent V loads are in flight per thread.
#pragma unroll 4
      for (int i = 0; i < n; ++i) a += p[i] * to_float(v_col[slots[i] * row_stride]);
      acc[e] = a;
    }
    __syncthreads();
  }

  for (int e = tid; e < G * D; e += tile) {
    const int g = e / D;
    const int d = e - g * D;
    const int head = kv_head * G + g;
    const float o = acc[e] / run_sum[g];
    if (num_parts == 1) {
      out[seq * out_token_stride + head * D + d] = from_float<T>(o);
    } else {
      const long long idx = (static_cast<long long>(seq) * num_heads + head) * num_parts + part;
      partial_out[idx * D + d] = o;
      if (d == 0) {
        partial_max[idx] = run_max[g];
        partial_sum[idx] = run_sum[g];
      }
    }
  }
}

// Combine split-K partials: out = sum_p w_p * o_p / sum_p w_p with w_p = sum_p * exp(max_p - max).
// Grid: (num_seqs, num_heads). Block: any size; threads stride over head_dim.
template <typename T>
__global__ void paged_decode_reduce_kernel(T* __restrict__ out, long long out_token_stride,
                                           const float* __restrict__ partial_out,
                                           const float* __restrict__ partial_max,
                                           const float* __restrict__ partial_sum, const int* __restrict__ seq_lens,
                                           int head_dim, int num_partitions, int partition_size,
                                           int sliding_window) {
  using namespace conduit;
  const int seq = blockIdx.x;
  const int head = blockIdx.y;
  const int num_heads = gridDim.y;
  const int visible = seq_lens[seq] - visible_start(seq_lens[seq], sliding_window);
  const int used = min(num_partitions, (visible + partition_size - 1) / partition_size);
  const long long base = (static_cast<long long>(seq) * num_heads + head) * num_partitions;
  float global_max = neg_inf();
  for (int p = 0; p < used; ++p) global_max = fmaxf(global_max, partial_max[base + p]);
  float total = 0.0f;
  for (int p = 0; p < used; ++p) total += partial_sum[base + p] * expf(partial_max[base + p] - global_max);
  const float inv_total = 1.0f / total;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float o = 0.0f;
    for (int p = 0; p < used; ++p) {
      const float w = partial_sum[base + p] * expf(partial_max[base + p] - global_max);
      o += w * partial_out[(base + p) * head_dim + d];
    }
    out[seq * out_token_stride + head * head_dim + d] = from_float<T>(o * inv_total);
  }
}
