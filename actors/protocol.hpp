// Every message of the actor runtime as a CAF message (one protocol header: docs/design.md, rule
// 4): the atoms, and inspect() and registration for the plain message structs of actors/wire.hpp
// (where the CAF-free engines see them too). Control messages are small and serialisable; tensor
// bytes travel on the transport (transport/transport.hpp) under a tag, and a `tensor_ready` message
// tells the receiving actor which tag to take. In one process the tensor handle itself moves
// (zero-copy); across processes CAF's middleman carries only these descriptors.
//
// Addresses. The job has data_parallel × pipeline_stage workers; worker w = dp·P + pp hosts the
// stage actor of replica dp, pipeline rank pp, the optimizer shard (pp, dp) that owns slice dp of
// that pipeline rank's parameters, and, on the first and last pipeline rank, a data loader.
#pragma once

#include <cstdint>
#include <cstring>
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
using rerun_atom = caf::atom_constant<caf::atom("rerun")>;      // step forensics: execute step s
                                                                // again (shards: forget it first,
                                                                // then answer rerun, s, pp, part)

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, tensor_ready& x) {
  return f(TROUPE_INSPECT_NAME("tensor_ready"), x.step, x.kind, x.chunk, x.mb, x.part, x.src);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, trace_event& x) {
  return f(TROUPE_INSPECT_NAME("trace_event"), x.name, x.cat, x.start_us, x.dur_us);
}
/// Doubles as their bit patterns. CAF 0.17 packs a double field with pack754, which garbles NaN
/// and never ends on an infinity: loss sums must arrive as they were, non-finite ones included
/// (the coordinator stops or looks into a step on them).
inline std::vector<std::uint64_t> double_bits(const std::vector<double>& v) {
  std::vector<std::uint64_t> out(v.size());
  if (!v.empty()) std::memcpy(out.data(), v.data(), v.size() * sizeof(double));
  return out;
}
inline std::vector<double> bits_double(const std::vector<std::uint64_t>& v) {
  std::vector<double> out(v.size());
  if (!v.empty()) std::memcpy(out.data(), v.data(), v.size() * sizeof(double));
  return out;
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, loss_report& x) {
  std::vector<std::uint64_t> sums = double_bits(x.mb_loss_sums), seqs = double_bits(x.seq_loss_sums);
  return f(TROUPE_INSPECT_NAME("loss_report"), x.step, x.dp, sums, seqs,
           caf::meta::load_callback([&]() -> caf::error {
             x.mb_loss_sums = bits_double(sums);
             x.seq_loss_sums = bits_double(seqs);
             return caf::none;
           }));
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, stage_report& x) {
  return f(TROUPE_INSPECT_NAME("stage_report"), x.step, x.dp, x.pp, x.busy_s, x.comm_s, x.wait_s,
           x.peak_activation_bytes, x.events, x.peak_device_bytes, x.tp, x.device_events,
           x.device_busy_s);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, norm_part& x) {
  return f(TROUPE_INSPECT_NAME("norm_part"), x.step, x.chunk, x.part, x.sumsq, x.nonfinite,
           x.grad_hash);
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

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, worker_heartbeat& x) {
  return f(TROUPE_INSPECT_NAME("worker_heartbeat"), x.rank, x.pid, x.status, x.blocked_ms);
}

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
