// The optimizer-shard actor: owns one slice of one pipeline rank's optimizer state (layout.hpp
// says which under each ZeRO stage) and runs shard_engine: gradient slices from every replica in,
// norm blocks to the coordinator, the coordinator's clip/lr decision in, parameter slices out.
#include "actors/actors.hpp"

namespace troupe::actors {
namespace {

struct shard_state {
  std::shared_ptr<shard_bundle> b;
  int worker = 0;
  std::int64_t step = -1;
  // Under ZeRO-0 only part 0's norm blocks decide the clip scale, so the decision can arrive
  // before this shard has every replica's gradient: it waits here until they are in.
  std::optional<clip_decision> pending;
  // Step forensics asked to execute this step again: forget it once it is reduced (under ZeRO-0 a
  // shard whose norm does not count may not have every replica's first slices yet).
  std::optional<std::int64_t> forget;
};

using shard_self = caf::stateful_actor<shard_state>;

/// Applies the pending clip decision once this shard has reduced that step's gradients.
void apply_when_reduced(shard_self* self, const job& j, int pp, int part) {
  auto& st = self->state;
  auto& eng = *st.b->engine;
  if (!st.pending || !eng.reduce(st.pending->step)) return;
  const clip_decision d = *st.pending;
  st.pending.reset();
  if (j.sink) j.sink->clipped(clip_record{st.worker, pp, part, d.step, d.scale, d.lr, d.adam_step, d.skip, d.loss_scale});
  eng.apply(d.step, d.scale, d.lr, d.adam_step, d.skip);
  for (auto& o : eng.take_outgoing())
    route(self, j, address{role::shard, pp, part, eng.tp()}, o.to, o.tag, std::move(o.t),
          send_note{st.b->be.get(), nullptr, nullptr, std::move(o.hash)});
  self->send(j.coordinator, shard_report{d.step, pp, j.layout.part_id(part, eng.tp()),
                                         eng.state_bytes(), eng.peak_device_bytes()});
}

/// Forgets the step step forensics executes again, once it is reduced, and tells the coordinator.
void forget_when_reduced(shard_self* self, const job& j, int pp, int part) {
  auto& st = self->state;
  auto& eng = *st.b->engine;
  if (!st.forget || !eng.reduce(*st.forget)) return;
  const std::int64_t step = *st.forget;
  st.forget.reset();
  eng.forget(step);
  // Every worker hosts one shard, and no actor of it sends a tensor of the re-execution before
  // the coordinator has heard from every shard: the log's marker precedes them all.
  if (j.sink) j.sink->reexecuted(st.worker, step);
  self->send(j.coordinator, rerun_atom::value, step, static_cast<std::int32_t>(pp),
             static_cast<std::int32_t>(j.layout.part_id(part, eng.tp())));
}

caf::behavior shard_actor(shard_self* self, std::shared_ptr<job> j, int pp,
                          int part, std::shared_ptr<shard_bundle> b) {
  self->state.b = std::move(b);
  // A sink that takes pending hashes gets the parameters' from AdamW itself.
  self->state.b->engine->hash_updates(j->sink && !j->sink->wants_bytes());
  const int t = self->state.b->engine->tp();
  self->state.worker = j->layout.worker(part, pp, t);
  report_exceptions(self, j, address{role::shard, pp, part, t},
                    [self] { return std::pair{self->state.step, std::string()}; });
  return {
      [=](tensor_ready& m) {
        auto& eng = *self->state.b->engine;
        int replica = j->layout.dp_of(m.src);
        eng.deliver(replica, m.tag(), receive(*j, self->state.worker, m, self->state.b->be.get()));
        self->state.step = m.step;
        if (eng.reduce(m.step)) {
          for (auto& [chunk, blocks] : eng.take_norm_parts())
            self->send(j->coordinator, norm_part{m.step, chunk, j->layout.part_id(part, t),
                                                 std::move(blocks),
                                                 eng.nonfinite(), eng.grad_hash(chunk)});
        }
        apply_when_reduced(self, *j, pp, part);
        forget_when_reduced(self, *j, pp, part);
      },
      [=](rerun_atom, std::int64_t step) {
        self->state.forget = step;
        forget_when_reduced(self, *j, pp, part);
      },
      [=](clip_decision& d) {
        self->state.pending = d;
        apply_when_reduced(self, *j, pp, part);
      },
      [=](snap_atom, std::int64_t step, std::int32_t) {
        auto& eng = *self->state.b->engine;
        auto& be = *self->state.b->be;
        // One host copy of each moment (under offload they are host memory already).
        auto copy = [&be](const core::tensor& t) { return t.dev().is_cpu() ? t.clone() : be.to_host(t); };
        for (std::size_t i = 0; i < eng.chunks().size(); ++i) {
          int c = eng.chunks()[i].chunk;
          // The tensor-parallel rank travels in the tag's micro-batch field (-1 - tp).
          const address me{role::shard, pp, part, t};
          route(self, *j, me, address{role::writer, 0, 0},
                transport::tag{step, static_cast<std::uint32_t>(tensor_kind::snap_exp_avg), c, -1 - t, part},
                copy(eng.moments()[i].exp_avg));
          route(self, *j, me, address{role::writer, 0, 0},
                transport::tag{step, static_cast<std::uint32_t>(tensor_kind::snap_exp_avg_sq), c, -1 - t, part},
                copy(eng.moments()[i].exp_avg_sq));
        }
        // No flush here: the recorder flushes each snapshot's line before it is sent.
      },
  };
}

}  // namespace

caf::actor spawn_shard(caf::actor_system& sys, std::shared_ptr<job> j, int pp, int part,
                       std::shared_ptr<shard_bundle> b) {
  return sys.spawn(shard_actor, std::move(j), pp, part, std::move(b));
}

}  // namespace troupe::actors
