// CPU emulation of the CUDA built-ins that kernels/*.cu use, so the same source compiles with g++ and
// runs on the CPU (tests/kernels launch it through ctypes).
//
// Execution model: blocks run one after another; the threads of a block run as cooperative fibers on
// one OS thread. A fiber runs until it reaches __syncthreads() or a warp-level operation (shuffle, vote,
// __syncwarp), where it parks. A block barrier releases once every live thread of the block waits at the
// same __syncthreads call site; a warp operation releases once every lane named in its mask waits with
// the same mask, and then every lane's result is computed from the values all lanes supplied. Between
// barriers fibers never interleave, so a missing barrier shows up as a read of a value not yet written.
// To make such reads visible, shared memory (dynamic, and static __shared__ variables registered by the
// harness) is filled with 0xFF bytes (NaN / -1) before every block, and the order in which runnable fibers
// are resumed can be forward, reverse or shuffled: race-free kernels give bit-identical results in all
// three orders. Errors (barrier divergence, deadlock, a barrier after some threads exited) abort the
// launch and are reported through conduit_emu_last_error().
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#define CONDUIT_EMULATION 1

// ---- qualifiers --------------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// Static shared variables are function-local statics: every fiber of the block sees the same storage.
// The harness finds them in the library's symbol table and poisons them before each block.
#define __shared__ static
#define __restrict__ __restrict

// ---- vector and index types --------------------------------------------------------------------------
struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) float2 {
  float x, y;
};
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }

constexpr int warpSize = 32;

// ---- half and bfloat16 -------------------------------------------------------------------------------
struct __half {
  uint16_t bits;
};
struct __nv_bfloat16 {
  uint16_t bits;
};
typedef __half half;

inline uint32_t emu_float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float emu_bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline __half __float2half_rn(float f) {
  // IEEE binary16 with round-to-nearest-even, subnormals, overflow to infinity and NaN kept quiet.
  uint32_t x = emu_float_bits(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t mag = x & 0x7fffffffu;
  uint16_t out;
  if (mag >= 0x7f800000u) {
    out = static_cast<uint16_t>(sign | (mag > 0x7f800000u ? 0x7e00u : 0x7c00u));
  } else if (mag >= 0x477ff000u) {  // rounds to >= 65520: infinity
    out = static_cast<uint16_t>(sign | 0x7c00u);
  } else if (mag < 0x38800000u) {  // below the smallest normal half: subnormal or zero
    if (mag < 0x33000000u) {  // below half of the smallest subnormal: rounds to zero
      out = static_cast<uint16_t>(sign);
    } else {
      uint32_t exp = mag >> 23;
      uint32_t mant = (mag & 0x7fffffu) | 0x800000u;
      uint32_t shift = 126 - exp;  // 14 + (112 - exp) + ... : aligns to the 2^-24 grid
      uint32_t result = mant >> shift;
      uint32_t rem = mant & ((1u << shift) - 1);
      uint32_t halfway = 1u << (shift - 1);
      if (rem > halfway || (rem == halfway && (result & 1u))) result += 1;
      out = static_cast<uint16_t>(sign | result);
    }
  } else {
    uint32_t result = ((mag >> 13) - (112u << 10));
    uint32_t rem = mag & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (result & 1u))) result += 1;
    out = static_cast<uint16_t>(sign | result);
  }
  return __half{out};
}
inline __half __float2half(float f) { return __float2half_rn(f); }

inline float __half2float(__half h) {
  uint32_t sign = (static_cast<uint32_t>(h.bits) & 0x8000u) << 16;
  uint32_t exp = (h.bits >> 10) & 0x1fu;
  uint32_t mant = h.bits & 0x3ffu;
  if (exp == 0) {
    float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  }
  if (exp == 31) return emu_bits_float(sign | 0x7f800000u | (mant << 13));
  return emu_bits_float(sign | ((exp + 112) << 23) | (mant << 13));
}

inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t x = emu_float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{static_cast<uint16_t>((x >> 16) | 0x40u)};
  uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);
  return __nv_bfloat16{static_cast<uint16_t>((x + rounding) >> 16)};
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline float __bfloat162float(__nv_bfloat16 b) { return emu_bits_float(static_cast<uint32_t>(b.bits) << 16); }

// ---- math intrinsics ---------------------------------------------------------------------------------
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __saturatef(float x) { return std::min(1.0f, std::max(0.0f, x)); }
inline int __float_as_int(float f) { return static_cast<int>(emu_float_bits(f)); }
inline unsigned __float_as_uint(float f) { return emu_float_bits(f); }
inline float __int_as_float(int i) { return emu_bits_float(static_cast<uint32_t>(i)); }
inline float __uint_as_float(unsigned u) { return emu_bits_float(u); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
template <typename T>
inline T __ldg(const T* p) {
  return *p;
}

// ---- the fiber scheduler -----------------------------------------------------------------------------
namespace emu {

enum class State { Runnable, BlockBarrier, WarpOp, Done };
enum class WarpKind { ShflIdx, ShflUp, ShflDown, ShflXor, All, Any, Ballot, Sync, Mma };
enum Schedule { kForward = 0, kReverse = 1, kShuffled = 2 };

struct Fiber {
  void* sp = nullptr;  // saved stack pointer (x86-64 switch) while parked
#if !defined(__x86_64__)
  ucontext_t ctx;
#endif
  char* stack = nullptr;
  uint3 idx{0, 0, 0};
  unsigned linear = 0;
  State state = State::Done;
  const char* site_file = nullptr;
  int site_line = 0;
  // warp operation in flight: request, then the scheduler fills in the result
  WarpKind kind = WarpKind::Sync;
  unsigned mask = 0;
  uint64_t value = 0;
  int arg = 0;
  int width = 32;
  uint64_t result = 0;
};

struct Runtime {
  std::vector<Fiber> fibers;
  Fiber* current = nullptr;
  void* scheduler_sp = nullptr;
#if !defined(__x86_64__)
  ucontext_t scheduler_ctx;
#endif
  void (*body)(void*) = nullptr;
  void* body_arg = nullptr;
  bool aborted = false;
  std::string error;
  std::vector<unsigned char> dynamic_smem;
  std::vector<std::pair<void*, size_t>> static_smem;
  uint3 block_idx{0, 0, 0};
  dim3 block_dim{1, 1, 1};
  dim3 grid_dim{1, 1, 1};
  uint64_t switches = 0;
};

inline Runtime g_runtime;  // a namespace-scope variable, so the harness never mistakes it for __shared__
inline Runtime& rt() { return g_runtime; }

constexpr size_t kStackBytes = 256 * 1024;

#if defined(__x86_64__)
// Saves the callee-saved registers and the FP control words on the current stack, stores the stack
// pointer in *save, then resumes the stack at `load`. Much cheaper than swapcontext (no signal mask).
extern "C" void conduit_emu_switch(void** save, void* load);
asm(R"(
.text
.globl conduit_emu_switch
.type conduit_emu_switch,@function
conduit_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size conduit_emu_switch,.-conduit_emu_switch
)");
#endif

[[noreturn]] inline void fiber_main();

inline void fiber_entry_c() { fiber_main(); }

inline void prepare_fiber(Fiber& f) {
  if (f.stack == nullptr) {
    // A guard page below each stack turns an overflow into a crash rather than silent corruption.
    size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    void* mem = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) {
      std::fprintf(stderr, "cuda_emu: cannot map a fiber stack\n");
      std::abort();
    }
    mprotect(mem, page, PROT_NONE);
    f.stack = static_cast<char*>(mem) + page;
  }
#if defined(__x86_64__)
  // Initial frame popped by conduit_emu_switch: FP control words, six registers, then the return
  // address (fiber_entry_c). After `ret`, rsp % 16 == 8 as at the entry of any called function.
  uintptr_t top = (reinterpret_cast<uintptr_t>(f.stack) + kStackBytes) & ~static_cast<uintptr_t>(15);
  uint64_t* sp = reinterpret_cast<uint64_t*>(top - 72);
  uint32_t control[2] = {0x1f80u, 0x037fu};
  std::memcpy(&sp[0], control, 8);
  for (int i = 1; i <= 6; ++i) sp[i] = 0;
  sp[7] = reinterpret_cast<uint64_t>(&fiber_entry_c);
  sp[8] = 0;
  f.sp = sp;
#else
  getcontext(&f.ctx);
  f.ctx.uc_stack.ss_sp = f.stack;
  f.ctx.uc_stack.ss_size = kStackBytes;
  f.ctx.uc_link = nullptr;
  makecontext(&f.ctx, &fiber_entry_c, 0);
#endif
}

inline void switch_to_fiber(Fiber& f) {
  Runtime& r = rt();
  r.current = &f;
  ++r.switches;
#if defined(__x86_64__)
  conduit_emu_switch(&r.scheduler_sp, f.sp);
#else
  swapcontext(&r.scheduler_ctx, &f.ctx);
#endif
  r.current = nullptr;
}

inline void yield_to_scheduler() {
  Runtime& r = rt();
  Fiber& f = *r.current;
#if defined(__x86_64__)
  conduit_emu_switch(&f.sp, r.scheduler_sp);
#else
  swapcontext(&f.ctx, &r.scheduler_ctx);
#endif
}

[[noreturn]] inline void fiber_main() {
  Runtime& r = rt();
  r.body(r.body_arg);
  r.current->state = State::Done;
  yield_to_scheduler();
  std::abort();  // a finished fiber is never resumed
}

// Abort the launch from inside a fiber: record the message and never come back.
[[noreturn]] inline void fail(const std::string& message) {
  Runtime& r = rt();
  if (!r.aborted) {
    r.aborted = true;
    r.error = message;
  }
  yield_to_scheduler();
  std::abort();
}

inline Fiber& self() { return *rt().current; }

inline void block_barrier(const char* file, int line) {
  Fiber& f = self();
  f.state = State::BlockBarrier;
  f.site_file = file;
  f.site_line = line;
  yield_to_scheduler();
}

inline uint64_t warp_op(WarpKind kind, unsigned mask, uint64_t value, int arg, int width) {
  Fiber& f = self();
  unsigned lane = f.linear % 32;
  if (!(mask & (1u << lane))) fail("warp operation by lane " + std::to_string(lane) + " not in its own mask");
  if (width <= 0 || width > 32 || (width & (width - 1)) != 0) fail("warp shuffle width must be a power of two <= 32");
  f.state = State::WarpOp;
  f.kind = kind;
  f.mask = mask;
  f.value = value;
  f.arg = arg;
  f.width = width;
  yield_to_scheduler();
  return f.result;
}

// ---- tensor-core MMA --------------------------------------------------------------------------------
// One lane's operands of mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: D[16x8] = A[16x16] B[16x8] + C
// with C and D in `d`. The fragment layout is PTX's (ISA "Matrix Fragments for mma.m16n8k16"), with
// g = lane / 4 and t = lane % 4, each 32-bit register holding two elements, the lower index in the low half:
//   A: a[0] = row g, cols 2t..2t+1; a[1] = row g + 8, cols 2t..; a[2] = row g, cols 2t + 8..; a[3] = row g + 8,
//      cols 2t + 8..   B (k x n, col-major): b[0] = k 2t..2t+1, col g; b[1] = k 2t + 8.., col g
//   C/D: d[0..1] = row g, cols 2t, 2t + 1; d[2..3] = row g + 8, cols 2t, 2t + 1.
// Products of two 16-bit floats are exact in float32; the sum runs over k in order, in float32.
struct MmaLane {
  const uint32_t* a;
  const uint32_t* b;
  float* d;
  bool bf16;
  int32_t* di = nullptr;  // mma.m16n8k32 s8 (int32 accumulator) instead of d
};

// m16n8k32 s8: A 16x32 and B 32x8 of int8, four per register (lowest index in the low byte), g and t as
// above: a[0] = row g, cols 4t..4t+3; a[1] = row g + 8; a[2] = row g, cols 4t + 16..; a[3] = row g + 8,
// cols 4t + 16..; b[0] = k 4t..4t+3, col g; b[1] = k 4t + 16.., col g; D as m16n8k16's. int32 sums wrap.
inline int32_t mma_byte(uint32_t reg, int index) { return static_cast<int8_t>((reg >> (8 * index)) & 0xffu); }

inline void resolve_mma_s8(const MmaLane* lanes) {
  int32_t out[32][4];
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, t = l % 4;
    for (int i = 0; i < 4; ++i) {
      const int row = g + (i >= 2 ? 8 : 0);
      const int col = 2 * t + (i & 1);
      uint32_t acc = static_cast<uint32_t>(lanes[l].di[i]);
      for (int k = 0; k < 32; ++k) {
        const MmaLane& a = lanes[4 * (row % 8) + (k % 16) / 4];
        const MmaLane& b = lanes[4 * col + (k % 16) / 4];
        const int32_t x = mma_byte(a.a[(row >= 8 ? 1 : 0) + (k >= 16 ? 2 : 0)], k % 4);
        const int32_t y = mma_byte(b.b[k >= 16 ? 1 : 0], k % 4);
        acc += static_cast<uint32_t>(x * y);
      }
      out[l][i] = static_cast<int32_t>(acc);
    }
  }
  for (int l = 0; l < 32; ++l)
    for (int i = 0; i < 4; ++i) lanes[l].di[i] = out[l][i];
}

inline float mma_element(uint32_t reg, int half, bool bf16) {
  const uint32_t bits = half ? reg >> 16 : reg & 0xffffu;
  if (bf16) {
    const uint32_t f = bits << 16;
    float v;
    std::memcpy(&v, &f, sizeof v);
    return v;
  }
  return ::__half2float(::__half{static_cast<uint16_t>(bits)});
}

inline void resolve_mma(Fiber* fibers, size_t base) {
  MmaLane lanes[32];
  for (int l = 0; l < 32; ++l) lanes[l] = *reinterpret_cast<const MmaLane*>(fibers[base + l].value);
  for (int l = 0; l < 32; ++l) {
    if ((lanes[l].di == nullptr) != (lanes[0].di == nullptr)) {
      rt().aborted = true;
      rt().error = "lanes of one warp reached mma.sync with different shapes (m16n8k16 and m16n8k32 s8)";
      return;
    }
  }
  if (lanes[0].di != nullptr) return resolve_mma_s8(lanes);
  float out[32][4];
  for (int l = 0; l < 32; ++l) {
    if (lanes[l].bf16 != lanes[0].bf16) {
      rt().aborted = true;
      rt().error = "lanes of one warp reached mma.sync with different element types";
      return;
    }
    const int g = l / 4, t = l % 4;
    for (int i = 0; i < 4; ++i) {
      const int row = g + (i >= 2 ? 8 : 0);
      const int col = 2 * t + (i & 1);
      float acc = lanes[l].d[i];
      for (int k = 0; k < 16; ++k) {
        const MmaLane& a = lanes[4 * (row % 8) + (k % 8) / 2];
        const MmaLane& b = lanes[4 * col + (k % 8) / 2];
        const float x = mma_element(a.a[(row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)], k % 2, lanes[0].bf16);
        const float y = mma_element(b.b[k >= 8 ? 1 : 0], k % 2, lanes[0].bf16);
        acc += x * y;
      }
      out[l][i] = acc;
    }
  }
  for (int l = 0; l < 32; ++l)
    for (int i = 0; i < 4; ++i) lanes[l].d[i] = out[l][i];
}

// All lanes of warp `w` named in `mask` wait with that mask: compute each one's result and release.
inline void resolve_warp(Fiber* fibers, size_t base, size_t count, unsigned mask) {
  Fiber& first = fibers[base + static_cast<size_t>(__builtin_ctz(mask))];
  if (first.kind == WarpKind::Mma) {
    // mma.sync.aligned: all 32 lanes of a full warp execute the same instruction.
    bool same = count == 32 && mask == 0xffffffffu;
    for (size_t l = 0; l < count && same; ++l) same = fibers[base + l].kind == WarpKind::Mma;
    if (!same) {
      rt().aborted = true;
      rt().error = "mma.sync needs all 32 lanes of a full warp at the same instruction";
      return;
    }
    resolve_mma(fibers, base);
    for (size_t l = 0; l < count; ++l) fibers[base + l].state = State::Runnable;
    return;
  }
  uint64_t ballot = 0;
  for (size_t l = 0; l < count; ++l)
    if ((mask >> l) & 1u) ballot |= static_cast<uint64_t>(fibers[base + l].value != 0) << l;
  for (size_t l = 0; l < count; ++l) {
    if (!((mask >> l) & 1u)) continue;
    Fiber& f = fibers[base + l];
    if (f.kind != first.kind) {
      rt().aborted = true;
      rt().error = "lanes of one warp reached different warp operations together";
      return;
    }
    int lane = static_cast<int>(l);
    int w = f.width;
    int seg = lane & ~(w - 1);
    int src = lane;
    switch (f.kind) {
      case WarpKind::ShflIdx: src = seg + (f.arg & (w - 1)); break;
      case WarpKind::ShflUp: src = (lane - f.arg >= seg) ? lane - f.arg : lane; break;
      case WarpKind::ShflDown: src = (lane + f.arg < seg + w) ? lane + f.arg : lane; break;
      case WarpKind::ShflXor: src = ((lane ^ f.arg) < seg + w) ? (lane ^ f.arg) : lane; break;
      default: break;
    }
    switch (f.kind) {
      case WarpKind::ShflIdx:
      case WarpKind::ShflUp:
      case WarpKind::ShflDown:
      case WarpKind::ShflXor:
        // Reading a lane outside the mask is undefined on the GPU: hand back a poison pattern.
        f.result = (src < static_cast<int>(count) && ((mask >> src) & 1u)) ? fibers[base + src].value
                                                                            : 0xffffffffffffffffull;
        break;
      case WarpKind::All: f.result = ballot == mask; break;
      case WarpKind::Any: f.result = ballot != 0; break;
      case WarpKind::Ballot: f.result = ballot; break;
      case WarpKind::Sync:
      case WarpKind::Mma: f.result = 0; break;
    }
  }
  for (size_t l = 0; l < count; ++l)
    if ((mask >> l) & 1u) fibers[base + l].state = State::Runnable;
}

// Release every warp group whose lanes all wait; returns whether anything was released.
inline bool release_warps(Fiber* fibers, size_t n) {
  bool released = false;
  for (size_t base = 0; base < n; base += 32) {
    size_t count = std::min<size_t>(32, n - base);
    for (size_t l = 0; l < count; ++l) {
      Fiber& f = fibers[base + l];
      if (f.state != State::WarpOp) continue;
      unsigned mask = f.mask;
      if (count < 32 && (mask >> count) != 0) {
        rt().aborted = true;
        rt().error = "warp operation mask names lanes beyond the block's last thread";
        return false;
      }
      bool ready = true;
      for (size_t m = 0; m < count && ready; ++m)
        if ((mask >> m) & 1u) ready = fibers[base + m].state == State::WarpOp && fibers[base + m].mask == mask;
      if (ready) {
        resolve_warp(fibers, base, count, mask);
        if (rt().aborted) return false;
        released = true;
      }
    }
  }
  return released;
}

inline bool release_block_barrier(Fiber* fibers, size_t n) {
  const Fiber* first = nullptr;
  size_t done = 0;
  for (size_t i = 0; i < n; ++i) {
    const Fiber& f = fibers[i];
    if (f.state == State::Done) {
      ++done;
      continue;
    }
    if (f.state != State::BlockBarrier) return false;
    if (first == nullptr) first = &f;
  }
  if (first == nullptr) return false;
  for (size_t i = 0; i < n; ++i) {
    const Fiber& f = fibers[i];
    if (f.state == State::BlockBarrier && (f.site_line != first->site_line || f.site_file != first->site_file)) {
      rt().aborted = true;
      rt().error = "divergent __syncthreads: threads wait at " + std::string(first->site_file) + ":" +
                   std::to_string(first->site_line) + " and " + f.site_file + ":" + std::to_string(f.site_line);
      return false;
    }
  }
  if (done > 0) {
    rt().aborted = true;
    rt().error = "__syncthreads at " + std::string(first->site_file) + ":" + std::to_string(first->site_line) +
                 " reached after " + std::to_string(done) + " threads of the block exited";
    return false;
  }
  for (size_t i = 0; i < n; ++i)
    if (fibers[i].state == State::BlockBarrier) fibers[i].state = State::Runnable;
  return true;
}

// Run one block to completion. Returns false (with rt().error set) when the launch must stop.
inline bool run_block(size_t n, Schedule schedule, std::mt19937_64& rng) {
  Runtime& r = rt();
  Fiber* fibers = r.fibers.data();
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = (schedule == kReverse) ? n - 1 - i : i;
  for (;;) {
    if (schedule == kShuffled) std::shuffle(order.begin(), order.end(), rng);
    bool ran = false;
    for (size_t i : order) {
      Fiber& f = fibers[i];
      if (f.state != State::Runnable) continue;
      switch_to_fiber(f);
      ran = true;
      if (r.aborted) return false;
    }
    bool all_done = std::all_of(fibers, fibers + n, [](const Fiber& f) { return f.state == State::Done; });
    if (all_done) return true;
    bool released = release_warps(fibers, n);
    if (r.aborted) return false;
    if (!released) released = release_block_barrier(fibers, n);
    if (r.aborted) return false;
    if (!ran && !released) {
      size_t at_block = 0, at_warp = 0, done = 0;
      for (size_t i = 0; i < n; ++i) {
        const Fiber& f = fibers[i];
        at_block += f.state == State::BlockBarrier;
        at_warp += f.state == State::WarpOp;
        done += f.state == State::Done;
      }
      r.aborted = true;
      r.error = "deadlock: " + std::to_string(at_block) + " threads at __syncthreads, " + std::to_string(at_warp) +
                " at warp operations, " + std::to_string(done) + " exited";
      return false;
    }
  }
}

struct LaunchConfig {
  unsigned grid[3];
  unsigned block[3];
  uint64_t shared_mem_bytes;
  int schedule;
  uint64_t seed;
};

inline unsigned char* dynamic_shared() {
  return reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(rt().dynamic_smem.data()) + 15) & ~uintptr_t(15));
}

// Bytes after the dynamic shared memory that must survive every block: a kernel whose wrapper asked for
// too little shared memory writes into them and the launch fails instead of corrupting the heap.
constexpr size_t kSmemGuard = 4096;
constexpr unsigned char kGuardByte = 0xa5;

inline void poison_shared(size_t dynamic_bytes) {
  Runtime& r = rt();
  std::memset(r.dynamic_smem.data(), 0xff, r.dynamic_smem.size());
  std::memset(dynamic_shared() + dynamic_bytes, kGuardByte, kSmemGuard);
  for (auto& region : r.static_smem) std::memset(region.first, 0xff, region.second);
}

inline bool shared_guard_intact(size_t dynamic_bytes) {
  const unsigned char* guard = dynamic_shared() + dynamic_bytes;
  for (size_t i = 0; i < kSmemGuard; ++i)
    if (guard[i] != kGuardByte) return false;
  return true;
}

// Launch `kernel` with parameters read from `args` exactly like cuLaunchKernel: args[i] points at the
// value of parameter i. Returns 0 on success, -1 with conduit_emu_last_error() set otherwise.
template <typename... P, size_t... I>
void call_kernel(void (*kernel)(P...), void** args, std::index_sequence<I...>) {
  kernel(*static_cast<std::remove_cv_t<std::remove_reference_t<P>>*>(args[I])...);
}

template <typename... P>
int launch(void (*kernel)(P...), const LaunchConfig* cfg, void** args) {
  Runtime& r = rt();
  r.aborted = false;
  r.error.clear();
  unsigned threads = cfg->block[0] * cfg->block[1] * cfg->block[2];
  if (threads == 0 || threads > 1024) {
    r.error = "block of " + std::to_string(threads) + " threads: must be 1..1024";
    return -1;
  }
  if (cfg->shared_mem_bytes > 227 * 1024) {
    r.error = "dynamic shared memory of " + std::to_string(cfg->shared_mem_bytes) + " bytes exceeds 227 KiB";
    return -1;
  }
  // 16 bytes of slack for the 16-byte alignment of dynamic_shared(), then the guard.
  r.dynamic_smem.assign(cfg->shared_mem_bytes + 16 + kSmemGuard, 0xff);
  r.block_dim = dim3(cfg->block[0], cfg->block[1], cfg->block[2]);
  r.grid_dim = dim3(cfg->grid[0], cfg->grid[1], cfg->grid[2]);
  // The pool only grows, so fiber stacks are mapped once and reused by every later launch.
  if (r.fibers.size() < threads) r.fibers.resize(threads);
  struct Closure {
    void (*kernel)(P...);
    void** args;
  } closure{kernel, args};
  r.body = [](void* p) {
    auto* c = static_cast<Closure*>(p);
    call_kernel(c->kernel, c->args, std::index_sequence_for<P...>{});
  };
  r.body_arg = &closure;
  std::mt19937_64 rng(cfg->seed);
  Schedule schedule = static_cast<Schedule>(cfg->schedule);
  for (unsigned bz = 0; bz < cfg->grid[2]; ++bz)
    for (unsigned by = 0; by < cfg->grid[1]; ++by)
      for (unsigned bx = 0; bx < cfg->grid[0]; ++bx) {
        r.block_idx = uint3{bx, by, bz};
        poison_shared(cfg->shared_mem_bytes);
        for (unsigned t = 0; t < threads; ++t) {
          Fiber& f = r.fibers[t];
          f.linear = t;
          f.idx = uint3{t % cfg->block[0], (t / cfg->block[0]) % cfg->block[1], t / (cfg->block[0] * cfg->block[1])};
          f.state = State::Runnable;
          prepare_fiber(f);
        }
        if (!run_block(threads, schedule, rng)) return -1;
        if (!shared_guard_intact(cfg->shared_mem_bytes)) {
          r.error = "a thread wrote past the " + std::to_string(cfg->shared_mem_bytes) +
                    " bytes of dynamic shared memory given at launch";
          return -1;
        }
      }
  return 0;
}


template <typename T>
inline uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8, "warp operations move at most 8 bytes");
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <typename T>
inline T from_bits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}

}  // namespace emu

// ---- CUDA built-in variables and functions -----------------------------------------------------------
#define threadIdx (::emu::rt().current->idx)
#define blockIdx (::emu::rt().block_idx)
#define blockDim (::emu::rt().block_dim)
#define gridDim (::emu::rt().grid_dim)

#define __syncthreads() ::emu::block_barrier(__FILE__, __LINE__)
inline void __syncwarp(unsigned mask = 0xffffffffu) { emu::warp_op(emu::WarpKind::Sync, mask, 0, 0, 32); }
inline void __threadfence() {}
inline void __threadfence_block() {}

template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  return emu::from_bits<T>(emu::warp_op(emu::WarpKind::ShflIdx, mask, emu::to_bits(v), src, width));
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return emu::from_bits<T>(emu::warp_op(emu::WarpKind::ShflUp, mask, emu::to_bits(v), static_cast<int>(delta), width));
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return emu::from_bits<T>(
      emu::warp_op(emu::WarpKind::ShflDown, mask, emu::to_bits(v), static_cast<int>(delta), width));
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  return emu::from_bits<T>(emu::warp_op(emu::WarpKind::ShflXor, mask, emu::to_bits(v), lane_mask, width));
}
inline int __all_sync(unsigned mask, int p) {
  return static_cast<int>(emu::warp_op(emu::WarpKind::All, mask, p != 0, 0, 32));
}
inline int __any_sync(unsigned mask, int p) {
  return static_cast<int>(emu::warp_op(emu::WarpKind::Any, mask, p != 0, 0, 32));
}
inline unsigned __ballot_sync(unsigned mask, int p) {
  return static_cast<unsigned>(emu::warp_op(emu::WarpKind::Ballot, mask, p != 0, 0, 32));
}

// The tensor-core MMA (kernels/mma.cuh calls it in place of the PTX instruction): see emu::MmaLane.
inline void conduit_emu_mma_m16n8k16(float* d, const uint32_t* a, const uint32_t* b, bool bf16) {
  emu::MmaLane lane{a, b, d, bf16};
  emu::warp_op(emu::WarpKind::Mma, 0xffffffffu, reinterpret_cast<uint64_t>(&lane), 0, 32);
}

inline void conduit_emu_mma_m16n8k32_s8(int* d, const uint32_t* a, const uint32_t* b) {
  emu::MmaLane lane{a, b, nullptr, false, d};
  emu::warp_op(emu::WarpKind::Mma, 0xffffffffu, reinterpret_cast<uint64_t>(&lane), 0, 32);
}

// Round-to-nearest float arithmetic as separate operations (the host compiler must not contract them).
inline float __fmul_rn(float a, float b) {
  volatile float r = a * b;
  return r;
}
inline float __fadd_rn(float a, float b) {
  volatile float r = a + b;
  return r;
}

// Fibers never run concurrently, so a plain read-modify-write is atomic.
template <typename T>
inline T atomicAdd(T* p, T v) {
  T old = *p;
  *p = old + v;
  return old;
}
template <typename T>
inline T atomicMax(T* p, T v) {
  T old = *p;
  *p = std::max(old, v);
  return old;
}
template <typename T>
inline T atomicMin(T* p, T v) {
  T old = *p;
  *p = std::min(old, v);
  return old;
}
template <typename T>
inline T atomicExch(T* p, T v) {
  T old = *p;
  *p = v;
  return old;
}
template <typename T>
inline T atomicCAS(T* p, T compare, T v) {
  T old = *p;
  if (old == compare) *p = v;
  return old;
}

// ---- exports used by the Python harness --------------------------------------------------------------
// The harness compiles exactly one translation unit, so these are defined here, not inline.
#define CONDUIT_EMU_API extern "C" __attribute__((visibility("default"), used))
CONDUIT_EMU_API const char* conduit_emu_last_error() { return emu::rt().error.c_str(); }
CONDUIT_EMU_API unsigned long long conduit_emu_switch_count() { return emu::rt().switches; }
CONDUIT_EMU_API void conduit_emu_set_static_shared(void* const* addresses, const unsigned long long* sizes, int count) {
  auto& regions = emu::rt().static_smem;
  regions.clear();
  for (int i = 0; i < count; ++i) regions.emplace_back(addresses[i], static_cast<size_t>(sizes[i]));
}

namespace emu {
// Parameter kinds for the harness's argument check: p<pointee bytes>, i<bytes>, f<bytes>.
template <typename P>
std::string param_code() {
  using T = std::remove_cv_t<P>;
  if constexpr (std::is_pointer_v<T>) {
    return "p" + std::to_string(sizeof(std::remove_pointer_t<T>));
  } else if constexpr (std::is_floating_point_v<T>) {
    return "f" + std::to_string(sizeof(T));
  } else {
    return "i" + std::to_string(sizeof(T));
  }
}
template <typename... P>
std::string signature(void (*)(P...)) {
  std::string s;
  ((s += param_code<P>() + ","), ...);
  if (!s.empty()) s.pop_back();
  return s;
}
}  // namespace emu

// One exported launcher per kernel specialisation, generated by the harness:
//   CONDUIT_EMU_EXPORT(conduit_k3, (rms_norm_kernel<__half>))
// symbol(cfg, args) launches; symbol_signature(buf, n) writes the parameter kinds ("p4,i4,f4,...").
#define CONDUIT_EMU_EXPORT(symbol, kernel_expr)                                                  \
  CONDUIT_EMU_API int symbol(const ::emu::LaunchConfig* cfg, void** args) {                      \
    return ::emu::launch(&kernel_expr, cfg, args);                                               \
  }                                                                                              \
  CONDUIT_EMU_API int symbol##_signature(char* buf, int size) {                                  \
    return std::snprintf(buf, static_cast<size_t>(size), "%s", ::emu::signature(&kernel_expr).c_str()); \
  }

// CUDA's device-side integer and float min/max overloads.
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
