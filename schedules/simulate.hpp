// The simulator: runs a schedule against per-kind costs (execute.hpp) and reports what a pipeline
// engineer asks first: how long the step takes, how much of it each rank sits idle, and how many
// micro-batches' activations each rank must hold at once.
#pragma once

#include <vector>

#include "schedules/execute.hpp"
#include "schedules/schedule.hpp"

namespace troupe::schedules {

/// One rank's share of the step.
struct rank_report {
  double compute = 0;        // time in F, B, I, W
  double transfer = 0;       // time in SEND/RECV (blocking transfers of a lowered schedule)
  double other = 0;          // time in REDUCE_GRAD and STEP
  double idle = 0;           // makespan - compute - transfer - other
  double bubble = 0;         // (makespan - compute) / makespan: the share of the step not computing
  int peak_activations = 0;  // most (chunk, micro-batch) activations held at once
};

/// The result of a simulation.
struct simulation {
  double makespan = 0;
  double bubble = 0;  // over all ranks: 1 - total compute / (p * makespan)
  std::vector<rank_report> ranks;
  std::vector<std::vector<timed_instruction>> timeline;  // per rank, in list order
};

/// Runs `s` against `costs`; a schedule that cannot progress is an error naming the stuck ranks,
/// their instructions and the cycle of waits, with the grid marked. Instructions must name chunks,
/// micro-batches and peers that exist (checked).
core::result<simulation> simulate(const schedule& s, const cost_model& costs = {});

/// Peak in-flight activations per rank, from the lists alone: a micro-batch is in flight on a
/// chunk from its F until its B (or its W when the backward is split).
std::vector<int> peak_activations(const schedule& s);

}  // namespace troupe::schedules
