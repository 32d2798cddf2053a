// How the torch-level ops (ops.cpp, lora.cpp) split a call over threads: the calling thread and the
// helpers of one pool (parallel.cpp), sized by ATen's intra-op thread count (torch.set_num_threads).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace conduit_cpu {

// Below this many multiply-adds (or element visits) a call runs on the calling thread alone.
constexpr int64_t kMinParallelWork = 1 << 15;

namespace detail {
using ChunkCall = void (*)(const void* fn, int64_t begin, int64_t end);
// Runs call(fn, b, e) over [0, n) in chunks of `chunk`, taken in turn (an atomic counter) by the calling
// thread and by up to `helpers` pool threads. The caller waits only for chunks a helper has taken, never
// for a helper that has not woken yet: on a busy machine a descheduled helper costs nothing, where an
// OpenMP region would wait at its barrier for every thread of its team. False: the pool is running
// another call (another thread's, or this one's from inside a chunk), and nothing ran.
bool run_on_pool(int64_t n, int64_t chunk, int helpers, ChunkCall call, const void* fn);
}  // namespace detail

// Runs fn(begin, end) over [0, n) in chunks that the threads take in turn, so a thread the OS preempts
// holds back only the chunk it is on. Small calls (n <= grain) run on the calling thread.
template <class F>
void parallel_chunks(int64_t n, int64_t grain_items, const F& fn) {
  if (n <= grain_items) {  // before asking ATen anything: most calls of a small model stop here
    if (n > 0) fn(0, n);
    return;
  }
  const int64_t threads = at::get_num_threads();
  if (threads <= 1 || at::in_parallel_region()) {
    fn(0, n);
    return;
  }
  const int64_t chunk = std::max<int64_t>(grain_items, n / (4 * threads));
  const detail::ChunkCall call = [](const void* f, int64_t b, int64_t e) { (*static_cast<const F*>(f))(b, e); };
  if (!detail::run_on_pool(n, chunk, static_cast<int>(threads - 1), call, &fn)) fn(0, n);
}

// grain (in units of `items`) so that each thread gets at least kMinParallelWork
inline int64_t grain(int64_t /*items*/, int64_t work_per_item) {
  return std::max<int64_t>(1, kMinParallelWork / std::max<int64_t>(1, work_per_item));
}

}  // namespace conduit_cpu
