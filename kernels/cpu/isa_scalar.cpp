// The CPU kernels for no SIMD beyond the compiler's baseline: any CPU.
// Layout, grid and limits: see common.h and kernels_impl.h. Standard headers come before the target
// pragma, so only this file's own functions use these instructions (never code shared with other files).
#include "common.h"


// (no target pragma: the compiler's baseline)
#define CONDUIT_ISA isa_scalar
#define CONDUIT_INT8 0
#define CONDUIT_BF16_DOT 0

namespace conduit_cpu {
namespace CONDUIT_ISA {
#include "vec_math.h"
#include "vec_scalar.h"
}  // namespace CONDUIT_ISA
}  // namespace conduit_cpu

#include "kernels_impl.h"

const conduit_cpu::KernelTable conduit_cpu::scalar_table = conduit_cpu::CONDUIT_ISA::make_table("scalar");
