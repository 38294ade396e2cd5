// Lowering: the passes that turn a compute-only schedule into what a stage executes. Each pass is
// a pure function with its own test.
//
// insert_transfers places, for every dependency between chunks on different ranks, a SEND on the
// producer's rank after the producing instruction and a RECV on the consumer's rank before the
// consuming one. Where exactly: the schedule is simulated, each transfer gets the latest time
// between producer end and consumer start at which neither rank is mid-instruction (preferring
// times before the sender's next instruction, so the send follows its producer directly), and
// every rank's list is then sorted by time, with one global tie order for transfers. Because
// every rank sees all transfers in one global order, the result cannot deadlock under blocking,
// in-order point-to-point (NCCL). When a transfer finds a moment with both ranks between
// instructions (always for gpipe, 1f1b and zb_h1; for interleaved_1f1b when F = B) the lowered
// schedule runs, with costs.comm = 0, exactly as fast as the compute-only one; otherwise blocking
// transfers make one rank wait briefly and the moment that delays least is taken. For split
// backwards (zb_h1) the gradient sent upstream comes from I; W only accumulates weight gradients.
//
// insert_reduction adds REDUCE_GRAD once per chunk, right after its last B or W (and after the
// SEND_B that carries that backward's input gradient, so the upstream rank is not kept waiting),
// and STEP at the end of every rank.
#pragma once

#include "schedules/schedule.hpp"

namespace troupe::schedules {

/// Adds SEND_F/RECV_F/SEND_B/RECV_B with peers. REQUIRES: `compute_only` has no transfers and
/// passes validate (throws core::failure otherwise). `costs` only steer placement.
schedule insert_transfers(const schedule& compute_only, const cost_model& costs = {});

/// Adds REDUCE_GRAD per chunk and STEP per rank, each only when the schedule has none yet.
schedule insert_reduction(const schedule& s);

/// Both passes: insert_transfers (skipped when `s` already carries transfers, as a hand-written
/// lowered file does), then insert_reduction.
schedule lower(const schedule& s, const cost_model& costs = {});

}  // namespace troupe::schedules
