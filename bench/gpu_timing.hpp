// Kernel timing shared by the GPU micro-benchmarks (gpu_attention_bench, gpu_norm_bench): `reps`
// back-to-back calls queued on the stream and ended by one synchronisation, so launch gaps hide
// behind the queue; the time per call is the best of `rounds` such runs, after `warmup` calls.
#pragma once

#include <algorithm>
#include <chrono>

#include "kernels/backend.hpp"

namespace troupe::bench {

/// Best per-call milliseconds of `f` over `rounds` runs of `reps` calls.
template <class F>
double best_ms_per_call(kernels::backend& be, int warmup, int rounds, int reps, F&& f) {
  for (int i = 0; i < warmup; ++i) f();
  be.synchronize();
  double best = 1e30;
  for (int r = 0; r < rounds; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) f();
    be.synchronize();
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, ms / reps);
  }
  return best;
}

}  // namespace troupe::bench
