// The engine under validate's progress check, simulate and lower: it runs every rank's list in
// order against costs and records when each instruction starts and ends, until all are done or no
// rank can move.
//
// Two semantics, chosen by the schedule itself:
// - compute-only (no SEND/RECV anywhere): dataflow. A forward waits for the previous chunk's
//   forward of the same micro-batch, a backward for the next chunk's backward (B or I), plus
//   costs.comm when the two chunks live on different ranks; nothing else blocks.
// - with transfers: blocking, in-order point-to-point, the strictest model of NCCL. A SEND and its
//   RECV are a rendezvous: both start when both ranks have reached them and both end costs.comm
//   later; the k-th send from rank a to rank b meets the k-th receive on b from a. Compute never
//   waits on another rank directly, only on its own rank's RECV. A schedule that completes here
//   also completes with buffered sends or separate communication streams.
#pragma once

#include <string>
#include <vector>

#include "schedules/schedule.hpp"

namespace troupe::schedules {

/// An instruction with the times it ran.
struct timed_instruction {
  instruction op;
  double start = 0;
  double end = 0;
};

/// A rank that cannot move, the instruction it is stuck at and what it waits for.
struct stuck_rank {
  int rank = 0;
  int step = 0;           // index of the stuck instruction in the rank's list
  int waits_on = -1;      // the rank that would have to act; == rank when it waits on itself
  std::string reason;     // "waits for 1B0 on rank 1", ...
};

/// What executing a schedule produced.
struct execution {
  std::vector<std::vector<timed_instruction>> timeline;  // per rank, the instructions that ran
  std::vector<stuck_rank> stuck;                         // empty when every list ran to the end
  bool complete() const { return stuck.empty(); }
  /// "deadlock: ..." naming each stuck rank, its instruction and the cycle of waits, if any.
  std::string describe_deadlock() const;
};

/// Runs `s` against `costs`. REQUIRES: every instruction's chunk, micro-batch and peer in range
/// (validate's structural checks); anything else, including deadlock, is reported, not assumed.
execution execute(const schedule& s, const cost_model& costs);

}  // namespace troupe::schedules
