// The helper pool behind parallel_chunks (parallel.h).
//
// One call at a time runs on the pool. The caller publishes the call, then hands out `helpers` tickets;
// a helper that wakes takes a ticket (or finds none and sleeps again), then takes chunks until none are
// left. When the caller runs out of chunks it withdraws the tickets nobody took, and waits until the
// helpers that did take one have finished: only they can still be reading the call.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "parallel.h"

namespace conduit_cpu::detail {
namespace {

// How long an idle helper spins before it sleeps: the gaps between the kernel calls of one step are
// microseconds, and a sleeping helper takes tens of microseconds to wake.
constexpr auto kSpin = std::chrono::microseconds(50);

thread_local bool on_pool_thread = false;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

class Pool {
 public:
  bool run(int64_t n, int64_t chunk, int helpers, ChunkCall call, const void* fn) {
    if (on_pool_thread || busy_.exchange(true, std::memory_order_acquire)) return false;
    grow(helpers);
    n_ = n;
    chunk_ = chunk;
    call_ = call;
    fn_ = fn;
    error_ = nullptr;
    next_.store(0, std::memory_order_relaxed);
    finished_.store(0, std::memory_order_relaxed);
    tickets_.store(helpers, std::memory_order_release);  // publishes the call to whoever takes one
    wake_.fetch_add(1, std::memory_order_seq_cst);  // against sleepers_: see helper()
    if (sleepers_.load(std::memory_order_seq_cst) > 0) wake_.notify_all();
    std::exception_ptr mine;
    try {
      work();
    } catch (...) {
      mine = std::current_exception();
    }
    const int joined = helpers - tickets_.exchange(0, std::memory_order_acq_rel);
    while (finished_.load(std::memory_order_acquire) < joined) cpu_relax();
    const std::exception_ptr theirs = error_;
    busy_.store(false, std::memory_order_release);
    if (mine) std::rethrow_exception(mine);
    if (theirs) std::rethrow_exception(theirs);
    return true;
  }

 private:
  void work() {
    for (int64_t b = next_.fetch_add(chunk_, std::memory_order_relaxed); b < n_;
         b = next_.fetch_add(chunk_, std::memory_order_relaxed))
      call_(fn_, b, std::min(b + chunk_, n_));
  }

  void grow(int helpers) {  // under busy_: threads are only ever added, and live as long as the process
    while (static_cast<int>(threads_) < helpers) {
      std::thread([this] { helper(); }).detach();
      ++threads_;
    }
  }

  void helper() {
    on_pool_thread = true;
    uint32_t seen = wake_.load(std::memory_order_acquire);
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + kSpin;
      for (int i = 1; wake_.load(std::memory_order_acquire) == seen; ++i) {
        cpu_relax();
        if (i % 64 == 0 && std::chrono::steady_clock::now() >= until) break;  // the clock costs a call
      }
      if (wake_.load(std::memory_order_acquire) == seen) {
        // counted before waiting, so a caller that bumps wake_ after this either sees a sleeper and
        // notifies, or bumped it before the wait reads it (both sides seq_cst)
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        wake_.wait(seen, std::memory_order_acquire);
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
      }
      seen = wake_.load(std::memory_order_acquire);
      int t = tickets_.load(std::memory_order_relaxed);
      while (t > 0 && !tickets_.compare_exchange_weak(t, t - 1, std::memory_order_acq_rel)) {
      }
      if (t <= 0) continue;  // every ticket taken, or the call is over
      try {
        work();
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_) error_ = std::current_exception();
      }
      finished_.fetch_add(1, std::memory_order_release);
    }
  }

  std::atomic<bool> busy_{false};
  std::atomic<uint32_t> wake_{0};  // bumped once per call; idle helpers wait on it
  std::atomic<int> sleepers_{0};
  std::atomic<int> tickets_{0};
  std::atomic<int> finished_{0};
  std::atomic<int64_t> next_{0};
  int64_t n_ = 0, chunk_ = 1;
  ChunkCall call_ = nullptr;
  const void* fn_ = nullptr;
  std::mutex error_mutex_;
  std::exception_ptr error_;
  int64_t threads_ = 0;
};

}  // namespace

bool run_on_pool(int64_t n, int64_t chunk, int helpers, ChunkCall call, const void* fn) {
  static Pool* pool = new Pool();  // never destroyed: its helpers sleep until the process ends
  return pool->run(n, chunk, helpers, call, fn);
}

}  // namespace conduit_cpu::detail
