// The data-loader actor of one replica: cuts that replica's micro-batches from the memory-mapped
// shards (a pure function of seed, step, replica and micro-batch: model/loader.hpp) and feeds the
// tokens to the first stage and the targets to the last (and, for packed instruction rows, the
// document starts to every stage), one step ahead of the pipeline so the
// first forward never waits for data.
#include "actors/actors.hpp"

namespace troupe::actors {
namespace {

struct loader_state {
  std::shared_ptr<model::loader> data;
  std::int64_t sent_through = -1;  // last step whose micro-batches went out
  std::int64_t feeding = -1;       // the step being cut, for failure reports
};

void feed(caf::stateful_actor<loader_state>* self, const job& j, int dp, std::int64_t step) {
  auto& st = self->state;
  st.feeding = step;
  const int last_chunk = j.layout.chunks() - 1;
  const address me{role::loader, dp, 0};
  const auto& o = st.data->options();
  for (int mb = 0; mb < j.layout.microbatches; ++mb) {
    model::batch b = st.data->cut(static_cast<std::uint64_t>(step), dp, mb);
    // The global sequences this cut holds (model/loader.hpp), for the message log.
    const sample_key key{o.seed, step,
                         static_cast<std::int64_t>(dp * j.layout.microbatches + mb) * o.micro_batch_size,
                         o.micro_batch_size};
    // Every tensor-parallel rank of the first and last stage reads all the tokens / targets.
    for (int t = 0; t < j.layout.tp; ++t) {
      route(self, j, me, address{role::stage, dp, 0, t},
            transport::tag{step, static_cast<std::uint32_t>(tensor_kind::tokens), 0, mb, 0},
            b.tokens, send_note{nullptr, &key});
      route(self, j, me, address{role::stage, dp, j.layout.rank_of_chunk(last_chunk), t},
            transport::tag{step, static_cast<std::uint32_t>(tensor_kind::targets), last_chunk, mb, 0},
            b.targets, send_note{nullptr, &key});
    }
    // Packed rows: every stage needs where each example begins (attention and positions).
    if (b.doc_starts.defined())
      for (int p = 0; p < j.layout.pp; ++p)
        route(self, j, me, address{role::stage, dp, p},
              transport::tag{step, static_cast<std::uint32_t>(tensor_kind::documents), p, mb, 0},
              b.doc_starts, send_note{nullptr, &key});
  }
  st.sent_through = step;
}

caf::behavior loader_actor(caf::stateful_actor<loader_state>* self, std::shared_ptr<job> j, int dp,
                           std::shared_ptr<model::loader> data, int end_step) {
  self->state.data = std::move(data);
  report_exceptions(self, j, address{role::loader, dp, 0},
                    [self] { return std::pair{self->state.feeding, std::string("loader cut")}; });
  return {
      [=](step_atom, std::int64_t step) {
        for (std::int64_t s = std::max(step, self->state.sent_through + 1);
             s <= std::min<std::int64_t>(step + 1, end_step - 1); ++s)
          feed(self, *j, dp, s);
      },
      [=](rerun_atom, std::int64_t step) {
        // Step forensics executes `step` again: the same cut (a pure function of the step).
        const std::int64_t through = self->state.sent_through;
        feed(self, *j, dp, step);
        self->state.sent_through = std::max(through, step);
      },
  };
}

}  // namespace

caf::actor spawn_loader(caf::actor_system& sys, std::shared_ptr<job> j, int dp,
                        std::shared_ptr<model::loader> data, int end_step) {
  return sys.spawn(loader_actor, std::move(j), dp, std::move(data), end_step);
}

}  // namespace troupe::actors
