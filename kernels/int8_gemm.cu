// Int8 linear (W8A8, `--quantization int8`; conduit_engine/ops/quant.py is the reference): x is quantized
// per token to int8, multiplied by the int8 weight on the tensor cores (mma.sync m16n8k32 s8, int32
// accumulation: kernels/mma.cuh), and scaled back: out[m, n] = float(acc) * (x_scale[m] * w_scale[n]) + bias[n].
//
// Layout: x, q and out row-major, w as nn.Linear's [N, K] rows (below per kernel).
// quantize_rows_int8_kernel<T>: x [M, K] (row stride x_stride) -> q [M, ldq] int8 (zeros past K), scales [M];
//   scale = max|x| / 127, q = rint(x * (127 / max|x|)) clamped to ±127 (round half to even, IEEE division:
//   the reference's float32 arithmetic, bit for bit). Grid: (M). Block: any multiple of 32 (256).
// int8_gemm_mma_kernel<T>: q [M, ldq] times w [N, ldq] (nn.Linear's [N, K] layout zero-padded to ldq, a
//   multiple of 32, at load) -> out [M, N] (row stride out_stride) in T. Each warp computes a 16 x 32 tile
//   (4 mma n-tiles) over the whole of K, its fragments read straight from global memory (4-byte loads of
//   row-major A and of the weight's rows, which are the "col" B operand); rows past M and columns past N
//   read zeros and are not stored. Grid: (ceil(N / 32), ceil(M / 64)). Block: 128 (4 warps = 64 rows).
// Limits: ldq % 32 == 0, 16-byte aligned q and w, M, N < 2^31; K * 127^2 < 2^31 (K < 133,000).
#include "mma.cuh"

namespace conduit {

constexpr int kInt8TileN = 32;  // columns per warp (4 mma tiles of 8)
constexpr int kInt8Warps = 4;  // warps per block, 16 rows each

__device__ __forceinline__ unsigned load_quad(const signed char* base, int rows, int row, long long ld, int k) {
  return row < rows ? *reinterpret_cast<const unsigned*>(base + row * ld + k) : 0u;
}

}  // namespace conduit

template <typename T>
__global__ void quantize_rows_int8_kernel(signed char* __restrict__ q, float* __restrict__ scales,
                                          const T* __restrict__ x, int K, long long x_stride, int ldq) {
  using namespace conduit;
  __shared__ float scratch[32];
  const T* row = x + blockIdx.x * x_stride;
  float amax = 0.0f;
  for (int k = threadIdx.x; k < K; k += blockDim.x) amax = fmaxf(amax, fabsf(to_float(row[k])));
  amax = block_max(amax, scratch);
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  signed char* dst = q + static_cast<long long>(blockIdx.x) * ldq;
  for (int k = threadIdx.x; k < ldq; k += blockDim.x) {
    const float v = k < K ? fminf(127.0f, fmaxf(-127.0f, rintf(to_float(row[k]) * inv))) : 0.0f;
    dst[k] = static_cast<signed char>(static_cast<int>(v));
  }
  if (threadIdx.x == 0) scales[blockIdx.x] = amax / 127.0f;
}

template <typename T>
__global__ void int8_gemm_mma_kernel(T* __restrict__ out, const signed char* __restrict__ q,
                                     const float* __restrict__ x_scale, const signed char* __restrict__ w,
                                     const float* __restrict__ w_scale, const T* __restrict__ bias, int M, int N,
                                     int ldq, long long out_stride) {
  using namespace conduit;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int m0 = (blockIdx.y * kInt8Warps + warp) * 16;
  const int n0 = blockIdx.x * kInt8TileN;
  if (m0 >= M) return;  // the whole warp leaves together (mma.sync needs all 32 lanes)
  int acc[4][4];
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[j][i] = 0;
  for (int k = 0; k < ldq; k += 32) {
    // A (16 x 32, row-major): a[0] = (g, 4t..4t+3), a[1] = (g + 8, 4t..), a[2] = (g, 4t + 16..), a[3] = (g + 8, 4t + 16..)
    const unsigned a[4] = {
        load_quad(q, M, m0 + g, ldq, k + 4 * t),
        load_quad(q, M, m0 + g + 8, ldq, k + 4 * t),
        load_quad(q, M, m0 + g, ldq, k + 4 * t + 16),
        load_quad(q, M, m0 + g + 8, ldq, k + 4 * t + 16),
    };
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      // B (32 x 8, col): b[0] = (k 4t..4t+3, n g), b[1] = (k 4t + 16.., n g): 4 bytes of weight row n
      const int n = n0 + 8 * j + g;
      const unsigned b[2] = {load_quad(w, N, n, ldq, k + 4 * t), load_quad(w, N, n, ldq, k + 4 * t + 16)};
      mma_m16n8k32_s8(acc[j], a, b);
    }
  }
  // D: d[0], d[1] = (g, 2t), (g, 2t + 1); d[2], d[3] = (g + 8, 2t), (g + 8, 2t + 1)
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int m = m0 + g + (i >= 2 ? 8 : 0);
      const int n = n0 + 8 * j + 2 * t + (i & 1);
      if (m < M && n < N) {
        float v = __fmul_rn(static_cast<float>(acc[j][i]), __fmul_rn(x_scale[m], w_scale[n]));
        if (bias != nullptr) v = __fadd_rn(v, to_float(bias[n]));
        out[m * out_stride + n] = from_float<T>(v);
      }
    }
}
