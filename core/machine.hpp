// What this machine can hold, for the caps on sizes a user asks for: how many workers one process
// (`troupe train`) or one node (`troupe launch`) can run. Each cap is derived from the machine's
// limits (open files, processes, memory) and the message says which limit and by how much.
#pragma once

#include <cstdint>
#include <string>

#include "core/config.hpp"
#include "core/error.hpp"

namespace troupe::core {

/// The machine's limits as this process sees them.
struct machine_facts {
  std::uint64_t memory_bytes = 0;   // physical memory
  std::uint64_t open_files = 0;     // RLIMIT_NOFILE, soft (after raise_open_file_limit)
  std::uint64_t processes = 0;      // RLIMIT_NPROC, soft (0 = unlimited)
  int cores = 1;                    // usable_cores()
};

machine_facts this_machine();

/// The cores this process may run on: its CPU affinity mask (`taskset`, a container's cpuset),
/// not every core of the machine; >= 1. Thread pools and the CAF scheduler size themselves by it,
/// so a run pinned to two cores of a larger machine runs two threads per process, not one per
/// core of the machine that then compete for the two.
int usable_cores();

/// Raises this process's soft limit on open files to its hard limit (a job of many workers keeps
/// several files and sockets open per worker), as far as the system allows.
void raise_open_file_limit();

/// Files and sockets one worker keeps open: its message log and tensor log, its transport's
/// sockets or pipes, and a margin.
inline constexpr int files_per_worker = 8;

/// Bytes one CPU worker needs at least: fp32 parameters, gradients and the two AdamW moments of
/// its pipeline stage, plus a fixed allowance for its runtime.
std::uint64_t worker_bytes(const config& c);

/// An error when `workers` workers of `c` cannot run side by side on this machine, in one process
/// (`processes` = false: `troupe train`) or one process each (`troupe launch`). `how` says where
/// the number came from ("data_parallel 2 x pipeline_stage 4 = 8 workers in this process").
status check_local_workers(const config& c, int workers, bool processes, const std::string& how);

}  // namespace troupe::core
