// The CPU kernels for AVX2 + FMA (Haswell, Zen 1 and later).
// Layout, grid and limits: see common.h and kernels_impl.h. Standard headers come before the target
// pragma, so only this file's own functions use these instructions (never code shared with other files).
#include "common.h"
#include <immintrin.h>

#pragma GCC target("avx2,fma")
#define CONDUIT_ISA isa_avx2
#define CONDUIT_INT8 1
#define CONDUIT_BF16_DOT 0

namespace conduit_cpu {
namespace CONDUIT_ISA {
#include "vec_math.h"
#include "vec_avx2.h"
}  // namespace CONDUIT_ISA
}  // namespace conduit_cpu

#include "kernels_impl.h"

const conduit_cpu::KernelTable conduit_cpu::avx2_table = conduit_cpu::CONDUIT_ISA::make_table("avx2");
