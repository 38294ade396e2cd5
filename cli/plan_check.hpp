// The plan check `troupe train` and `troupe launch` run before anything is allocated on a device:
// the job is planned (plan/plan.hpp) and refused when it cannot fit, with the plan and what to
// change printed. It runs on CUDA devices (their size asked from the driver) and wherever
// --device-memory is given; --no-plan-check skips it.
#pragma once

#include <cstdint>
#include <string>

#include "core/config.hpp"

namespace troupe::cli {

/// Total bytes of `device` (runtime.device); 0 on the CPU or when unknown.
std::uint64_t device_memory_of(const std::string& device);

/// Plans cfg for `troupe train` (every worker on one device) or `troupe launch` (one device per
/// worker, `launch`). Returns 0 to go on; otherwise prints the refusal with the plan to stderr and
/// returns the exit code (3: does not fit; 1: the plan failed, or --device-memory is not a size).
int check_plan(const core::config& cfg, const std::string& device_memory, bool launch);

/// When `error` (a failed run's message, which names rank, stage, step and instruction) says the
/// device ran out of memory, prints to stderr the plan of cfg: the bytes by kind each rank holds at
/// its peak, and the changes that would fit in the device's memory (or in `device_memory`).
void explain_out_of_memory(const core::config& cfg, const std::string& error,
                           const std::string& device_memory, bool launch);

}  // namespace troupe::cli
