// Test-only kernels that exercise the emulation harness itself (tests/kernels/test_emulator.py).
#include "common.cuh"
#include "mma.cuh"

// Sum of x[0..n) per block through conduit::block_sum (shuffles + a static __shared__ scratch).
__global__ void selftest_block_sum(float* out, const float* x, int n) {
  __shared__ float scratch[32];
  float s = 0.0f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += x[i];
  s = conduit::block_sum(s, scratch);
  if (threadIdx.x == 0) out[blockIdx.x] = s;
}

// Every warp primitive, recorded per thread: out[8 * tid + j].
__global__ void selftest_warp_ops(int* out, int offset) {
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  int* o = out + 8 * tid;
  o[0] = __shfl_sync(0xffffffffu, tid * 10, (lane + offset) & 31);
  o[1] = __shfl_xor_sync(0xffffffffu, tid * 10, offset);
  o[2] = __shfl_up_sync(0xffffffffu, tid * 10, offset);
  o[3] = __shfl_down_sync(0xffffffffu, tid * 10, offset);
  o[4] = __shfl_xor_sync(0xffffffffu, tid * 10, 1, 8);  // sub-warp width
  o[5] = static_cast<int>(__ballot_sync(0xffffffffu, lane % 3 == 0));
  o[6] = __any_sync(0xffffffffu, tid == 5) + 2 * __all_sync(0xffffffffu, lane < 32);
  o[7] = lane < 16 ? __shfl_down_sync(0x0000ffffu, tid, 1, 16) : -1;  // only the low half-warp takes part
}

// Rotates values through shared memory; `with_barrier` = 0 drops the __syncthreads (a data race).
__global__ void selftest_rotate(float* out, const float* x, int with_barrier) {
  __shared__ float buf[256];
  const int tid = threadIdx.x;
  buf[tid] = x[tid];
  if (with_barrier) __syncthreads();
  out[tid] = buf[(tid + 1) % blockDim.x];
}

// The same race through dynamic shared memory.
__global__ void selftest_rotate_dynamic(float* out, const float* x, int with_barrier) {
  CONDUIT_DYNAMIC_SMEM(float, buf);
  const int tid = threadIdx.x;
  buf[tid] = x[tid];
  if (with_barrier) __syncthreads();
  out[tid] = buf[(tid + 1) % blockDim.x];
}

// Barrier misuse the emulator must report: 0 divergent __syncthreads, 1 a barrier after some threads
// returned, 2 a full-warp shuffle that half of the warp never reaches.
__global__ void selftest_bad_sync(float* out, int mode) {
  const int tid = threadIdx.x;
  if (mode == 0) {
    if (tid < 16) {
      __syncthreads();
    } else {
      __syncthreads();
    }
  } else if (mode == 1) {
    if (tid >= 16) return;
    __syncthreads();
  } else {
    if (tid < 16) out[tid] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
  }
  out[tid] = 1.0f;
}

// float -> half / bfloat16 -> float round trips, to compare the emulated conversions with torch.
__global__ void selftest_convert(__half* to_half, __nv_bfloat16* to_bf16, float* back_half, float* back_bf16,
                                 const float* x, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
    to_half[i] = __float2half_rn(x[i]);
    to_bf16[i] = __float2bfloat16_rn(x[i]);
    back_half[i] = __half2float(to_half[i]);
    back_bf16[i] = __bfloat162float(to_bf16[i]);
  }
}

// Atomics from every thread of every block: counts, a float sum of integers, a max, a CAS-claimed slot.
__global__ void selftest_atomics(int* counter, float* total, int* maximum, int* claimed) {
  const int gid = blockIdx.x * blockDim.x + threadIdx.x;
  atomicAdd(counter, 1);
  atomicAdd(total, static_cast<float>(gid));
  atomicMax(maximum, gid * 7 % 1000);
  __syncwarp();  // a warp operation between the atomics: other lanes run in between
  atomicCAS(claimed + blockIdx.x, -1, gid);
}

// Writes one float per thread at offset `shift` into dynamic shared memory sized for blockDim.x floats.
__global__ void selftest_smem_overflow(int shift) {
  CONDUIT_DYNAMIC_SMEM(float, buf);
  buf[threadIdx.x + shift] = 1.0f;
}

// One tensor-core mma.m16n8k16 by one warp with the fragment layout of kernels/mma.cuh: a [16][16] row-major,
// b_t [8][16] (B transposed: each column's 16 k values contiguous), d [16][8] row-major holding C on entry.
// `lanes` < 32: only that many lanes reach the mma (invalid: mma.sync needs the whole warp).
__global__ void selftest_mma(float* d, const unsigned short* a, const unsigned short* b_t, int use_bf16, int lanes) {
  const int lane = threadIdx.x;
  if (lane >= lanes) return;
  const int g = lane / 4, t = lane % 4;
  const unsigned fa[4] = {conduit::load_pair(a + g * 16 + 2 * t), conduit::load_pair(a + (g + 8) * 16 + 2 * t),
                          conduit::load_pair(a + g * 16 + 2 * t + 8), conduit::load_pair(a + (g + 8) * 16 + 2 * t + 8)};
  const unsigned fb[2] = {conduit::load_pair(b_t + g * 16 + 2 * t), conduit::load_pair(b_t + g * 16 + 2 * t + 8)};
  float acc[4] = {d[g * 8 + 2 * t], d[g * 8 + 2 * t + 1], d[(g + 8) * 8 + 2 * t], d[(g + 8) * 8 + 2 * t + 1]};
  if (use_bf16)
    conduit::mma_m16n8k16<conduit::bf16>(acc, fa, fb);
  else
    conduit::mma_m16n8k16<conduit::f16>(acc, fa, fb);
  d[g * 8 + 2 * t] = acc[0];
  d[g * 8 + 2 * t + 1] = acc[1];
  d[(g + 8) * 8 + 2 * t] = acc[2];
  d[(g + 8) * 8 + 2 * t + 1] = acc[3];
}
