// Plain types shared by the actor runtime's engines (testable without CAF) and the CAF protocol
// (actors/protocol.hpp): what a tagged tensor is, who a message is for and what an actor is
// called, trace events, and the control messages themselves. protocol.hpp makes them CAF
// messages (inspect, registration) and adds the atoms.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "transport/transport.hpp"

namespace troupe::actors {

/// What a tagged tensor is (transport::tag::kind).
enum class tensor_kind : std::uint32_t {
  tokens = 1,        // input token ids of a micro-batch (loader -> first stage)
  targets = 2,       // target ids of a micro-batch (loader -> last stage)
  activation = 3,    // input of chunk `chunk` for micro-batch `mb` (stage -> stage)
  gradient = 4,      // gradient of chunk `chunk`'s output for `mb` (stage -> stage)
  tied_grad = 5,     // a tied embedding's gradient, sent by chunk `chunk` to its partner
  grad_slice = 6,    // slice `part` of chunk `chunk`'s accumulated gradients (stage -> shard)
  reduced_grad = 7,  // slice `part` of the replica-summed gradients (shard -> stages, ZeRO-0/1)
  param_slice = 8,   // slice `part` of chunk `chunk`'s updated parameters (shard -> stages)
  snap_params = 9,   // a copy of chunk `chunk`'s flat parameters (stage -> writer / coordinator)
  snap_exp_avg = 10,     // a copy of slice `part` of chunk `chunk`'s first moment (shard -> writer)
  snap_exp_avg_sq = 11,  // the same for the second moment
  documents = 12,    // document starts of a micro-batch of packed rows (loader -> every stage;
                     // `chunk` is the receiving stage's first chunk)
};

/// Kinds of a tensor-parallel group's collective tags start here (actors/tp_group.hpp): kind =
/// tp_kind_base | comm_op << 8 | n (the op's n-th collective), with the top bit set for an
/// all-reduce's gather phase.
inline constexpr std::uint32_t tp_kind_base = 0x10000;
/// Whether a tag's kind is a tensor-parallel collective's.
inline bool is_tp_kind(std::uint32_t kind) { return (kind & 0x7fffffffu) >= tp_kind_base; }

/// Who a message is for.
enum class role : std::uint8_t { stage, shard, loader, coordinator, writer };

struct address {
  role who = role::stage;
  std::int32_t a = 0;  // stage: dp; shard: pp; loader: dp
  std::int32_t b = 0;  // stage: pp; shard: part; loader: pp
  std::int32_t c = 0;  // stage, shard: the tensor-parallel rank
  bool operator==(const address&) const = default;
};

/// The name failure reports and logs use for the actor at `a`: "stage(dp=0, pp=1)",
/// "optimizer_shard(pp=1, part=0)", "data_loader(dp=1)", "checkpoint_writer", "coordinator";
/// with a tensor-parallel rank above 0 "stage(dp=0, pp=1, tp=1)".
inline std::string actor_name(const address& a) {
  const std::string x = std::to_string(a.a), y = std::to_string(a.b);
  const std::string t = a.c ? ", tp=" + std::to_string(a.c) : "";
  switch (a.who) {
    case role::stage: return "stage(dp=" + x + ", pp=" + y + t + ")";
    case role::shard: return "optimizer_shard(pp=" + x + ", part=" + y + t + ")";
    case role::loader: return "data_loader(dp=" + x + ")";
    case role::coordinator: return "coordinator";
    case role::writer: return "checkpoint_writer";
  }
  return "an actor";
}

/// What a traced instruction spent its time on.
enum class event_cat : std::uint8_t { compute = 0, comm = 1, wait = 2 };

/// "compute", "comm", "wait" (the Chrome trace's category names).
inline const char* event_cat_name(event_cat c) {
  return c == event_cat::compute ? "compute" : c == event_cat::comm ? "comm" : "wait";
}

/// One timed instruction of a stage, for the Chrome trace.
struct trace_event {
  std::string name;                   // "1F3", "wait 2RECV_F3<-1", ...
  event_cat cat = event_cat::compute;
  double start_us = 0;                // since the job started
  double dur_us = 0;
};

/// Destinations of a snapshot (a bit mask of these).
inline constexpr std::int32_t to_writer = 1;
inline constexpr std::int32_t to_coordinator = 2;

// --- control messages (protocol.hpp makes them CAF messages) -----------------------------------

/// "The tensor under this tag is on the transport for you, from worker `src`."
struct tensor_ready {
  std::int64_t step = 0;
  std::uint32_t kind = 0;
  std::int32_t chunk = 0;
  std::int32_t mb = 0;
  std::int32_t part = 0;
  std::int32_t src = 0;

  transport::tag tag() const { return {step, kind, chunk, mb, part}; }
};

/// Losses of the last stage of replica `dp` (one per micro-batch, in micro-batch order), sent as
/// soon as its instructions are done, before the optimizer runs.
struct loss_report {
  std::int64_t step = 0;
  std::int32_t dp = 0;
  std::vector<double> mb_loss_sums;
  /// Loss sums per sequence (micro-batch-major), only in a re-execution of the step by step
  /// forensics (model/forensics.hpp): they name the sequences of a deterministic bad step.
  std::vector<double> seq_loss_sums;
};

/// A stage finished step `step` (parameters updated).
struct stage_report {
  std::int64_t step = 0;
  std::int32_t dp = 0;
  std::int32_t pp = 0;
  double busy_s = 0;     // compute instructions
  double comm_s = 0;     // sends, receives, reductions (excluding waits)
  double wait_s = 0;     // blocked on a peer: the bubble
  std::uint64_t peak_activation_bytes = 0;
  std::vector<trace_event> events;
  std::uint64_t peak_device_bytes = 0;  // the stage backend's allocator peak (0 on the CPU)
  std::int32_t tp = 0;                  // the tensor-parallel rank
  /// On a device: compute instructions timed on the stage's stream (stage_timing), and their sum.
  std::vector<trace_event> device_events;
  double device_busy_s = 0;
};

/// The exact sum of the per-block sums of squares of one shard's slice of a chunk's reduced
/// gradient: the words of a core::exact_sum (order-free, so the coordinator merges them in any
/// order and gets the single-rank trainer's norm).
struct norm_part {
  std::int64_t step = 0;
  std::int32_t chunk = 0;
  std::int32_t part = 0;
  std::vector<std::int64_t> sumsq;
  std::string nonfinite;  // when the sum is not finite: whose value first was not (shard_engine)
  std::uint64_t grad_hash = 0;  // message hash of the summed slice, when runtime.forensics is on
};

/// The coordinator's decision for step `step` (model::decide_step): AdamW's gradient factor
/// (clipping, and undoing a dynamic loss scale), learning rate, AdamW's t, and whether the step is
/// skipped (non-finite gradients under dynamic loss scaling: no update on any shard).
struct clip_decision {
  std::int64_t step = 0;
  float scale = 1;
  double lr = 0;
  std::int64_t adam_step = 1;
  bool skip = false;
  float loss_scale = 1;  // the scale the step's losses were multiplied by (logged for replay)
};

/// An optimizer shard finished step `step`.
struct shard_report {
  std::int64_t step = 0;
  std::int32_t pp = 0;
  std::int32_t part = 0;
  std::uint64_t state_bytes = 0;  // master slice + AdamW moments held by this shard
  std::uint64_t peak_device_bytes = 0;  // the shard backend's allocator peak (0 on the CPU)
};

/// An actor failed; the coordinator stops the job with this.
struct actor_failure {
  std::string actor;        // "stage(dp=0, pp=1)"
  std::int32_t rank = -1;   // worker rank
  std::int64_t step = -1;
  std::string instruction;  // text form, "" when not executing one
  std::string what;
};

/// A worker process is alive, and what its stage was doing: sent by every worker's node actor to
/// the coordinator once a second, so that when a process dies the coordinator can say what it
/// was last doing.
struct worker_heartbeat {
  std::int32_t rank = 0;
  std::int32_t pid = 0;
  std::string status;  // the stage's status line ("stage(dp=1, pp=1) (rank 3) step 5 at 1B3: ...")
  /// When the stage is blocked in a tensor-parallel collective and cannot answer, status is the
  /// node actor's account of the wait (job::tp_blocked) and this how long it has waited so far;
  /// else -1.
  std::int64_t blocked_ms = -1;
};

/// The writer finished (or failed) the checkpoint of `step`.
struct checkpoint_written {
  std::int64_t step = 0;
  std::string path;   // the checkpoint directory; empty on failure
  std::string error;  // why it failed
};

}  // namespace troupe::actors
