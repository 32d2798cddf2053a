// Paged decode attention: one query token per sequence over its paged KV cache, grouped-query
// attention, split-K over the context, combined by the last partition to finish. Softmax is online, in float32.
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
// threads. Each block serves all `group_size` query heads of one KV head (K/V are read once per group, in
// passes of GROUP heads: the launcher picks the power of two that covers the group, up to
// kDecodeGroupChunk / CHUNKS, so registers hold only the heads there are) over tokens [first + p * partition_size, first + (p + 1) *
// partition_size) of its sequence, where `first` is the first visible token (0 without a window).
// A K or V row is split into 16-byte chunks across L lanes (L = the row's chunks rounded up to a power of
// two, at most 32; CHUNKS chunks a lane beyond 32), so a warp reads 32 / L rows per step with 16-byte
// vector loads, each token's row contiguous; the lanes of a row add their partial dot products by shuffles
// and each keeps an online softmax and output accumulator for its own dimensions, in registers. At the
// end the 32 / L rows of a warp merge by shuffles and the warps through shared memory. With num_partitions
// == 1 the block writes `out` directly; otherwise it writes the normalised partial output, its running max
// and its sum to the float32 partial_* buffers ([num_seqs, num_heads, num_partitions(, head_dim)]), counts
// itself in split_counters[seq, kv_head] (int32, zero between launches), and the last of the sequence's
// partitions to finish combines them into `out` and resets the counter. Partitions past a sequence's end
// exit at once (uncounted), so the grid may be sized for the longest possible context (what CUDA graph
// capture needs).
// Dynamic shared memory: decode_shared_bytes() in services/engine/src/conduit_engine/ops/attention_geometry.py.
// Quantized caches (KV = kKvInt8 or kKvFp8, kv_quant.cuh): k_cache/v_cache are then the bytes
// [num_blocks, block_size, num_kv_heads, head_dim + 2] (parameters of type kv_elem_t: bytes); a lane
// reads its chunks' codes byte by byte and multiplies by the row's scale. Everything else is unchanged.
// Limits: block_size a power of two (passed as log2), head_dim a multiple of 16 / sizeof(T) and at most
// 32 * CHUNKS * 16 / sizeof(T), slots (block * block_size + offset) < 2^31.
#include "kv_quant.cuh"

namespace conduit {
constexpr int kDecodeGroupChunk = 8;  // GROUP x CHUNKS at most: query heads per pass over the KV (registers)

// Merge two online-softmax states (max, sum, accumulator) of the same rows.
__device__ __forceinline__ void merge_scale(float m1, float m2, float& a1, float& a2, float& m) {
  m = fmaxf(m1, m2);
  const float base = m == neg_inf() ? 0.0f : m;  // both empty: weights 0, not NaN
  a1 = __expf(m1 - base);
  a2 = __expf(m2 - base);
}
}  // namespace conduit

template <typename T, int CHUNKS, int GROUP, int KV = conduit::kKvPlain>
__global__ void paged_decode_attention_kernel(T* __restrict__ out, long long out_token_stride,
                                              float* __restrict__ partial_out, float* __restrict__ partial_max,
                                              float* __restrict__ partial_sum, int* __restrict__ split_counters,
                                              const T* __restrict__ q,
                                              long long q_token_stride,
                                              const conduit::kv_elem_t<T, KV>* __restrict__ k_cache,
                                              const conduit::kv_elem_t<T, KV>* __restrict__ v_cache,
                                              const int* __restrict__ block_tables,
                                              int block_table_stride, const int* __restrict__ seq_lens,
                                              int num_kv_heads, int head_dim, int group_size, int log2_block_size,
                                              float scale, int partition_size, int sliding_window,
                                              float logit_softcap, float inv_softcap) {
  using namespace conduit;
  constexpr int V = Pack<T>::kSize;                  // elements per 16-byte chunk
  static_assert(GROUP * CHUNKS <= kDecodeGroupChunk, "GROUP x CHUNKS is bounded by the registers");
  constexpr int GC = GROUP;                          // heads per pass
  constexpr int E = CHUNKS * V;                      // elements of a row a lane owns
  const int seq = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int part = blockIdx.z;
  const int num_parts = gridDim.z;
  const int num_heads = num_kv_heads * group_size;
  const int tid = threadIdx.x;
  const int G = group_size;
  const int D = head_dim;
  const int seq_len = seq_lens[seq];
  const int first = visible_start(seq_len, sliding_window);
  const int start = first + part * partition_size;
  if (start >= seq_len) return;  // past the sequence's end: nothing to attend to, not counted
  const int end = min(start + partition_size, seq_len);
  const int row_chunks = D / V;
  int lanes = 1;  // L: lanes per row
  while (lanes < row_chunks && lanes < 32) lanes <<= 1;
  const int rows_per_step = 32 / lanes;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int num_warps = blockDim.x >> 5;
  const int sub = lane / lanes;      // which row of the warp's step
  const int li = lane - sub * lanes;  // lane within the row

  CONDUIT_DYNAMIC_SMEM(float, smem);
  float* s_acc = smem;                           // [num_warps][GC][D]
  float* s_max = s_acc + num_warps * GC * D;     // [num_warps][GC]
  float* s_sum = s_max + num_warps * GC;         // [num_warps][GC]

  const int block_mask = (1 << log2_block_size) - 1;
  const int* table = block_tables + static_cast<long long>(seq) * block_table_stride;
  const long long row_stride = static_cast<long long>(num_kv_heads) * D;  // elements per slot

  for (int g0 = 0; g0 < G; g0 += GC) {
    const int gn = min(GC, G - g0);
    const T* q_seq = q + seq * q_token_stride + (kv_head * G + g0) * D;
    float qr[GC][E];
    float acc[GC][E];
    float m[GC];
    float l[GC];
#pragma unroll
    for (int j = 0; j < GC; ++j) {
      m[j] = neg_inf();
      l[j] = 0.0f;
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c) {
        const int chunk = li + c * lanes;
        const bool here = j < gn && chunk < row_chunks;
        // Element by element (once per block): q may be a view with any alignment.
#pragma unroll
        for (int i = 0; i < V; ++i) {
          qr[j][c * V + i] = here ? to_float(q_seq[j * D + chunk * V + i]) * scale : 0.0f;
          acc[j][c * V + i] = 0.0f;
        }
      }
    }

    for (int t0 = start + warp * rows_per_step; t0 < end; t0 += num_warps * rows_per_step) {
      const int t = t0 + sub;
      const bool valid = t < end;
      float kf[E];
      float vf[E];
      if (valid && KV != kKvPlain) {
        const int slot = (table[t >> log2_block_size] << log2_block_size) | (t & block_mask);
        const unsigned char* k_row = kv_row(k_cache, slot, num_kv_heads, kv_head, D);
        const unsigned char* v_row = kv_row(v_cache, slot, num_kv_heads, kv_head, D);
        const float k_scale = kv_row_scale(k_row, D);
        const float v_scale = kv_row_scale(v_row, D);
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
          const int chunk = li + c * lanes;
#pragma unroll
          for (int i = 0; i < V; ++i) {
            kf[c * V + i] = chunk < row_chunks ? kv_decode<KV>(k_row[chunk * V + i]) * k_scale : 0.0f;
            vf[c * V + i] = chunk < row_chunks ? kv_decode<KV>(v_row[chunk * V + i]) * v_scale : 0.0f;
          }
        }
      } else if (valid) {
        const int slot = (table[t >> log2_block_size] << log2_block_size) | (t & block_mask);
        const T* k_row = reinterpret_cast<const T*>(k_cache) + slot * row_stride + kv_head * D;
        const T* v_row = reinterpret_cast<const T*>(v_cache) + slot * row_stride + kv_head * D;
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
          const int chunk = li + c * lanes;
          Pack<T> kp{}, vp{};
          if (chunk < row_chunks) {
            kp = load_pack(k_row + chunk * V);
            vp = load_pack(v_row + chunk * V);
          }
#pragma unroll
          for (int i = 0; i < V; ++i) {
            kf[c * V + i] = chunk < row_chunks ? to_float(kp.v[i]) : 0.0f;
            vf[c * V + i] = chunk < row_chunks ? to_float(vp.v[i]) : 0.0f;
          }
        }
      } else {
#pragma unroll
        for (int e = 0; e < E; ++e) kf[e] = vf[e] = 0.0f;
      }
      float s[GC];
#pragma unroll
      for (int j = 0; j < GC; ++j) {
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) dot += qr[j][e] * kf[e];
        s[j] = dot;
      }
      // The row's lanes are an aligned group of `lanes`: xor offsets below it stay inside the row.
      for (int offset = lanes >> 1; offset > 0; offset >>= 1) {
#pragma unroll
        for (int j = 0; j < GC; ++j) s[j] += __shfl_xor_sync(0xffffffffu, s[j], offset);
      }
      if (valid) {
#pragma unroll
        for (int j = 0; j < GC; ++j) {
          if (j >= gn) continue;
          const float score = soft_cap(s[j], logit_softcap, inv_softcap);
          const float new_max = fmaxf(m[j], score);
          const float alpha = __expf(m[j] - new_max);
          const float p = __expf(score - new_max);
          l[j] = l[j] * alpha + p;
#pragma unroll
          for (int e = 0; e < E; ++e) acc[j][e] = acc[j][e] * alpha + p * vf[e];
          m[j] = new_max;
        }
      }
    }

    // The warp's rows (lanes `lanes` apart) merge into sub-row 0.
    for (int offset = lanes; offset < 32; offset <<= 1) {
#pragma unroll
      for (int j = 0; j < GC; ++j) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m[j], offset);
        const float l2 = __shfl_xor_sync(0xffffffffu, l[j], offset);
        float a1, a2;
        merge_scale(m[j], m2, a1, a2, m[j]);
        l[j] = l[j] * a1 + l2 * a2;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[j][e] = acc[j][e] * a1 + __shfl_xor_sync(0xffffffffu, acc[j][e], offset) * a2;
      }
    }
    if (sub == 0) {
#pragma unroll
      for (int j = 0; j < GC; ++j) {
        if (j >= gn) continue;
        const int w = warp * GC + j;
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
          const int chunk = li + c * lanes;
          if (chunk >= row_chunks) continue;
#pragma unroll
          for (int i = 0; i < V; ++i) s_acc[w * D + chunk * V + i] = acc[j][c * V + i];
        }
        if (li == 0) {
          s_max[w] = m[j];
          s_sum[w] = l[j];
        }
      }
    }
    __syncthreads();

    // The warps' states merge: one thread per (head, dimension).
    for (int e = tid; e < gn * D; e += blockDim.x) {
      const int j = e / D;
      const int d = e - j * D;
      float best = neg_inf();
      for (int w = 0; w < num_warps; ++w) best = fmaxf(best, s_max[w * GC + j]);
      float total = 0.0f;
      float o = 0.0f;
      for (int w = 0; w < num_warps; ++w) {
        const float weight = s_max[w * GC + j] == neg_inf() ? 0.0f : __expf(s_max[w * GC + j] - best);
        total += s_sum[w * GC + j] * weight;
        o += s_acc[(w * GC + j) * D + d] * weight;
      }
      o /= total;  // the partition holds a token, so some warp saw one
      const int head = kv_head * G + g0 + j;
      if (num_parts == 1) {
        out[seq * out_token_stride + head * D + d] = from_float<T>(o);
      } else {
        const long long idx = (static_cast<long long>(seq) * num_heads + head) * num_parts + part;
        partial_out[idx * D + d] = o;
        if (d == 0) {
          partial_max[idx] = best;
          partial_sum[idx] = total;
        }
      }
    }
    __syncthreads();  // before the next head chunk reuses the buffers
  }
  if (num_parts == 1) return;

  // Split-K: the last partition of (seq, kv_head) to finish combines them all, so no second launch.
  __shared__ int s_last;
  __threadfence();  // this block's partials are visible to the block that combines them
  __syncthreads();
  const int used = min(num_parts, (seq_len - first + partition_size - 1) / partition_size);
  if (tid == 0) {
    int* counter = split_counters + static_cast<long long>(seq) * num_kv_heads + kv_head;
    s_last = atomicAdd(counter, 1) == used - 1;
    if (s_last) *counter = 0;  // ready for the next launch (CUDA graph replays)
  }
  __syncthreads();
  if (!s_last) return;  // uniform per block
  __threadfence();
  for (int e = tid; e < G * D; e += blockDim.x) {
    const int g = e / D;
    const int d = e - g * D;
    const long long base = (static_cast<long long>(seq) * num_heads + kv_head * G + g) * num_parts;
    float best = neg_inf();
    for (int p = 0; p < used; ++p) best = fmaxf(best, partial_max[base + p]);
    float total = 0.0f;
    float o = 0.0f;
    for (int p = 0; p < used; ++p) {
      const float w = partial_sum[base + p] * __expf(partial_max[base + p] - best);
      total += w;
      o += w * partial_out[(base + p) * D + d];
    }
    out[seq * out_token_stride + (kv_head * G + g) * D + d] = from_float<T>(o / total);
  }
}
