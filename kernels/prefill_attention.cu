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
// staged in shared memory as float32. Dynamic shared memory: prefill_shared_bytes() in ops/attention_geometry.py.
// Limits: HEAD_DIM a multiple of 8 (template parameter), block_size a power of two (passed as log2).
// Quantized caches (KV = kKvInt8 or kKvFp8, kv_quant.cuh; the float32 kernel only): k_cache/v_cache are
// the bytes [num_blocks, block_size, num_kv_heads, HEAD_DIM + 2] (parameters of type kv_elem_t),
// dequantized (code * the row's scale) as the tile is staged in shared memory.
//
// Two kernels take these arguments. paged_prefill_attention_mma_kernel (below) computes Q K^T and P V on
// tensor cores (f16 and bf16, HEAD_DIM a multiple of 16, sm_80+): the launcher picks it whenever it
// applies. paged_prefill_attention_kernel is the float32 one for the other cases (float32 models, head
// sizes such as stories260K's 8).
#include "kv_quant.cuh"
#include "mma.cuh"

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

template <typename T, int HEAD_DIM, int KV = conduit::kKvPlain>
__global__ void __launch_bounds__(128)
    paged_prefill_attention_kernel(T* __restrict__ out, long long out_token_stride, const T* __restrict__ q,
                                   long long q_token_stride, const conduit::kv_elem_t<T, KV>* __restrict__ k_cache,
                                   const conduit::kv_elem_t<T, KV>* __restrict__ v_cache,
                                   const int* __restrict__ block_tables,
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
      if (KV != kKvPlain) {  // K and V rows sit at the same byte offset of their caches
        const long long at = (slot * num_kv_heads + kv_head) * (HEAD_DIM + kKvScaleBytes);
        const unsigned char* k_bytes = reinterpret_cast<const unsigned char*>(k_cache) + at;
        const unsigned char* v_bytes = reinterpret_cast<const unsigned char*>(v_cache) + at;
        k_s[j * KS + d] = kv_decode<KV>(k_bytes[d]) * kv_row_scale(k_bytes, HEAD_DIM);
        v_s[j * HEAD_DIM + d] = kv_decode<KV>(v_bytes[d]) * kv_row_scale(v_bytes, HEAD_DIM);
      } else {
        const long long off = slot * row_stride + kv_head * HEAD_DIM + d;
        k_s[j * KS + d] = to_float(reinterpret_cast<const T*>(k_cache)[off]);
        v_s[j * HEAD_DIM + d] = to_float(reinterpret_cast<const T*>(v_cache)[off]);
      }
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

// ---- tensor cores ------------------------------------------------------------------------------------
// FlashAttention-2 structure: a block of 4 warps owns 64 query rows of one (sequence, head), 16 rows per
// warp; tiles of kKeys keys are staged in shared memory by the whole block (K row-major, V transposed) and
// each warp computes its S = Q K^T tile with mma.m16n8k16 (fragment layout in mma.cuh), applies
// scale, soft-cap and the causal / window mask in registers, keeps the online softmax's running maximum
// and sum per row (each row's values sit in the 4 lanes of a quad: two shuffles reduce them), and feeds P,
// rounded to T, straight from the accumulator registers into the P V mma. The output accumulates in
// float32 registers and is written once. A warp skips a key tile that none of its rows sees (the block's
// barriers are still met). Grid: (ceil(max_query_len / 64), num_seqs, num_heads). Block: 128 threads.
// Dynamic shared memory: prefill_mma_shared_bytes() in ops/attention_geometry.py. Needs 16-byte aligned q, out and
// caches, with token strides and the KV head size multiples of 8 elements (the launcher checks).
namespace conduit {
constexpr int kMmaWarps = 4;
constexpr int kMmaRows = 16 * kMmaWarps;
template <int HEAD_DIM>
struct MmaPrefillTile {
  static constexpr int kKeys = HEAD_DIM <= 128 ? 64 : 32;
  // Rows padded by 8 elements (16 bytes): the 8 rows one fragment load touches start 4 banks apart, so
  // its 32 lanes read 32 different banks, and every row stays 16-byte aligned for vector stores.
  static constexpr int kStride = HEAD_DIM + 8;  // q_s, k_s: one row per token
  static constexpr int kVStride = kKeys + 8;    // vt_s: V transposed, one row per head dimension
};
}  // namespace conduit

template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(128)
    paged_prefill_attention_mma_kernel(T* __restrict__ out, long long out_token_stride, const T* __restrict__ q,
                                       long long q_token_stride, const T* __restrict__ k_cache,
                                       const T* __restrict__ v_cache, const int* __restrict__ block_tables,
                                       int block_table_stride, const int* __restrict__ seq_lens,
                                       const int* __restrict__ query_start_loc, int num_kv_heads, int group_size,
                                       int log2_block_size, float scale, int sliding_window, float logit_softcap,
                                       float inv_softcap) {
  using namespace conduit;
  static_assert(HEAD_DIM % 16 == 0, "HEAD_DIM must be a multiple of 16");
  constexpr int BN = MmaPrefillTile<HEAD_DIM>::kKeys;
  constexpr int QS = MmaPrefillTile<HEAD_DIM>::kStride;
  constexpr int VS = MmaPrefillTile<HEAD_DIM>::kVStride;
  constexpr int KSTEPS = HEAD_DIM / 16;  // k-steps of Q K^T
  constexpr int STILES = BN / 8;         // 8-key column tiles of S
  constexpr int OTILES = HEAD_DIM / 8;   // 8-dimension column tiles of O
  constexpr int CHUNKS = HEAD_DIM / 8;   // 16-byte chunks of a row
  constexpr int kThreads = 32 * kMmaWarps;
  const int seq = blockIdx.y;
  const int head = blockIdx.z;
  const int kv_head = head / group_size;
  const int q_start = query_start_loc[seq];
  const int q_len = query_start_loc[seq + 1] - q_start;
  const int row0 = blockIdx.x * kMmaRows;
  if (row0 >= q_len) return;  // uniform per block
  const int context = seq_lens[seq] - q_len;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int g = (tid % 32) / 4;
  const int t = tid % 4;
  const int wrow = warp * 16;  // the warp's first row within the block's 64
  // The lane's rows g and g + 8 of its warp; rows past the chunk's end shadow its last row.
  int q_pos[2];
  int window_lo[2];  // keys must be > this
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    q_pos[r] = context + min(row0 + wrow + g + 8 * r, q_len - 1);
    window_lo[r] = sliding_window > 0 ? q_pos[r] - sliding_window : -1;
  }
  const int kv_end = context + min(row0 + kMmaRows, q_len);
  const int kv_begin = sliding_window > 0 ? max(0, context + row0 - sliding_window + 1) : 0;
  const int warp_last = context + min(row0 + wrow + 15, q_len - 1);  // the warp's highest position
  const int warp_lo = sliding_window > 0 ? context + min(row0 + wrow, q_len - 1) - sliding_window : -1;

  CONDUIT_DYNAMIC_SMEM(T, smem);
  T* q_s = smem;               // [64][QS]
  T* k_s = q_s + kMmaRows * QS;  // [BN][QS]
  T* vt_s = k_s + BN * QS;     // [HEAD_DIM][VS]

  for (int e = tid; e < kMmaRows * CHUNKS; e += kThreads) {
    const int r = e / CHUNKS;
    const int c = e - r * CHUNKS;
    const T* src = q + (q_start + min(row0 + r, q_len - 1)) * q_token_stride + head * HEAD_DIM + 8 * c;
    store_pack(q_s + r * QS + 8 * c, load_pack(src));
  }

  float o[OTILES][4];
#pragma unroll
  for (int j = 0; j < OTILES; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) o[j][i] = 0.0f;
  float run_max[2] = {neg_inf(), neg_inf()};
  float run_sum[2] = {0.0f, 0.0f};  // this lane's share of its rows' sums (the quad adds them at the end)
  const int block_mask = (1 << log2_block_size) - 1;
  const int* table = block_tables + static_cast<long long>(seq) * block_table_stride;
  const long long row_stride = static_cast<long long>(num_kv_heads) * HEAD_DIM;

  for (int kv0 = kv_begin; kv0 < kv_end; kv0 += BN) {
    const int n = min(BN, kv_end - kv0);
    __syncthreads();  // the previous tile's readers are done
    // K: consecutive threads copy consecutive 16-byte chunks of a key's row. V: consecutive threads take
    // consecutive keys of one chunk, so the transposed 2-byte stores of a warp fall into distinct banks.
    for (int e = tid; e < BN * CHUNKS; e += kThreads) {
      const int j = e / CHUNKS;
      const int c = e - j * CHUNKS;
      Pack<T> k_pack;
      if (j < n) {
        const int tok = kv0 + j;
        const long long slot =
            (static_cast<long long>(table[tok >> log2_block_size]) << log2_block_size) | (tok & block_mask);
        k_pack = load_pack(k_cache + slot * row_stride + kv_head * HEAD_DIM + 8 * c);
      } else {
#pragma unroll
        for (int i = 0; i < Pack<T>::kSize; ++i) k_pack.v[i] = from_float<T>(0.0f);
      }
      store_pack(k_s + j * QS + 8 * c, k_pack);
    }
    for (int e = tid; e < BN * CHUNKS; e += kThreads) {
      const int c = e / BN;
      const int j = e - c * BN;
      Pack<T> v_pack;
      if (j < n) {
        const int tok = kv0 + j;
        const long long slot =
            (static_cast<long long>(table[tok >> log2_block_size]) << log2_block_size) | (tok & block_mask);
        v_pack = load_pack(v_cache + slot * row_stride + kv_head * HEAD_DIM + 8 * c);
      } else {
        // Zero, not stale: P is 0 there, and 0 * NaN from poisoned memory would still be NaN.
#pragma unroll
        for (int i = 0; i < Pack<T>::kSize; ++i) v_pack.v[i] = from_float<T>(0.0f);
      }
#pragma unroll
      for (int i = 0; i < Pack<T>::kSize; ++i) vt_s[(8 * c + i) * VS + j] = v_pack.v[i];
    }
    __syncthreads();
    if (kv0 > warp_last || kv0 + n - 1 <= warp_lo) continue;  // no row of this warp sees the tile

    float s[STILES][4];
#pragma unroll
    for (int j = 0; j < STILES; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[j][i] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
      const T* qa = q_s + (wrow + g) * QS + 16 * kk + 2 * t;
      const unsigned a[4] = {load_pair(qa), load_pair(qa + 8 * QS), load_pair(qa + 8), load_pair(qa + 8 * QS + 8)};
#pragma unroll
      for (int j = 0; j < STILES; ++j) {
        const T* kb = k_s + (8 * j + g) * QS + 16 * kk + 2 * t;
        const unsigned b[2] = {load_pair(kb), load_pair(kb + 8)};
        mma_m16n8k16<T>(s[j], a, b);
      }
    }

    float tile_max[2] = {neg_inf(), neg_inf()};
#pragma unroll
    for (int j = 0; j < STILES; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = i / 2;
        const int key = kv0 + 8 * j + 2 * t + (i & 1);
        float v = s[j][i] * scale;
        if (logit_softcap > 0.0f) v = soft_cap(v, logit_softcap, inv_softcap);  // uniform per launch
        // A select, so a masked score never carries stale values into the softmax.
        v = (key < kv0 + n && key <= q_pos[r] && key > window_lo[r]) ? v : neg_inf();
        s[j][i] = v;
        tile_max[r] = fmaxf(tile_max[r], v);
      }
    float alpha[2];
    float base[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
      const float new_max = fmaxf(run_max[r], tile_max[r]);
      // A row that has seen no key yet keeps max -inf: exponents relative to 0 then give p = 0, alpha = 0.
      base[r] = new_max == neg_inf() ? 0.0f : new_max;
      alpha[r] = __expf(run_max[r] - base[r]);
      run_max[r] = new_max;
    }
    float tile_sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < STILES; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float p = __expf(s[j][i] - base[i / 2]);
        s[j][i] = p;
        tile_sum[i / 2] += p;
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) run_sum[r] = run_sum[r] * alpha[r] + tile_sum[r];
#pragma unroll
    for (int j = 0; j < OTILES; ++j) {
      o[j][0] *= alpha[0];
      o[j][1] *= alpha[0];
      o[j][2] *= alpha[1];
      o[j][3] *= alpha[1];
    }

    // P V: S tiles 2kk and 2kk + 1 are the A fragment of k-step kk (keys 16kk..16kk + 15).
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      const unsigned a[4] = {pack_pair<T>(s[2 * kk][0], s[2 * kk][1]), pack_pair<T>(s[2 * kk][2], s[2 * kk][3]),
                             pack_pair<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack_pair<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int j = 0; j < OTILES; ++j) {
        const T* vb = vt_s + (8 * j + g) * VS + 16 * kk + 2 * t;
        const unsigned b[2] = {load_pair(vb), load_pair(vb + 8)};
        mma_m16n8k16<T>(o[j], a, b);
      }
    }
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    run_sum[r] += __shfl_xor_sync(0xffffffffu, run_sum[r], 1);
    run_sum[r] += __shfl_xor_sync(0xffffffffu, run_sum[r], 2);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int qi = row0 + wrow + g + 8 * r;
    if (qi >= q_len) continue;
    const float inv = 1.0f / run_sum[r];
    T* out_row = out + (q_start + qi) * out_token_stride + head * HEAD_DIM + 2 * t;
#pragma unroll
    for (int j = 0; j < OTILES; ++j)
      *reinterpret_cast<unsigned*>(out_row + 8 * j) = pack_pair<T>(o[j][2 * r] * inv, o[j][2 * r + 1] * inv);
  }
}
