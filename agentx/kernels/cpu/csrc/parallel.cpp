// The kernels' thread team (parallel.h): one loop at a time, the caller as thread 0, workers
// that spin for AGENTX_SPIN_US after each loop and then sleep.
#include "parallel.h"

#include <ATen/ATen.h>
#include <immintrin.h>
#include <pthread.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace agentx {
namespace detail {
namespace {

using Clock = std::chrono::steady_clock;

thread_local bool tl_in_team = false;

// How long a worker spins for the next loop before it sleeps (agentx/env.py: AGENTX_SPIN_US,
// applied when the library loads).
std::atomic<int64_t> g_spin_us{2000};

class Team {
 public:
  bool run(int threads, TeamFn fn, const void* ctx) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) {
      fallbacks_.fetch_add(1, std::memory_order_relaxed);
      return false;
    }
    while (started_ < threads - 1) {
      try {
        start_worker(started_ + 1);
      } catch (const std::system_error&) {  // no thread to be had: this loop runs on OpenMP
        fallbacks_.fetch_add(1, std::memory_order_relaxed);
        return false;
      }
      ++started_;
    }
    fn_ = fn;
    ctx_ = ctx;
    threads_ = threads;
    error_ = nullptr;
    // every worker answers every loop, a chunk or none: none is still reading this loop's
    // fields when the next loop writes them
    pending_.store(started_);
    gen_.fetch_add(1);  // seq_cst: pairs with a sleeper's sleepers_ increment (Dekker)
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(sleep_mu_);
      sleep_cv_.notify_all();
    }
    std::exception_ptr mine;
    tl_in_team = true;
    try {
      fn(ctx, 0);
    } catch (...) {
      mine = std::current_exception();
    }
    tl_in_team = false;
    while (pending_.load(std::memory_order_acquire) > 0) _mm_pause();
    runs_.fetch_add(1, std::memory_order_relaxed);
    if (mine) std::rethrow_exception(mine);
    if (error_) std::rethrow_exception(error_);
    return true;
  }

  int64_t runs() const { return runs_.load(); }
  int64_t fallbacks() const { return fallbacks_.load(); }
  int64_t workers() const { return started_; }
  int64_t sleeps() const { return sleeps_.load(); }

 private:
  // Started before the loop that needs it bumps gen_: it waits for the loop after `seen`.
  void start_worker(int tid) {
    const uint64_t seen = gen_.load();
    std::thread([this, tid, seen] { work(tid, seen); }).detach();
  }

  void work(int tid, uint64_t seen) {
    tl_in_team = true;
    for (;;) {
      uint64_t g;
      auto spin_start = Clock::now();
      const auto spin = std::chrono::microseconds(g_spin_us.load(std::memory_order_relaxed));
      for (uint32_t i = 1; (g = gen_.load(std::memory_order_acquire)) == seen; ++i) {
        _mm_pause();
        if ((i & 255) != 0) continue;
        // a thread that needs this core (torch's own OpenMP team, the caller's event loop)
        // gets it: the spin only keeps a core that nothing else wants
        std::this_thread::yield();
        if (Clock::now() - spin_start >= spin) {
          std::unique_lock<std::mutex> lock(sleep_mu_);
          sleepers_.fetch_add(1);
          sleeps_.fetch_add(1, std::memory_order_relaxed);
          sleep_cv_.wait(lock, [&] { return gen_.load() != seen; });
          sleepers_.fetch_sub(1);
          spin_start = Clock::now();
        }
      }
      seen = g;
      if (tid < threads_) {  // else this loop needs fewer threads
        try {
          fn_(ctx_, tid);
        } catch (...) {
          std::lock_guard<std::mutex> lock(error_mu_);
          if (!error_) error_ = std::current_exception();
        }
      }
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  std::mutex busy_;  // held by the thread whose loop runs
  int started_ = 0;  // workers (tids 1..started_), only grows; under busy_
  TeamFn fn_ = nullptr;
  const void* ctx_ = nullptr;
  int threads_ = 0;
  std::atomic<uint64_t> gen_{0};  // bumped once per loop, after the fields above are set
  std::atomic<int> pending_{0};   // workers that have not answered this loop yet
  std::atomic<int> sleepers_{0};
  std::mutex sleep_mu_;
  std::condition_variable sleep_cv_;
  std::mutex error_mu_;
  std::exception_ptr error_;
  std::atomic<int64_t> runs_{0}, fallbacks_{0}, sleeps_{0};
};

// Never destroyed: detached workers may still be asleep in it when the process exits.
std::atomic<Team*> g_team{nullptr};
std::once_flag g_atfork;

Team& team() {
  Team* t = g_team.load(std::memory_order_acquire);
  if (t != nullptr) return *t;
  std::call_once(g_atfork, [] {
    // the child has none of the parent's workers: it starts a team of its own on first use
    // (the parent's is leaked there; its locks may be held by threads that do not exist)
    pthread_atfork(nullptr, nullptr, [] { g_team.store(nullptr); });
  });
  Team* fresh = new Team();
  Team* expected = nullptr;
  if (!g_team.compare_exchange_strong(expected, fresh)) {
    delete fresh;
    return *expected;
  }
  return *fresh;
}

}  // namespace

bool team_run(int threads, TeamFn fn, const void* ctx) {
  if (tl_in_team) return false;
  return team().run(threads, fn, ctx);
}

bool in_team_thread() { return tl_in_team; }

void set_spin_us(int64_t us) { g_spin_us.store(us, std::memory_order_relaxed); }

}  // namespace detail

namespace {

// (loops the team ran, loops that fell back to OpenMP because the team was busy, workers,
// times a worker went to sleep)
std::vector<int64_t> team_stats() {
  auto& t = detail::team();
  return {t.runs(), t.fallbacks(), t.workers(), t.sleeps()};
}

// For the tests: out[i] += i * i over [0, out.numel()) in chunks of `grain` (every index once,
// whatever the split; a nested loop runs inline); the chunk holding index `fail_at` raises.
void team_fill(at::Tensor out, int64_t grain, bool nested, int64_t fail_at) {
  TORCH_CHECK(out.dtype() == at::kLong && out.is_contiguous(), "team_fill: int64, contiguous");
  int64_t* o = out.data_ptr<int64_t>();
  const auto fill = [&](int64_t b, int64_t e) {
    TORCH_CHECK(fail_at < b || fail_at >= e, "team_fill: chunk [", b, ", ", e, ") failed");
    for (int64_t i = b; i < e; ++i) o[i] += i * i;
  };
  parallel_for(0, out.numel(), grain, [&](int64_t begin, int64_t end) {
    if (nested) {
      parallel_for(begin, end, 1, fill);
    } else {
      fill(begin, end);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(agentx, lib) {
  lib.def("team_stats() -> int[]", &team_stats);
  lib.def("team_spin_us(int us) -> ()", &detail::set_spin_us);
  lib.def("team_fill(Tensor(a!) out, int grain, bool nested, int fail_at) -> ()");
  lib.impl("team_fill", c10::DispatchKey::CPU, &team_fill);
}

}  // namespace agentx
