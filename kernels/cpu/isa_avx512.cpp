// The CPU kernels for AVX-512 F/BW/VL/DQ without BF16 (Skylake-SP, Ice Lake).
// Layout, grid and limits: see common.h and kernels_impl.h. Standard headers come before the target
// pragma, so only this file's own functions use these instructions (never code shared with other files).
#include "common.h"
#include <immintrin.h>

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
#define CONDUIT_ISA isa_avx512
#define CONDUIT_INT8 2
#define CONDUIT_BF16_DOT 0

namespace conduit_cpu {
namespace CONDUIT_ISA {
#include "vec_math.h"
#include "vec_avx512.h"
}  // namespace CONDUIT_ISA
}  // namespace conduit_cpu

#include "kernels_impl.h"

const conduit_cpu::KernelTable conduit_cpu::avx512_table = conduit_cpu::CONDUIT_ISA::make_table("avx512");
