// The stage actor: hosts one (replica, pipeline rank) — its chunks, its instruction list — and
// runs stage_engine, which never blocks: each message either starts a step or delivers a tensor,
// and the engine goes as far as the tensors it has allow. A failing instruction (an exception in
// a kernel, a bad shape) is reported to the coordinator with the rank, step and instruction.
#include <thread>

#include "actors/actors.hpp"

namespace troupe::actors {

namespace {

struct stage_state {
  std::shared_ptr<stage_bundle> b;
  bool running = false;
  int worker = 0;
};

void pump(caf::stateful_actor<stage_state>* self, const job& j) {
  auto& st = self->state;
  auto& eng = *st.b->engine;
  const address me{role::stage, eng.dp(), eng.pp(), eng.tp()};
  // run() yields after every instruction that sends, so a tensor leaves as soon as it exists and
  // the next stage works while this one goes on: a pipeline only overlaps if sends are not held.
  for (;;) {
    bool done = eng.run();
    auto out = eng.take_outgoing();
    // One memo per batch: a ZeRO-0 gradient going to every shard is hashed once.
    hash_memo memo;
    for (auto& o : out)
      route(self, j, me, o.to, o.tag, std::move(o.t),
            send_note{st.b->be.get(), nullptr, &memo, std::move(o.hash)});
    if (eng.losses_ready()) {
      // Every rank of a tensor-parallel group has the same losses: the first reports them.
      if (eng.tp() == 0)
        self->send(j.coordinator,
                   loss_report{eng.step(), eng.dp(), eng.losses(), eng.sequence_losses()});
      eng.losses_reported();
    }
    if (done) {
      st.running = false;
      const auto& t = eng.timing();
      self->send(j.coordinator, stage_report{eng.step(), eng.dp(), eng.pp(), t.busy_s, t.comm_s,
                                             t.wait_s, eng.peak_activation_bytes(), t.events,
                                             eng.peak_device_bytes(), eng.tp(), t.device_events,
                                             t.device_busy_s});
      if (j.sink) j.sink->flush(st.worker);  // the worker's step is over: its log lines go to disk
      return;
    }
    if (out.empty()) return;  // waiting for a tensor: the next delivery resumes
  }
}

/// TROUPE_FAULT=stall (test only): this stage stops where it is, answering nothing, until the job
/// has ended (in a launched job, until its process is stopped): a hung rank whose process lives.
void stall(const job& j, int worker, std::int64_t step) {
  if (j.log) {
    std::fprintf(j.log, "%s: worker %d stalls at the start of step %lld\n", j.fault->label().c_str(),
                 worker, static_cast<long long>(step));
    std::fflush(j.log);
  }
  while (!j.over) std::this_thread::sleep_for(std::chrono::milliseconds(20));
}

caf::behavior stage_actor(caf::stateful_actor<stage_state>* self, std::shared_ptr<job> j, int dp,
                          int pp, std::shared_ptr<stage_bundle> b) {
  self->state.b = std::move(b);
  // A sink that takes pending hashes gets a gradient's from the pass that sums its norm blocks.
  self->state.b->engine->hash_gradients(j->sink && !j->sink->wants_bytes());
  const int t = self->state.b->engine->tp();
  self->state.worker = j->layout.worker(dp, pp, t);
  report_exceptions(self, j, address{role::stage, dp, pp, t}, [self] {
    auto& eng = *self->state.b->engine;
    return std::pair{eng.step(), eng.current_instruction()};
  });
  return {
      [=](step_atom, std::int64_t step, float loss_scale) {
        if (j->fault && j->fault->kind == core::fault_kind::stall &&
            j->fault->rank == self->state.worker && j->fault->step == step)
          stall(*j, self->state.worker, step);
        self->state.b->engine->begin_step(step, loss_scale);
        self->state.running = true;
        pump(self, *j);
      },
      [=](rerun_atom, std::int64_t step, float loss_scale) {
        // Step forensics: the step once more, from the parameters it started from.
        self->state.b->engine->begin_step(step, loss_scale, true);
        self->state.running = true;
        pump(self, *j);
      },
      [=](tensor_ready& m) {
        self->state.b->engine->deliver(m.tag(),
                                       receive(*j, self->state.worker, m, self->state.b->be.get()));
        if (self->state.running) pump(self, *j);
      },
      [=](snap_atom, std::int64_t step, std::int32_t dests) {
        auto& st = self->state;
        for (std::size_t i = 0; i < st.b->engine->chunks().size(); ++i) {
          int c = j->layout.chunk_of(pp, static_cast<int>(i));
          core::tensor copy = st.b->be->to_host(st.b->engine->chunks()[i].flat_params()).clone();
          // The tensor-parallel rank travels in the tag's micro-batch field (-1 - tp).
          transport::tag tg{step, static_cast<std::uint32_t>(tensor_kind::snap_params), c, -1 - t, 0};
          const address me{role::stage, dp, pp, t};
          if (dests & to_writer) route(self, *j, me, address{role::writer, 0, 0}, tg, copy);
          tg.part = 1;  // the writer and the coordinator share worker 0: keep their tags apart
          if (dests & to_coordinator) route(self, *j, me, address{role::coordinator, 0, 0}, tg, copy);
        }
        // No flush here: the recorder flushes each snapshot's line before it is sent.
      },
      [=](status_atom) {
        auto& eng = *self->state.b->engine;
        std::string s = actor_name(address{role::stage, dp, pp, t}) + " (rank " +
                        std::to_string(self->state.worker) + ") step " + std::to_string(eng.step());
        if (!self->state.running) return s + ": idle";
        s += " at " + eng.current_instruction();
        auto w = eng.waiting_for();
        return w.empty() ? s + ": computing" : s + ": waiting for " + w;
      },
  };
}

}  // namespace

caf::actor spawn_stage(caf::actor_system& sys, std::shared_ptr<job> j, int dp, int pp,
                       std::shared_ptr<stage_bundle> b) {
  // A tensor-parallel stage blocks inside its group's collectives (actors/tp_group.hpp): it gets
  // a thread of its own, so its peers' stages always have one to reach the same collective.
  if (b->engine->tp_group_size() > 1)
    return sys.spawn<caf::detached>(stage_actor, std::move(j), dp, pp, std::move(b));
  return sys.spawn(stage_actor, std::move(j), dp, pp, std::move(b));
}

}  // namespace troupe::actors
