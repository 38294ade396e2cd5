#include "runtime/runtime.hpp"

#include "runtime/host.hpp"
#include "transport/local.hpp"

namespace troupe::actors {
namespace {

class actor_config : public caf::actor_system_config {
 public:
  explicit actor_config(int threads) {
    register_messages(*this);
    configure_scheduler(*this, threads);
  }
};

}  // namespace

core::result<model::train_summary> run_actor_job(const core::config& cfg, const run_options& opt) {
  const int workers =
      cfg.parallel.data_parallel * cfg.parallel.pipeline_stage * cfg.parallel.model_parallel;
  std::vector<int> all(workers);
  for (int w = 0; w < workers; ++w) all[w] = w;
  auto prepared = prepare_job(cfg, opt, all);
  if (!prepared.ok()) return prepared.err();
  hosted_job& h = prepared.value();
  auto hub = std::make_shared<transport::local_hub>();
  for (int w = 0; w < workers; ++w) h.j->endpoints[w] = std::make_unique<transport::local_transport>(hub, w);

  auto done = std::make_shared<std::promise<core::result<model::train_summary>>>();
  auto future = done->get_future();
  std::optional<core::result<model::train_summary>> outcome;
  {
    actor_config acfg(h.threads);
    caf::actor_system sys{acfg};
    spawn_hosted(sys, h, opt.halt_after_step, done);
    caf::anon_send(h.j->coordinator, start_atom::value);
    outcome = future.get();
    if (h.j->layout.tp > 1) {
      // A failed job's tensor-parallel stages may be blocked in a collective whose peer will
      // never come (a stage that failed or hung): their receives give up now.
      if (!outcome->ok()) hub->close("the job stopped (" + outcome->err().message + ")");
      // Tensor-parallel stages run detached (actors/stage.cpp): the system's end waits until
      // their handles are gone, and the directory holds them. Once every actor is done nothing
      // reads the directory any more.
      sys.await_all_actors_done();
      h.j->clear_directory();
    }
  }
  auto result = std::move(*outcome);
  h.j->clear_directory();
  close_recorder(h);
  print_summary(opt.log, result);
  return result;
}

}  // namespace troupe::actors
