// Validation: is this schedule something the runtime can execute, and will it finish? The first
// problem found is reported with the step x rank grid and the bad cell marked (">1B3<").
//
// Checked, in this order: instructions name chunks, micro-batches and peers that exist on the
// right ranks; every micro-batch is forwarded and backwarded exactly once per chunk (B, or I and
// W); F comes before B or I, I before W; each chunk's backwards run in micro-batch order; with
// transfers, every cross-rank dependency has exactly one SEND after its producer and one RECV
// before its consumer, and the sends from rank a to rank b meet the receives on b from a in the
// same order; REDUCE_GRAD once per chunk after its last backward, STEP last on every rank; and
// finally the schedule runs to the end without deadlock (execute.hpp's semantics).
#pragma once

#include "schedules/schedule.hpp"

namespace troupe::schedules {

/// What validate requires beyond completeness and safety.
struct validate_options {
  bool require_microbatch_order = true;  // each chunk's B, I and W in micro-batch order 0, 1, ...
  bool check_progress = true;            // run the lists to find deadlocks
};

/// OK, or the first problem with the marked grid in the message.
core::status validate(const schedule& s, const validate_options& options = {});

}  // namespace troupe::schedules
