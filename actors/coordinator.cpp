// The coordinator actor, one per job: a thin behaviour over coordinator_engine (which decides
// everything; see actors/coordinator_engine.hpp). It hands the engine every message, sends the
// engine's commands, monitors every actor of the job, runs the watchdog's timer and questions, and
// settles the job's outcome once the engine has one — also when an exception escapes the engine
// or the actor ends without an outcome, so a job can never wait forever on a dead coordinator.
#include <variant>

#include "actors/actors.hpp"

namespace troupe::actors {
namespace {

using promise_t = std::promise<core::result<model::train_summary>>;

struct coord_state {
  std::unique_ptr<coordinator_engine> eng;
  std::shared_ptr<promise_t> done;
  bool settled = false;
  std::map<caf::actor_addr, address> who;  // every monitored actor

  // The last guard: an actor that ends without settling (CAF destroys the state on exit) still
  // ends the job.
  ~coord_state() {
    if (done && !settled)
      done->set_value(core::error::make("the coordinator stopped without an outcome",
                                        "see the messages above; resume from the last checkpoint "
                                        "with --resume"));
  }
};

using self_t = caf::stateful_actor<coord_state>;

std::vector<caf::actor> everyone(const job& j) {
  std::vector<caf::actor> all;
  for (auto& [k, a] : j.stages) all.push_back(a);
  for (auto& [k, a] : j.shards) all.push_back(a);
  for (auto& [k, a] : j.loaders) all.push_back(a);
  all.push_back(j.writer);
  return all;
}

template <class... F>
struct overloaded : F... {
  using F::operator()...;
};
template <class... F>
overloaded(F...) -> overloaded<F...>;

void send_command(self_t* self, const job& j, coordinator_command& c) {
  std::visit(overloaded{
                 [&](begin_step_cmd& b) {
                   for (auto& [d, a] : j.loaders) self->send(a, step_atom::value, b.step);
                   for (auto& [k, a] : j.stages) self->send(a, step_atom::value, b.step, b.loss_scale);
                 },
                 [&](clip_decision& d) {
                   for (auto& [k, a] : j.shards) self->send(a, d);
                 },
                 [&](snapshot_cmd& s) {
                   for (int p = 0; p < j.layout.pp; ++p)
                     for (int t = 0; t < j.layout.tp; ++t)
                       self->send(j.stages.at({0, p, t}), snap_atom::value, s.step, s.dests);
                 },
                 [&](forget_cmd& f) {
                   for (auto& [k, a] : j.shards) self->send(a, rerun_atom::value, f.step);
                 },
                 [&](reexecute_cmd& r) {
                   for (auto& [d, a] : j.loaders) self->send(a, rerun_atom::value, r.step);
                   for (auto& [k, a] : j.stages)
                     self->send(a, rerun_atom::value, r.step, r.loss_scale);
                 },
                 [&](checkpoint_cmd& c) {
                   self->send(j.writer, ckpt_atom::value, c.step, std::move(c.scaler));
                   // ZeRO-0 shards hold everything: replica 0's moments are the checkpoint's.
                   const int parts = j.layout.zero_stage == 0 ? 1 : j.layout.dp;
                   for (int p = 0; p < j.layout.pp; ++p)
                     for (int k = 0; k < parts; ++k)
                       for (int t = 0; t < j.layout.tp; ++t)
                         self->send(j.shards.at({p, k, t}), snap_atom::value, c.step, to_writer);
                 },
             },
             c);
}

/// "4.2": seconds with one decimal.
std::string seconds_text(std::chrono::milliseconds d) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", d.count() / 1000.0);
  return buf;
}

/// Sends the engine's commands; once the engine has an outcome, settles the job and stops every
/// actor (and, when `quit`, this one).
void flush(self_t* self, const job& j, bool quit = true) {
  auto& st = self->state;
  for (auto& c : st.eng->take_commands()) send_command(self, j, c);
  if (!st.eng->outcome() || st.settled) return;
  st.settled = true;
  j.over = true;
  st.done->set_value(*st.eng->outcome());
  for (auto& a : everyone(j)) self->send_exit(a, caf::exit_reason::user_shutdown);
  if (quit) self->quit();
}

caf::behavior coordinator_actor(self_t* self, std::shared_ptr<job> j, coordinator_setup s) {
  auto& st = self->state;
  st.done = s.done;
  st.eng = std::make_unique<coordinator_engine>(j->cfg, j->layout, static_cast<coordinator_plan>(s),
                                                j->log, j->recv_timeout);
  self->set_exception_handler([self, j](caf::scheduled_actor*, std::exception_ptr& e) {
    auto& eng = *self->state.eng;
    eng.fail(failure_error(actor_failure{actor_name(address{role::coordinator, 0, 0}), 0,
                                         eng.step(), "", exception_text(e)}));
    flush(self, *j, false);
    // The job ends as it does on any failure: the other workers hear of it from worker 0.
    return caf::make_error(caf::exit_reason::user_shutdown);
  });
  self->set_down_handler([self, j](caf::down_msg& m) {
    auto& eng = *self->state.eng;
    const auto it = self->state.who.find(m.source);
    const std::string reason = self->system().render(m.reason);
    if (it == self->state.who.end())
      eng.fail(core::error::make("an actor stopped unexpectedly during step " +
                                     std::to_string(eng.step()) + " (" + reason + ")",
                                 "see the messages above"));
    else
      eng.on_down(it->second, m.reason == caf::exit_reason::remote_link_unreachable, reason);
    flush(self, *j);
  });
  return {
      [=](start_atom) {
        auto& st = self->state;
        for (auto& [k, a] : j->stages)
          st.who[a.address()] =
              address{role::stage, std::get<0>(k), std::get<1>(k), std::get<2>(k)};
        for (auto& [k, a] : j->shards)
          st.who[a.address()] =
              address{role::shard, std::get<0>(k), std::get<1>(k), std::get<2>(k)};
        for (auto& [k, a] : j->loaders) st.who[a.address()] = address{role::loader, k, 0};
        st.who[j->writer.address()] = address{role::writer, 0, 0};
        for (auto& a : everyone(*j)) self->monitor(a);
        st.eng->start(j->hosts);
        flush(self, *j);
        self->delayed_send(self, std::chrono::seconds(1), tick_atom::value);
      },
      [=](loss_report& r) {
        self->state.eng->on_loss(std::move(r));
        flush(self, *j);
      },
      [=](norm_part& n) {
        self->state.eng->on_norm(std::move(n));
        flush(self, *j);
      },
      [=](shard_report& r) {
        self->state.eng->on_shard_report(r);
        flush(self, *j);
      },
      [=](stage_report& r) {
        self->state.eng->on_stage_report(std::move(r));
        flush(self, *j);
      },
      [=](tensor_ready& m) {
        self->state.eng->on_snapshot(m.chunk, -1 - m.mb, receive(*j, 0, m));
        flush(self, *j);
      },
      [=](rerun_atom, std::int64_t step, std::int32_t pp, std::int32_t part) {
        self->state.eng->on_forgotten(step, pp, part);
        flush(self, *j);
      },
      [=](checkpoint_written& w) {
        self->state.eng->on_checkpoint(w);
        flush(self, *j);
      },
      [=](actor_failure& f) {
        if (self->state.eng->on_failure(f, !j->nodes.empty()))
          self->delayed_send(self, std::chrono::seconds(2), stop_atom::value);
        flush(self, *j);
      },
      [=](stop_atom) {
        self->state.eng->on_deferred_timeout();
        flush(self, *j);
      },
      [=](worker_heartbeat& h) { self->state.eng->on_heartbeat(std::move(h)); },
      [=](tick_atom) {
        auto& eng = *self->state.eng;
        const watchdog_action act = eng.on_tick(coordinator_engine::clock::now());
        flush(self, *j);
        if (eng.phase() == coordinator_phase::stopped) return;
        if (act == watchdog_action::wait) {
          self->delayed_send(self, std::chrono::seconds(1), tick_atom::value);
          return;
        }
        for (auto& [k, a] : j->stages) {
          const address at{role::stage, std::get<0>(k), std::get<1>(k), std::get<2>(k)};
          self->request(a, std::chrono::seconds(2), status_atom::value)
              .then([self](std::string& line) { self->state.eng->hang_line(std::move(line)); },
                    [self, j, at, rank = j->worker_of(at)](caf::error&) {
                      // A tensor-parallel stage blocked in its group's collective cannot answer
                      // (actors/tp_wait.hpp).
                      // In this process its group's slot says what it waits for; across
                      // processes its worker's heartbeat (runtime/worker.cpp) says it.
                      if (auto b = j->tp_blocked(at))
                        return self->state.eng->hang_line(b->first + " for " + seconds_text(b->second) + " s");
                      if (std::string b = self->state.eng->blocked_line(rank); !b.empty())
                        return self->state.eng->hang_line(std::move(b));
                      // A stage busy in one long kernel, or a worker process that is stopped.
                      self->state.eng->hang_line(
                          actor_name(at) + " (rank " + std::to_string(rank) +
                          "): no answer within 2 s — stuck inside an instruction, or its process "
                          "is stopped");
                    });
        }
        self->delayed_send(self, std::chrono::seconds(3), tick_atom::value);
      },
  };
}

}  // namespace

caf::actor spawn_coordinator(caf::actor_system& sys, std::shared_ptr<job> j, coordinator_setup s) {
  return sys.spawn(coordinator_actor, std::move(j), std::move(s));
}

}  // namespace troupe::actors
