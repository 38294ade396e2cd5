// What every actor of one process shares, read-only once the job has started: the resolved
// config, the layout, each rank's instruction list, the transport endpoint of each worker, the
// message sink (recording or replay), and the directory of actor handles (filled before the first
// step). Includes CAF: only actor sources include it.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdio>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "actors/layout.hpp"
#include "actors/perturb.hpp"
#include "actors/protocol.hpp"
#include "actors/recorder.hpp"
#include "actors/tp_wait.hpp"
#include "core/config.hpp"
#include "core/error.hpp"
#include "core/fault.hpp"
#include "schedules/schedule.hpp"
#include "transport/transport.hpp"

namespace troupe::actors {

struct job {
  core::config cfg;
  job_layout layout;
  schedules::schedule program;  // lowered; program.ranks[pp]
  /// Transport endpoint of each worker, indexed by worker rank; null for workers hosted by
  /// another process (in one process every worker has a `local` endpoint on one hub).
  std::vector<std::unique_ptr<transport::transport>> endpoints;
  /// Sees every tensor sent (and, when it asks, received): the recorder, replay's verifier, or
  /// null.
  std::shared_ptr<message_sink> sink;
  /// A test-only bit flip of one sent tensor (actors/perturb.hpp); null = none.
  std::shared_ptr<send_perturbation> perturb;
  /// A test-only injected fault (TROUPE_FAULT, core/fault.hpp): the checkpoint writer acts on
  /// `enospc`, the stages of its rank on `nan` and `slow`; none = none.
  std::optional<core::fault_spec> fault;
  /// Set once the coordinator of this process has the job's outcome (TROUPE_FAULT=stall's
  /// stage waits for it).
  mutable std::atomic<bool> over{false};
  std::chrono::steady_clock::time_point epoch;
  std::chrono::milliseconds recv_timeout{60000};
  std::FILE* log = stdout;

  // directory, filled before the coordinator starts the first step
  std::map<std::tuple<int, int, int>, caf::actor> stages;   // (dp, pp, tp)
  std::map<std::tuple<int, int, int>, caf::actor> shards;   // (pp, part, tp)
  std::map<int, caf::actor> loaders;                  // dp
  caf::actor coordinator;
  caf::actor writer;
  /// A launched job's worker processes (runtime/worker.cpp): the node actor of every other
  /// worker and the host each worker runs on, indexed by worker rank; empty in one process.
  std::map<int, caf::actor> nodes;
  std::map<int, std::string> hosts;
  /// What each tensor-parallel stage this process hosts is blocked on inside a collective
  /// (actors/tp_wait.hpp), by (dp, pp, tp): read for the watchdog while the stage cannot answer.
  std::map<std::tuple<int, int, int>, std::shared_ptr<const tp_wait>> tp_waits;

  /// When the stage at `a`, hosted by this process, is blocked in a collective of its
  /// tensor-parallel group: "stage(dp=0, pp=0, tp=0) (rank 0): blocked in the tensor-parallel …
  /// waiting to receive from rank 1 (stage(dp=0, pp=0, tp=1))" and how long it has waited.
  std::optional<std::pair<std::string, std::chrono::milliseconds>> tp_blocked(const address& a) const {
    const auto it = tp_waits.find({a.a, a.b, a.c});
    if (it == tp_waits.end()) return std::nullopt;
    const auto w = it->second->current();
    if (!w) return std::nullopt;
    return std::pair{stage_name(a.a, a.b, a.c) + " (rank " + std::to_string(worker_of(a)) +
                         "): blocked " + describe_wait(*w, peer_name(w->peer)),
                     std::chrono::duration_cast<std::chrono::milliseconds>(
                         std::chrono::steady_clock::now() - w->since)};
  }
  /// "rank 5 (stage(dp=0, pp=1, tp=1))".
  std::string peer_name(int w) const {
    return "rank " + std::to_string(w) + " (" +
           stage_name(layout.dp_of(w), layout.pp_of(w), layout.tp_of(w)) + ")";
  }
  /// A tensor-parallel stage's name with its tp rank, 0 included: "stage(dp=0, pp=1, tp=0)".
  static std::string stage_name(int dp, int pp, int tp) {
    return "stage(dp=" + std::to_string(dp) + ", pp=" + std::to_string(pp) +
           ", tp=" + std::to_string(tp) + ")";
  }

  /// Drops every actor handle (the actors hold the job: without this neither would be freed).
  /// Call once the actor system is gone.
  void clear_directory() {
    stages.clear();
    shards.clear();
    loaders.clear();
    nodes.clear();
    coordinator = caf::actor{};
    writer = caf::actor{};
  }

  caf::actor actor_of(const address& a) const {
    switch (a.who) {
      case role::stage: return stages.at({a.a, a.b, a.c});
      case role::shard: return shards.at({a.a, a.b, a.c});
      case role::loader: return loaders.at(a.a);
      case role::coordinator: return coordinator;
      case role::writer: return writer;
    }
    return coordinator;
  }
  /// The endpoint of worker `w`. REQUIRES: this process hosts w.
  transport::transport& endpoint(int w) const {
    TROUPE_CHECK(w >= 0 && w < static_cast<int>(endpoints.size()) && endpoints[w],
                 "worker " + std::to_string(w) + " has no transport endpoint in this process");
    return *endpoints[w];
  }
  /// The worker rank an address lives on.
  int worker_of(const address& a) const { return actors::worker_of(layout, a); }
};

/// The text of a caught exception.
inline std::string exception_text(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown exception";
  }
}

/// Installs the exception handler of an actor of the job (every actor but the coordinator, which
/// stops the job itself): an exception ends the actor, and the coordinator gets an actor_failure
/// naming the actor at `me`, its worker rank, and the step and instruction `where()` returns
/// (a std::pair<std::int64_t, std::string>), and stops the job with it.
template <class Self, class Where>
void report_exceptions(Self* self, std::shared_ptr<job> j, address me, Where where) {
  self->set_exception_handler(
      [self, j = std::move(j), me, where](caf::scheduled_actor*, std::exception_ptr& e) {
        const std::string what = exception_text(e);
        auto [step, instruction] = where();
        // Urgent, as the down message this actor's end sends next is: so the coordinator reads
        // the failure, which names the step and instruction, before it learns of the end.
        self->template send<caf::message_priority::high>(
            j->coordinator, actor_failure{actor_name(me), j->worker_of(me), step, instruction, what});
        return caf::make_error(caf::sec::runtime_error, what);
      });
}

/// What route() needs beyond the tensor to record it: the sender's backend (to read a device
/// tensor's final bytes) and, for loader cuts, the data-sampling key.
struct send_note {
  kernels::backend* be = nullptr;
  const sample_key* sample = nullptr;
  hash_memo* memo = nullptr;  // shared by one batch of sends (recorder.hpp)
  /// The tensor's message hash, already queued by the sender (observe_send's `hash`).
  std::shared_ptr<kernels::pending_value> hash = nullptr;
};

/// Sends a tensor from the actor at `from`: bytes over the sender worker's transport endpoint, a
/// tensor_ready notice through CAF. The message sink sees it first, while the bytes are final.
template <class Self>
void route(Self* self, const job& j, const address& from, const address& to,
           const transport::tag& tg, core::tensor t, const send_note& note = {}) {
  const int src = j.worker_of(from), dst = j.worker_of(to);
  std::shared_ptr<kernels::pending_value> hash = note.hash;
  if (j.perturb) {
    const void* before = t.defined() ? t.raw() : nullptr;
    t = perturb_send(*j.perturb, from, src, to, dst, tg, std::move(t), note.be);
    if (!t.defined() || t.raw() != before) hash = nullptr;  // perturbed: other bytes
  }
  if (j.sink)
    observe_send(*j.sink, from, src, to, dst, tg, t, note.be, note.sample, note.memo, nullptr,
                 std::move(hash));
  j.endpoint(src).send(dst, std::move(t), tg);
  self->send(j.actor_of(to), tensor_ready{tg.step, tg.kind, tg.chunk, tg.mb, tg.part, src});
}

/// Takes the tensor a tensor_ready announced, on worker `dst_worker`'s endpoint. `be`: the
/// receiver's backend, for recording the bytes of a device tensor.
inline core::tensor receive(const job& j, int dst_worker, const tensor_ready& m,
                            kernels::backend* be = nullptr) {
  core::tensor t = j.endpoint(dst_worker).recv(m.src, m.tag(), j.recv_timeout);
  if (j.sink) {
    // A device tensor may still be in flight on another stream: order the log's copy after it.
    if (be && t.defined() && !t.dev().is_cpu()) be->wait_ready(t);
    observe_receive(*j.sink, m.src, dst_worker, m.tag(), t, be);
  }
  return t;
}

}  // namespace troupe::actors
