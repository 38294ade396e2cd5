// Every message type of the actor runtime (house rule 4: one protocol header). Control messages
// are small and serialisable; tensor bytes travel on the transport (transport/transport.hpp) under
// a tag, and a `tensor_ready` message tells the receiving actor which tag to take. In one process
// the tensor handle itself moves (zero-copy); across processes CAF's middleman carries only these
// descriptors.
//
// Addresses. The job has data_parallel × pipeline_stage workers; worker w = dp·P + pp hosts the
// stage actor of replica dp, pipeline rank pp, the optimizer shard (pp, dp) that owns slice dp of
// that pipeline rank's parameters, and, on the first and last pipeline rank, a data loader.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "actors/caf_compat.hpp"
#include "actors/wire.hpp"
#include "transport/transport.hpp"

namespace troupe::actors {

// --- atoms -------------------------------------------------------------------------------------
using step_atom = caf::atom_constant<caf::atom("step")>;        // coordinator: begin step s
                                                                // (stages: step, loss scale)
using stop_atom = caf::atom_constant<caf::atom("stop")>;        // coordinator: end of job
using tick_atom = caf::atom_constant<caf::atom("tick")>;        // watchdog timer
using snap_atom = caf::atom_constant<caf::atom("snap")>;        // copy state for step s to dests
using ckpt_atom = caf::atom_constant<caf::atom("ckpt")>;        // writer: expect a checkpoint
using status_atom = caf::atom_constant<caf::atom("status")>;    // what are you doing / waiting on
using start_atom = caf::atom_constant<caf::atom("start")>;      // coordinator: run the job
using dir_atom = caf::atom_constant<caf::atom("dir")>;          // node: your worker's actors

/// Destinations of a snapshot (bit mask).
inline constexpr std::int32_t to_writer = 1;
inline constexpr std::int32_t to_coordinator = 2;

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
};

/// The exact sum of the per-block sums of squares of one shard's slice of a chunk's reduced
/// gradient: the words of a core::exact_sum (order-free, so the coordinator merges them in any
/// order and gets the single-rank trainer's norm).
struct norm_part {
  std::int64_t step = 0;
  std::int32_t chunk = 0;
  std::int32_t part = 0;
  std::vector<std::int64_t> sumsq;
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

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, tensor_ready& x) {
  return f(TROUPE_INSPECT_NAME("tensor_ready"), x.step, x.kind, x.chunk, x.mb, x.part, x.src);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, trace_event& x) {
  return f(TROUPE_INSPECT_NAME("trace_event"), x.name, x.cat, x.start_us, x.dur_us);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, loss_report& x) {
  return f(TROUPE_INSPECT_NAME("loss_report"), x.step, x.dp, x.mb_loss_sums);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, stage_report& x) {
  return f(TROUPE_INSPECT_NAME("stage_report"), x.step, x.dp, x.pp, x.busy_s, x.comm_s, x.wait_s,
           x.peak_activation_bytes, x.events, x.peak_device_bytes);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, norm_part& x) {
  return f(TROUPE_INSPECT_NAME("norm_part"), x.step, x.chunk, x.part, x.sumsq);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, clip_decision& x) {
  return f(TROUPE_INSPECT_NAME("clip_decision"), x.step, x.scale, x.lr, x.adam_step, x.skip,
           x.loss_scale);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, shard_report& x) {
  return f(TROUPE_INSPECT_NAME("shard_report"), x.step, x.pp, x.part, x.state_bytes,
           x.peak_device_bytes);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, actor_failure& x) {
  return f(TROUPE_INSPECT_NAME("actor_failure"), x.actor, x.rank, x.step, x.instruction, x.what);
}

/// A worker process is alive, and what its stage was doing: sent by every worker's node actor to
/// the coordinator once a second, so that when a process dies the coordinator can say what it
/// was last doing.
struct worker_heartbeat {
  std::int32_t rank = 0;
  std::int32_t pid = 0;
  std::string status;  // the stage's status line ("stage(dp=1, pp=1) (rank 3) step 5 at 1B3: ...")
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, worker_heartbeat& x) {
  return f(TROUPE_INSPECT_NAME("worker_heartbeat"), x.rank, x.pid, x.status);
}

/// The writer finished (or failed) the checkpoint of `step`.
struct checkpoint_written {
  std::int64_t step = 0;
  std::string path;   // the checkpoint directory; empty on failure
  std::string error;  // why it failed
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, checkpoint_written& x) {
  return f(TROUPE_INSPECT_NAME("checkpoint_written"), x.step, x.path, x.error);
}

/// Registers every message type with an actor system config (needed for remote actors).
inline void register_messages(caf::actor_system_config& cfg) {
  cfg.add_message_type<tensor_ready>("tensor_ready");
  cfg.add_message_type<trace_event>("trace_event");
  cfg.add_message_type<std::vector<trace_event>>("std::vector<trace_event>");
  cfg.add_message_type<loss_report>("loss_report");
  cfg.add_message_type<stage_report>("stage_report");
  cfg.add_message_type<norm_part>("norm_part");
  cfg.add_message_type<clip_decision>("clip_decision");
  cfg.add_message_type<shard_report>("shard_report");
  cfg.add_message_type<actor_failure>("actor_failure");
  cfg.add_message_type<checkpoint_written>("checkpoint_written");
  cfg.add_message_type<worker_heartbeat>("worker_heartbeat");
}

}  // namespace troupe::actors
