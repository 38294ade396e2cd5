#include "runtime/host.hpp"

#include <algorithm>
#include <filesystem>
#include <thread>

#include "core/machine.hpp"
#include "runtime/build.hpp"
#include "model/safetensors.hpp"
#include "model/tensor_parallel.hpp"
#include "kernels/select.hpp"

namespace troupe::actors {
namespace {

/// What tensor parallel (parallel.model_parallel > 1) runs today: fp32 compute, on the CPU and
/// CUDA backends (docs/model.md).
core::status tensor_parallel_supported(const core::config& cfg) {
  const int tp = cfg.parallel.model_parallel;
  if (tp == 1) return {};
  const std::string what = "parallel.model_parallel = " + std::to_string(tp);
  if (cfg.precision.compute != core::precision_kind::fp32)
    return core::config_error(cfg, "precision.compute",
                              what + " sums its partial results in fp32 only",
                              "set precision.compute = \"fp32\", or set parallel.model_parallel "
                              "= 1 (remove parallel.sequence_parallel)");
  return {};
}

/// How long a tensor-parallel group's receive waits for a peer: the watchdog's limit and 10 s
/// more. The watchdog asks every stage once nothing progressed for its limit and reports 3 s
/// later, naming what each blocked stage waits for (actors/tp_wait.hpp); a receive that gave up
/// at the limit itself would stop the job first, with only its own timeout to say.
std::chrono::milliseconds tp_recv_timeout(std::chrono::milliseconds watchdog) {
  return watchdog + std::chrono::seconds(10);
}

const char* recompute_name(core::recompute_mode m) {
  return m == core::recompute_mode::none ? "none" : m == core::recompute_mode::full ? "full" : "selective";
}

/// ", layers [1, 3]" for an uneven split, "" for an even one.
std::string split_text(const core::config& cfg) {
  const std::vector<int> split = core::chunk_layers(cfg);
  if (std::all_of(split.begin(), split.end(), [&](int n) { return n == split.front(); })) return {};
  std::string out = ", layers [";
  for (std::size_t i = 0; i < split.size(); ++i) out += (i ? ", " : "") + std::to_string(split[i]);
  return out + "]";
}

/// " × model_parallel 2 (sequence parallel)" under tensor parallel, "" without.
std::string tp_text(const core::config& cfg) {
  if (cfg.parallel.model_parallel == 1) return {};
  return " × model_parallel " + std::to_string(cfg.parallel.model_parallel) +
         (cfg.parallel.sequence_parallel ? " (sequence parallel)" : "");
}

/// " of layers 0, 2" when recompute applies to some layers only.
std::string recompute_layers_text(const core::config& cfg) {
  const std::vector<bool> mask = core::recompute_layers(cfg);
  if (cfg.recompute.mode == core::recompute_mode::none ||
      std::find(mask.begin(), mask.end(), false) == mask.end())
    return {};
  std::string out;
  for (std::size_t i = 0; i < mask.size(); ++i)
    if (mask[i]) out += (out.empty() ? " of layers " : ", ") + std::to_string(i);
  return out.empty() ? " of no layer" : out;
}

}  // namespace

bool hosted_job::hosts(int w) const { return std::binary_search(workers.begin(), workers.end(), w); }

core::result<hosted_job> prepare_job(const core::config& cfg, const run_options& opt,
                                     std::vector<int> workers) {
  if (auto st = tensor_parallel_supported(cfg); !st.ok()) return st.err();
  hosted_job h;
  std::sort(workers.begin(), workers.end());
  h.workers = std::move(workers);
  auto sched = build_schedule(cfg, layout_of(cfg).microbatches);
  if (!sched.ok()) return sched.err();
  const job_layout layout = layout_of(cfg, sched.value());

  // The run policy (model/run_policy.hpp) resolves the resume point and the steps, creates the
  // run directory, and writes config.toml on the process hosting worker 0.
  auto start = model::open_run(cfg, opt.resume, opt.max_steps, h.hosts(0),
                               h.hosts(0) ? opt.log : nullptr);
  if (!start.ok()) return start.err();
  const std::optional<model::checkpoint::reader>& ck = start->resume;
  const std::string& resumed_from = start->resumed_from;
  h.first_step = start->first_step;
  h.end_step = start->end_step;
  h.ckpt_root = start->ckpt_root;
  h.step_hooks = opt.step_hooks;
  h.restarts = opt.restarts;
  if (ck) {
    auto scaler = model::restore_loss_scaler(*ck, cfg.precision);
    if (!scaler.ok()) return scaler.err();
    h.scaler = scaler.value();
  }
  const std::string config_text = core::to_toml(cfg);

  auto data_opts = model::loader_options::from(cfg);
  auto train = model::loader::open(cfg.data.train, data_opts);
  if (!train.ok()) return train.err();
  h.train = std::make_shared<model::loader>(std::move(train.value()));
  if (cfg.parallel.model_parallel > 1 && h.train->masked() && h.train->rows_layout().packing)
    return core::config_error(cfg, "parallel.model_parallel",
                              "parallel.model_parallel > 1 does not run packed instruction rows "
                              "(data.packing) yet",
                              "turn packing off, or set parallel.model_parallel = 1");
  if (!cfg.data.val.empty() && h.hosts(0)) {
    auto v = model::loader::open(cfg.data.val, data_opts);
    if (!v.ok()) return v.err();
    h.val = std::make_shared<model::loader>(std::move(v.value()));
  }

  // CPU ops split work by shape only (same bits for any thread count); a caller runs its own tasks
  // and idle pool threads help, so a busy stage borrows the cores an idle stage leaves.
  const int cores = core::usable_cores();
  h.threads = cfg.runtime.threads > 0 ? cfg.runtime.threads : cores;
  kernels::set_cpu_threads(opt.kernel_threads > 0 ? opt.kernel_threads : h.threads);
  kernels::set_gemm_tune_file(cfg.runtime.gemm_tune_file);

  h.j = std::make_shared<job>();
  job& j = *h.j;
  j.cfg = cfg;
  j.layout = layout;
  j.program = std::move(sched.value());
  j.endpoints.resize(layout.workers());
  if (opt.sink) {
    j.sink = opt.sink;
  } else if (cfg.runtime.record) {
    segment_header hd;
    hd.workers = layout.workers();
    hd.first_step = h.first_step;
    hd.end_step = h.end_step;
    hd.resume = resumed_from;
    hd.config_xxh64 = model::safetensors::xxh64(config_text.data(), config_text.size());
    auto r = recorder::open(cfg.runtime.run_dir, h.workers, hd, cfg.runtime.record_tensors);
    if (!r.ok()) return r.err();
    h.rec = r.value();
    j.sink = h.rec;
  }
  j.perturb = opt.perturb;
  if (opt.fault && opt.fault->kind == core::fault_kind::stall && cfg.parallel.model_parallel == 1)
    // A stage that shares the scheduler's threads would hold one of them while it stalls.
    return core::error::make(opt.fault->label() + " stalls a tensor-parallel stage, which runs on "
                                                  "a thread of its own, but parallel.model_parallel "
                                                  "is 1",
                             "test only; set parallel.model_parallel >= 2, or stop a worker "
                             "process with SIGSTOP to hang one (docs/faults.md)");
  j.fault = opt.fault;
  j.recv_timeout = std::chrono::seconds(cfg.runtime.watchdog_s);
  j.epoch = std::chrono::steady_clock::now();
  j.log = opt.log;

  if (opt.log && h.hosts(0)) {
    std::fprintf(opt.log,
                 "troupe: %d worker(s) as actors: data_parallel %d × pipeline_stage %d (virtual %d%s)%s, "
                 "schedule %s, %d micro-batches per replica, ZeRO-%d, recompute %s%s\n",
                 layout.workers(), layout.dp, layout.pp, layout.v, split_text(cfg).c_str(),
                 tp_text(cfg).c_str(),
                 j.program.name.c_str(), layout.microbatches, layout.zero_stage,
                 recompute_name(cfg.recompute.mode), recompute_layers_text(cfg).c_str());
    std::fflush(opt.log);
  }

  // runtime.split_gpu: the hosted workers share the one GPU of runtime.device, each (its stage and
  // its optimizer shard) on its own group of SMs, in worker order.
  const auto share_of = [&](int w) {
    kernels::gpu_share s;
    if (!cfg.runtime.split_gpu) return s;
    s.count = static_cast<int>(h.workers.size());
    const auto at = std::find(h.workers.begin(), h.workers.end(), w);
    s.index = static_cast<int>(at - h.workers.begin());
    return s;
  };
  // Build the hosted stages' chunks (identically initialised on every replica) and shards.
  const model::checkpoint::reader* from = ck ? &*ck : nullptr;
  for (int w : h.workers) {
    const int d = layout.dp_of(w), p = layout.pp_of(w), t = layout.tp_of(w);
    auto b = std::make_shared<stage_bundle>();
    b->be = kernels::make_backend(cfg.runtime.device, share_of(w));
    model::chunk_tp tp;
    if (layout.tp > 1) {
      // The group: the tp consecutive ranks of this (replica, pipeline rank).
      std::vector<int> ranks;
      for (int r = 0; r < layout.tp; ++r) ranks.push_back(layout.worker(d, p, r));
      job* jp = h.j.get();
      b->group = std::make_unique<tp_group>(
          [jp, w]() -> transport::transport& { return jp->endpoint(w); }, w, std::move(ranks),
          *b->be, cfg.parallel.sequence_parallel, model::kv_replicas(cfg.model, layout.tp),
          tp_recv_timeout(j.recv_timeout));
      // The group's collectives are messages between workers too: logged (and replay-checked)
      // like the stage's other sends, their received bytes stored under record_tensors.
      b->group->record_to(j.sink.get(), address{role::stage, d, p, t});
      j.tp_waits[{d, p, t}] = b->group->wait_slot();
      tp = model::chunk_tp{layout.tp, t, b->group.get()};
    }
    auto chunks = build_stage_chunks(cfg, layout, p, *b->be, from, tp);
    if (!chunks.ok()) return chunks.err();
    b->engine = std::make_unique<stage_engine>(cfg, layout, d, p, j.program.ranks.at(p), *b->be,
                                               std::move(chunks.value()), j.epoch);
    b->engine->set_tp(t, b->group.get());
    b->engine->set_data(h.train);
    if (opt.fault && ((opt.fault->rank == w && (opt.fault->kind == core::fault_kind::nan ||
                                                opt.fault->kind == core::fault_kind::slow ||
                                                opt.fault->kind == core::fault_kind::kill)) ||
                      opt.fault->kind == core::fault_kind::poison))
      b->engine->inject(*opt.fault);  // poison: every stage; the one computing the loss acts
    h.stages[{d, p, t}] = b;
  }
  for (int w : h.workers) {
    const int k = layout.dp_of(w), p = layout.pp_of(w), t = layout.tp_of(w);
    auto b = std::make_shared<shard_bundle>();
    b->be = kernels::make_backend(cfg.runtime.device, share_of(w));
    b->host = make_host_backend(j.cfg);
    // Shard (p, k, t) lives on worker (k, p, t): the stage there holds the parameters it starts
    // from.
    auto e = build_shard(j.cfg, layout, p, k, *b->be, h.stages.at({k, p, t})->engine->chunks(),
                         from, b->host.get(), t);
    if (!e.ok()) return e.err();
    b->engine = std::move(e.value());
    stage_engine& stage = *h.stages.at({k, p, t})->engine;
    for (std::size_t i = 0; i < stage.chunks().size(); ++i)
      stage.share_norm_blocks(i, b->engine->norm_blocks(i));
    h.shards[{p, k, t}] = b;
  }
  return h;
}

void spawn_hosted(caf::actor_system& sys, hosted_job& h, int halt_after,
                  std::shared_ptr<std::promise<core::result<model::train_summary>>> done) {
  job& j = *h.j;
  for (auto& [k, b] : h.stages)
    j.stages[k] = spawn_stage(sys, h.j, std::get<0>(k), std::get<1>(k), b);
  for (auto& [k, b] : h.shards)
    j.shards[k] = spawn_shard(sys, h.j, std::get<0>(k), std::get<1>(k), b);
  for (int w : h.workers)
    if (j.layout.pp_of(w) == 0 && j.layout.tp_of(w) == 0)
      j.loaders[j.layout.dp_of(w)] =
          spawn_loader(sys, h.j, j.layout.dp_of(w), h.train, h.end_step);
  if (!h.hosts(0)) return;
  j.writer = spawn_writer(sys, h.j, h.ckpt_root);
  coordinator_setup cs;
  cs.first_step = h.first_step;
  cs.end_step = h.end_step;
  cs.train = h.train;
  cs.val = h.val;
  cs.halt_after = halt_after;
  cs.scaler = h.scaler;
  cs.step_hooks = h.step_hooks;
  cs.restarts = h.restarts;
  cs.done = std::move(done);
  j.coordinator = spawn_coordinator(sys, h.j, cs);
}

void close_recorder(hosted_job& h) {
  if (!h.rec) return;
  if (auto st = h.rec->close(); !st.ok())
    std::fprintf(stderr, "troupe: warning: %s\n", st.err().to_string().c_str());
}

void print_summary(std::FILE* log, const core::result<model::train_summary>& r) {
  if (!r.ok() || !log) return;
  auto& s = r.value();
  std::fprintf(log, "done: %d steps in %.1f s", s.end_step - s.first_step, s.seconds);
  if (s.final_val_loss) std::fprintf(log, ", validation loss %.4f", *s.final_val_loss);
  std::fprintf(log, "\n");
  std::fflush(log);
}

}  // namespace troupe::actors
