// The kernels' parallel loop: a persistent team of worker threads that spin for a while after
// each loop before they sleep, so a decode step's ~120 short loops (4 projections a layer, a
// few hundred microseconds each) do not each pay a sleeping thread's wake-up. OpenMP's passive
// wait (agentx's default for torch's own ops, see agentx/env.py) pays it on every loop: on a
// 2-core Zen 4, 28 layers of Qwen2.5-Coder-1.5B's decode GEMVs took 25 ms through
// at::parallel_for and 14 ms through this team. An active OpenMP wait would spin forever.
//
//   agentx::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) { ... });
//
// Same contract as at::parallel_for: [begin, end) is split into at most
// at::get_num_threads() contiguous chunks of at least `grain` (the calling thread takes the
// first), and the call returns when every chunk is done. The kernels' results never depend on
// the split, so the bits are the same at any thread count. A loop started inside another (from
// a team thread) runs inline; one started while another thread's loop holds the team runs on
// OpenMP instead.
//
// A worker spins for AGENTX_SPIN_US microseconds (default 2000; agentx/env.py) waiting for the
// next loop, yielding its core to any thread that wants it, then sleeps on a condition
// variable; 0 sleeps at once. A process forked while the team exists gets a fresh team in the
// child.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace agentx {

namespace detail {
using TeamFn = void (*)(const void* ctx, int tid);
// Runs fn(ctx, tid) for tid in [0, threads) (the caller is tid 0); false when the team is
// busy or the caller is one of its threads (then nothing ran). Rethrows a chunk's exception.
bool team_run(int threads, TeamFn fn, const void* ctx);
bool in_team_thread();
void set_spin_us(int64_t us);
}  // namespace detail

template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  const int64_t range = end - begin;
  grain = std::max<int64_t>(grain, 1);
  const int64_t threads =
      std::min<int64_t>(at::get_num_threads(), (range + grain - 1) / grain);
  if (threads <= 1 || detail::in_team_thread()) {
    f(begin, end);
    return;
  }
  const int64_t chunk = (range + threads - 1) / threads;
  struct Ctx {
    const F* f;
    int64_t begin, end, chunk;
  } ctx{&f, begin, end, chunk};
  const detail::TeamFn call = [](const void* p, int tid) {
    const Ctx& c = *static_cast<const Ctx*>(p);
    const int64_t b = c.begin + tid * c.chunk;
    if (b < c.end) (*c.f)(b, std::min(c.end, b + c.chunk));
  };
  if (!detail::team_run(static_cast<int>(threads), call, &ctx)) {
    at::parallel_for(begin, end, grain, f);
  }
}

}  // namespace agentx
