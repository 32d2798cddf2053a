// How the torch-level ops (ops.cpp, lora.cpp) split a call over ATen's intra-op thread pool.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace conduit_cpu {

// Below this many multiply-adds (or element visits) a call runs on the calling thread alone.
constexpr int64_t kMinParallelWork = 1 << 15;

// Runs fn over [0, n) in chunks that the threads of ATen's pool take in turn (an atomic counter), so a
// thread the OS preempts on a busy machine holds back only the chunk it is on, not a fixed half of the
// range. Small calls (n <= grain) run on the calling thread.
template <class F>
void parallel_chunks(int64_t n, int64_t grain_items, const F& fn) {
  const int64_t threads = at::get_num_threads();
  if (n <= grain_items || threads <= 1 || at::in_parallel_region()) {
    if (n > 0) fn(0, n);
    return;
  }
  const int64_t chunk = std::max<int64_t>(grain_items, n / (4 * threads));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t b = next.fetch_add(chunk); b < n; b = next.fetch_add(chunk)) fn(b, std::min(b + chunk, n));
  });
}

// grain (in units of `items`) so that each thread gets at least kMinParallelWork
inline int64_t grain(int64_t /*items*/, int64_t work_per_item) {
  return std::max<int64_t>(1, kMinParallelWork / std::max<int64_t>(1, work_per_item));
}

}  // namespace conduit_cpu
