#include "actors/runtime.hpp"

#include <filesystem>
#include <fstream>
#include <thread>

#include "actors/actors.hpp"
#include "actors/build.hpp"
#include "model/checkpoint.hpp"
#include "model/params.hpp"
#include "model/safetensors.hpp"
#include "transport/local.hpp"

namespace troupe::actors {
namespace {

std::vector<core::tensor>& final_params() {
  static std::vector<core::tensor> params;
  return params;
}

class actor_config : public caf::actor_system_config {
 public:
  explicit actor_config(int threads) {
    register_messages(*this);
    configure_scheduler(*this, threads);
  }
};

}  // namespace

const std::vector<core::tensor>& last_job_parameters() { return final_params(); }

core::result<model::train_summary> run_actor_job(const core::config& cfg_in, const run_options& opt) {
  core::config cfg = cfg_in;
  if (cfg.parallel.model_parallel != 1)
    return core::error::at_key(cfg.source, "parallel.model_parallel", 0, 0,
                               "tensor parallelism (model_parallel > 1) is not implemented yet",
                               "set parallel.model_parallel = 1 and use pipeline_stage / data_parallel");
  const job_layout layout = layout_of(cfg);

  auto sched = build_schedule(cfg, layout.microbatches);
  if (!sched.ok()) return sched.err();

  // Resume: the checkpoint decides where training continues.
  std::optional<model::checkpoint::reader> ck;
  int first_step = 0;
  std::string resumed_from;
  if (!opt.resume.empty()) {
    auto dir = model::checkpoint::resolve(opt.resume);
    if (!dir.ok()) return dir.err();
    auto r = model::checkpoint::reader::open(dir.value());
    if (!r.ok()) return r.err();
    ck.emplace(std::move(r.value()));
    first_step = ck->info().next_step;
    resumed_from = dir.value();
  }
  int end_step = cfg.train.steps;
  if (opt.max_steps >= 0) end_step = std::min(end_step, first_step + opt.max_steps);

  std::error_code ec;
  std::filesystem::create_directories(cfg.runtime.run_dir, ec);
  if (ec)
    return core::error::at_key(cfg.source, "runtime.run_dir", 0, 0,
                               "cannot create run directory '" + cfg.runtime.run_dir + "': " + ec.message(),
                               "choose a writable runtime.run_dir");
  const std::string config_text = core::to_toml(cfg);
  {
    std::ofstream f(cfg.runtime.run_dir + "/config.toml");
    f << config_text;
  }
  std::string ckpt_root = cfg.checkpoint.dir.empty() ? cfg.runtime.run_dir + "/checkpoints" : cfg.checkpoint.dir;

  auto data_opts = model::loader_options::from(cfg);
  auto train = model::loader::open(cfg.data.train, data_opts);
  if (!train.ok()) return train.err();
  auto train_data = std::make_shared<model::loader>(std::move(train.value()));
  std::shared_ptr<model::loader> val_data;
  if (!cfg.data.val.empty()) {
    auto v = model::loader::open(cfg.data.val, data_opts);
    if (!v.ok()) return v.err();
    val_data = std::make_shared<model::loader>(std::move(v.value()));
  }

  // CPU ops split work by shape only (same bits for any thread count); a caller runs its own tasks
  // and idle pool threads help, so a busy stage borrows the cores an idle stage leaves.
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = cfg.runtime.threads > 0 ? cfg.runtime.threads : cores;
  kernels::set_cpu_threads(opt.kernel_threads > 0 ? opt.kernel_threads : threads);

  auto j = std::make_shared<job>();
  j->cfg = cfg;
  j->layout = layout;
  j->program = std::move(sched.value());
  auto hub = std::make_shared<transport::local_hub>();
  for (int w = 0; w < layout.workers(); ++w)
    j->endpoints.push_back(std::make_unique<transport::local_transport>(hub, w));
  std::shared_ptr<recorder> rec;
  if (opt.sink) {
    j->sink = opt.sink;
  } else if (cfg.runtime.record) {
    segment_header h;
    h.workers = layout.workers();
    h.first_step = first_step;
    h.end_step = end_step;
    h.resume = resumed_from;
    h.config_xxh64 = model::safetensors::xxh64(config_text.data(), config_text.size());
    std::vector<int> all(layout.workers());
    for (int w = 0; w < layout.workers(); ++w) all[w] = w;
    auto r = recorder::open(cfg.runtime.run_dir, all, h, cfg.runtime.record_tensors);
    if (!r.ok()) return r.err();
    rec = r.value();
    j->sink = rec;
  }
  j->epoch = std::chrono::steady_clock::now();
  j->log = opt.log;

  if (opt.log) {
    std::fprintf(opt.log,
                 "troupe: %d worker(s) as actors: data_parallel %d × pipeline_stage %d (virtual %d), "
                 "schedule %s, %d micro-batches per replica, ZeRO-%d, recompute %s\n",
                 layout.workers(), layout.dp, layout.pp, layout.v, j->program.name.c_str(),
                 layout.microbatches, layout.zero_stage,
                 cfg.recompute.mode == core::recompute_mode::none
                     ? "none"
                     : cfg.recompute.mode == core::recompute_mode::full ? "full" : "selective");
    std::fflush(opt.log);
  }

  // Build every stage's chunks (identically initialised on every replica) and the shards.
  const model::checkpoint::reader* from = ck ? &*ck : nullptr;
  std::map<std::pair<int, int>, std::shared_ptr<stage_bundle>> stages;
  for (int d = 0; d < layout.dp; ++d)
    for (int p = 0; p < layout.pp; ++p) {
      auto b = std::make_shared<stage_bundle>();
      b->be = kernels::make_backend(cfg.runtime.device);
      auto chunks = build_stage_chunks(cfg, layout, p, *b->be, from);
      if (!chunks.ok()) return chunks.err();
      b->engine = std::make_unique<stage_engine>(cfg, layout, d, p, j->program.ranks.at(p), *b->be,
                                                 std::move(chunks.value()), j->epoch);
      stages[{d, p}] = b;
    }
  std::map<std::pair<int, int>, std::shared_ptr<shard_bundle>> shards;
  for (int p = 0; p < layout.pp; ++p)
    for (int k = 0; k < layout.dp; ++k) {
      auto b = std::make_shared<shard_bundle>();
      b->be = kernels::make_backend(cfg.runtime.device);
      // The stage on the shard's own worker holds the parameters the shard starts from.
      auto e = build_shard(cfg, layout, p, k, *b->be, stages.at({k, p})->engine->chunks(), from);
      if (!e.ok()) return e.err();
      b->engine = std::move(e.value());
      shards[{p, k}] = b;
    }

  auto done = std::make_shared<std::promise<core::result<model::train_summary>>>();
  auto future = done->get_future();
  {
    actor_config acfg(threads);
    caf::actor_system sys{acfg};
    for (auto& [k, b] : stages) j->stages[k] = spawn_stage(sys, j, k.first, k.second, b);
    for (auto& [k, b] : shards) j->shards[k] = spawn_shard(sys, j, k.first, k.second, b);
    for (int d = 0; d < layout.dp; ++d) j->loaders[d] = spawn_loader(sys, j, d, train_data, end_step);
    j->writer = spawn_writer(sys, j, ckpt_root);
    coordinator_setup cs;
    cs.first_step = first_step;
    cs.end_step = end_step;
    cs.val = val_data;
    cs.halt_after = opt.halt_after_step;
    cs.done = done;
    j->coordinator = spawn_coordinator(sys, j, cs);
    caf::anon_send(j->coordinator, start_atom::value);
    future.wait();
  }
  auto result = future.get();
  if (rec) {
    // The run itself is not lost when its log is: warn, and let replay report the gap.
    if (auto st = rec->close(); !st.ok())
      std::fprintf(stderr, "troupe: warning: %s\n", st.err().to_string().c_str());
  }
  final_params().clear();
  for (int i = 0; i < layout.chunks(); ++i) {
    auto& b = stages.at({0, layout.rank_of_chunk(i)});
    final_params().push_back(b->be->to_host(b->engine->chunks()[layout.local_index(i)].flat_params()).clone());
  }
  if (result.ok() && opt.log) {
    auto& s = result.value();
    std::fprintf(opt.log, "done: %d steps in %.1f s", s.end_step - s.first_step, s.seconds);
    if (s.final_val_loss) std::fprintf(opt.log, ", validation loss %.4f", *s.final_val_loss);
    std::fprintf(opt.log, "\n");
  }
  return result;
}

}  // namespace troupe::actors
