// Threads for the CPU ops: a small pool that the calling thread joins.
//
// The actor runtime calls ops from several threads at once, so a call never waits for the pool:
// the caller runs tasks itself and idle workers help it; with every worker busy the caller simply
// does all of its tasks. An idle worker polls for new work for 200 µs and then sleeps on a
// condition variable: the ops of a training step follow each other faster than a sleeping thread
// wakes, yet a pool with nothing to do does not keep a core of the two-core build machine busy.
//
// Determinism is the caller's contract: each task (or each item of a range) must write outputs no
// other task writes and compute them the same way whatever the split, so results do not depend on
// how many threads ran or which thread ran what.
#pragma once

#include <cstdint>
#include <functional>

namespace troupe::kernels::cpu {

/// Threads CPU ops may use, the caller included (>= 1).
int threads();
/// Sets threads(); n <= 0 means every core this process may run on (core::usable_cores).
void set_threads(int n);

/// Calls fn(i) for every i in [0, tasks) on up to threads() threads, the caller included, and
/// returns when all are done. Rethrows the first exception a task threw.
void parallel_tasks(std::int64_t tasks, const std::function<void(std::int64_t)>& fn);

/// Splits [0, n) into at most threads() contiguous ranges of at least `grain` items and calls
/// fn(begin, end) for each (on the calling thread alone when n < 2 * grain).
void parallel_for(std::int64_t n, std::int64_t grain,
                  const std::function<void(std::int64_t, std::int64_t)>& fn);

}  // namespace troupe::kernels::cpu
