#include "actors/runtime.hpp"

#include <filesystem>
#include <fstream>
#include <thread>

#include "actors/actors.hpp"
#include "model/checkpoint.hpp"
#include "model/params.hpp"
#include "schedules/lower.hpp"
#include "schedules/registry.hpp"
#include "schedules/validate.hpp"

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

core::result<schedules::schedule> build_schedule(const core::config& cfg, int microbatches) {
  schedules::schedule_options o;
  o.virtual_stages = cfg.parallel.virtual_pipeline;
  const std::string& which = cfg.schedule.file.empty() ? cfg.schedule.name : cfg.schedule.file;
  auto s = schedules::make_schedule(which, cfg.parallel.pipeline_stage, microbatches, o);
  if (!s.ok()) {
    core::error e = s.err();
    if (e.where.key.empty()) e.where.key = cfg.schedule.file.empty() ? "schedule.name" : "schedule.file";
    if (e.where.file.empty()) e.where.file = cfg.source;
    return e;
  }
  schedules::schedule lowered = schedules::lower(s.value());
  if (auto st = schedules::validate(lowered); !st.ok()) return st.err();
  return lowered;
}

}  // namespace

const std::vector<core::tensor>& last_job_parameters() { return final_params(); }

core::result<model::train_summary> run_actor_job(const core::config& cfg_in, const run_options& opt) {
  core::config cfg = cfg_in;
  if (cfg.parallel.model_parallel != 1)
    return core::error::at_key(cfg.source, "parallel.model_parallel", 0, 0,
                               "tensor parallelism (model_parallel > 1) is not implemented yet",
                               "set parallel.model_parallel = 1 and use pipeline_stage / data_parallel");
  job_layout layout;
  layout.dp = cfg.parallel.data_parallel;
  layout.pp = cfg.parallel.pipeline_stage;
  layout.v = cfg.parallel.virtual_pipeline;
  layout.zero_stage = cfg.optimizer.zero_stage;
  layout.microbatches = cfg.parallel.micro_batch_num * cfg.train.gradient_accumulation_steps;

  auto sched = build_schedule(cfg, layout.microbatches);
  if (!sched.ok()) return sched.err();

  // Resume: the checkpoint decides where training continues.
  std::optional<model::checkpoint::reader> ck;
  int first_step = 0;
  if (!opt.resume.empty()) {
    auto dir = model::checkpoint::resolve(opt.resume);
    if (!dir.ok()) return dir.err();
    auto r = model::checkpoint::reader::open(dir.value());
    if (!r.ok()) return r.err();
    ck.emplace(std::move(r.value()));
    first_step = ck->info().next_step;
  }
  int end_step = cfg.train.steps;
  if (opt.max_steps >= 0) end_step = std::min(end_step, first_step + opt.max_steps);

  std::error_code ec;
  std::filesystem::create_directories(cfg.runtime.run_dir, ec);
  if (ec)
    return core::error::at_key(cfg.source, "runtime.run_dir", 0, 0,
                               "cannot create run directory '" + cfg.runtime.run_dir + "': " + ec.message(),
                               "choose a writable runtime.run_dir");
  {
    std::ofstream f(cfg.runtime.run_dir + "/config.toml");
    f << core::to_toml(cfg);
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
  kernels::set_cpu_threads(threads);

  auto j = std::make_shared<job>();
  j->cfg = cfg;
  j->layout = layout;
  j->program = std::move(sched.value());
  j->hub = std::make_shared<transport::local_hub>();
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
  auto specs = model::partition(cfg.model, layout.chunks());
  std::map<std::pair<int, int>, std::shared_ptr<stage_bundle>> stages;
  for (int d = 0; d < layout.dp; ++d)
    for (int p = 0; p < layout.pp; ++p) {
      auto b = std::make_shared<stage_bundle>();
      b->be = kernels::make_backend(cfg.runtime.device);
      std::vector<model::chunk> chunks;
      for (int i = 0; i < layout.v; ++i) {
        model::chunk c(cfg.model, specs[p + i * layout.pp], *b->be, cfg.precision.compute);
        c.init(cfg.train.seed);
        c.set_recompute(cfg.recompute.mode);
        if (ck) {
          auto st = model::checkpoint::restore(*ck, *b->be, cfg.model, c, nullptr);
          if (!st.ok()) return st.err();
        }
        chunks.push_back(std::move(c));
      }
      b->engine = std::make_unique<stage_engine>(cfg, layout, d, p, j->program.ranks.at(p), *b->be,
                                                 std::move(chunks), j->epoch);
      stages[{d, p}] = b;
    }
  std::map<std::pair<int, int>, std::shared_ptr<shard_bundle>> shards;
  for (int p = 0; p < layout.pp; ++p)
    for (int k = 0; k < layout.dp; ++k) {
      auto b = std::make_shared<shard_bundle>();
      b->be = kernels::make_backend(cfg.runtime.device);
      auto& owner = *stages.at({k, p})->engine;  // the stage on the shard's own worker
      std::vector<shard_chunk> sc;
      for (int i = 0; i < layout.v; ++i) {
        auto& c = owner.chunks()[i];
        sc.push_back(shard_chunk{p + i * layout.pp, c.params(), c.flat_params()});
      }
      b->engine = std::make_unique<shard_engine>(cfg, layout, p, k, *b->be, std::move(sc));
      if (ck) {
        for (auto& slot : b->engine->slots()) {
          for (auto [suffix, dst] : {std::pair<const char*, core::tensor*>{".exp_avg", &slot.exp_avg},
                                     {".exp_avg_sq", &slot.exp_avg_sq}}) {
            std::string name = slot.info.name + suffix;
            if (slot.info.tied) name = model::embedding_name(cfg.model) + suffix;
            auto t = ck->load(name);
            if (!t.ok()) return t.err();
            // slot.info.offset is where the slice starts in the chunk buffer; the moment tensor in
            // the checkpoint starts where the whole parameter does.
            std::int64_t start = -1;
            for (auto& c : b->engine->chunks())
              for (auto& pi : c.params)
                if (pi.name == slot.info.name) start = pi.offset;
            TROUPE_CHECK(start >= 0, "no parameter named " + slot.info.name);
            b->be->copy(t.value().reshape({t.value().numel()}).slice(slot.info.offset - start, {slot.info.numel}), *dst);
          }
        }
      }
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
    cs.checkpoint_root = ckpt_root;
    cs.done = done;
    j->coordinator = spawn_coordinator(sys, j, cs);
    caf::anon_send(j->coordinator, start_atom::value);
    future.wait();
  }
  auto result = future.get();
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
