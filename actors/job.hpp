// What every actor of one process shares, read-only once the job has started: the resolved
// config, the layout, each rank's instruction list, the transport hub, and the directory of actor
// handles (filled before the first step). Includes CAF: only actor sources include it.
#pragma once

#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "actors/layout.hpp"
#include "actors/protocol.hpp"
#include "core/config.hpp"
#include "schedules/schedule.hpp"
#include "transport/local.hpp"

namespace troupe::actors {

struct job {
  core::config cfg;
  job_layout layout;
  schedules::schedule program;  // lowered; program.ranks[pp]
  std::shared_ptr<transport::local_hub> hub;
  std::chrono::steady_clock::time_point epoch;
  std::chrono::milliseconds recv_timeout{60000};
  std::FILE* log = stdout;

  // directory, filled before the coordinator starts the first step
  std::map<std::pair<int, int>, caf::actor> stages;   // (dp, pp)
  std::map<std::pair<int, int>, caf::actor> shards;   // (pp, part)
  std::map<int, caf::actor> loaders;                  // dp
  caf::actor coordinator;
  caf::actor writer;

  caf::actor actor_of(const address& a) const {
    switch (a.who) {
      case role::stage: return stages.at({a.a, a.b});
      case role::shard: return shards.at({a.a, a.b});
      case role::loader: return loaders.at(a.a);
      case role::coordinator: return coordinator;
      case role::writer: return writer;
    }
    return coordinator;
  }
  /// The worker rank an address lives on.
  int worker_of(const address& a) const {
    switch (a.who) {
      case role::stage: return layout.worker(a.a, a.b);
      case role::shard: return layout.worker(a.b, a.a);
      case role::loader: return layout.worker(a.a, 0);
      default: return 0;
    }
  }
};

/// Sends a tensor: bytes over the transport, a tensor_ready notice through CAF.
template <class Self>
void route(Self* self, const job& j, int src_worker, const address& to, const transport::tag& tg,
           core::tensor t) {
  transport::local_transport tr(j.hub, src_worker);
  int dst = j.worker_of(to);
  tr.send(dst, std::move(t), tg);
  self->send(j.actor_of(to), tensor_ready{tg.step, tg.kind, tg.chunk, tg.mb, tg.part, src_worker});
}

/// Takes the tensor a tensor_ready announced.
inline core::tensor receive(const job& j, int dst_worker, const tensor_ready& m) {
  transport::local_transport tr(j.hub, dst_worker);
  return tr.recv(m.src, m.tag(), j.recv_timeout);
}

}  // namespace troupe::actors
