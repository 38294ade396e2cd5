#include "model/trainer.hpp"

#include <chrono>
#include <cmath>
#include <filesystem>

#include "model/metrics.hpp"
#include "model/params.hpp"
#include "kernels/select.hpp"

namespace troupe::model {

namespace fs = std::filesystem;

namespace {

int global_micro_batches(const core::config& c) {
  return c.parallel.data_parallel * c.parallel.micro_batch_num *
         c.train.gradient_accumulation_steps;
}

void note(std::FILE* log, const std::string& text) {
  if (log) std::fprintf(log, "%s\n", text.c_str());
}

}  // namespace

trainer::trainer(const core::config& cfg, kernels::backend& be, loader train)
    : cfg_(cfg), be_(be), train_(std::move(train)), graph_wanted_(cfg.runtime.cuda_graph) {}

trainer::~trainer() {
  // Only our own recording: another trainer on this backend may have replaced it.
  if (graph_ready_ && be_.graph_current() == graph_id_) {
    try {
      be_.graph_reset();
    } catch (const std::exception&) {
      // A destructor must not throw; the backend frees the graph when it goes.
    }
  }
}

core::result<std::unique_ptr<trainer>> trainer::create(const core::config& cfg,
                                                       kernels::backend& be, int chunks) {
  loader_options lo = loader_options::from(cfg);
  lo.micro_batches = global_micro_batches(cfg);
  auto train = loader::open(cfg.data.train, lo);
  if (!train) return train.err();
  std::unique_ptr<trainer> t(new trainer(cfg, be, std::move(train.value())));
  if (!cfg.data.val.empty()) {
    auto val = loader::open(cfg.data.val, lo);
    if (!val) return val.err();
    t->val_.emplace(std::move(val.value()));
  }
  t->scaler_ = loss_scaler::from(cfg.precision);
  t->micro_batches_ = lo.micro_batches;
  t->tokens_per_step_ = static_cast<std::int64_t>(lo.micro_batches) *
                        cfg.parallel.micro_batch_size * cfg.model.seq_length;
  for (const chunk_spec& spec : partition(cfg.model, chunks)) {
    t->chunks_.emplace_back(cfg.model, spec, be, cfg.precision.compute);
    t->chunks_.back().init(cfg.train.seed);
    t->chunks_.back().set_recompute(cfg.recompute.mode);
    t->states_.push_back(make_optimizer_state(be, t->chunks_.back()));
  }
  return t;
}

tensor trainer::to_device(const tensor& host) {
  return be_.dev().is_cpu() ? host : be_.from_host(host);
}

std::vector<param_slot> trainer::all_slots() {
  std::vector<param_slot> slots;
  for (std::size_t i = 0; i < chunks_.size(); ++i) {
    auto s = slots_of(chunks_[i], states_[i]);
    slots.insert(slots.end(), s.begin(), s.end());
  }
  return slots;
}

void trainer::tie(const std::vector<param_slot>& slots) {
  for (const param_slot& s : slots) {  // 3
    if (!s.info.tied) continue;
    tensor g_wte = chunks_.front().grad(embedding_name(cfg_.model));
    tensor g_head = s.grad;
    tie_gradients(be_, g_wte, g_head);
  }
}

core::result<step_result> trainer::train_step(int step) {
  return scaler_.enabled ? scaled_step(step) : device_step(step);
}

core::result<step_result> trainer::scaled_step(int step) {
  for (chunk& c : chunks_) c.zero_grads();  // 1
  const float grad_scale = loss_grad_scale(scaler_.scale, tokens_per_step_);
  double loss_total = 0;
  for (int mb = 0; mb < micro_batches_; ++mb) {  // 2
    batch b = train_.cut(static_cast<std::uint64_t>(step), 0, mb);
    tensor x = to_device(b.tokens);
    tensor targets = to_device(b.targets);
    for (std::size_t i = 0; i + 1 < chunks_.size(); ++i) x = chunks_[i].forward(mb, x);
    chunks_.back().forward(mb, x, targets, grad_scale);
    double mb_loss = chunks_.back().loss_sum(mb);
    if (!std::isfinite(mb_loss)) {
      for (chunk& c : chunks_) c.release(mb);
      return core::error::make("loss is " + std::to_string(mb_loss) + " at step " +
                                   std::to_string(step) + ", micro-batch " + std::to_string(mb),
                               "lower optimizer.lr or set train.grad_clip; the parameters were "
                               "not updated by this step");
    }
    loss_total += mb_loss;
    tensor g;
    for (std::size_t i = chunks_.size(); i-- > 0;) g = chunks_[i].backward(mb, g);
  }
  std::vector<param_slot> slots = all_slots();
  tie(slots);
  // 4-7: the slots carry each chunk's low-precision copy, so AdamW refreshes it in the same pass
  const step_decision d =
      decide_step(gradient_sumsq(be_, slots), scaler_, cfg_.optimizer, cfg_.train, step);
  if (!d.skip) adamw_update_t(be_, slots, cfg_.optimizer, d.lr, d.grad_scale, d.adam_step);

  step_result r;
  r.loss = loss_total / static_cast<double>(tokens_per_step_);  // 8
  r.grad_norm = d.grad_norm;
  r.clip = d.clip;
  r.lr = d.lr;
  r.tokens = tokens_per_step_;
  r.skipped = d.skip;
  r.loss_scale = d.loss_scale;
  r.next_loss_scale = d.next_loss_scale;
  return r;
}

void trainer::queue_device_step() {
  const float grad_scale = loss_grad_scale(1.0f, tokens_per_step_);
  for (chunk& c : chunks_) c.zero_grads();  // 1
  begin_device_step(be_, clip_);
  for (int mb = 0; mb < micro_batches_; ++mb) {  // 2
    tensor x = inputs_[static_cast<std::size_t>(mb)].tokens;
    for (std::size_t i = 0; i + 1 < chunks_.size(); ++i) x = chunks_[i].forward(mb, x);
    chunks_.back().forward(mb, x, inputs_[static_cast<std::size_t>(mb)].targets, grad_scale);
    loss_rows_[static_cast<std::size_t>(mb)] = chunks_.back().loss_rows(mb);
    guard_losses(be_, loss_rows_[static_cast<std::size_t>(mb)], clip_);
    tensor g;
    for (std::size_t i = chunks_.size(); i-- > 0;) g = chunks_[i].backward(mb, g);
  }
  std::vector<param_slot> slots = all_slots();
  tie(slots);
  clip_and_update_on_device(be_, slots, cfg_.optimizer, cfg_.train, clip_);  // 4-7
}

core::result<step_result> trainer::device_step(int step) {
  if (!clip_.sumsq.defined()) {
    // Buffers that outlive every step: a recorded graph reads its inputs and writes its results
    // here on each replay.
    clip_ = make_device_clip(be_);
    loss_rows_.resize(static_cast<std::size_t>(micro_batches_));
    for (int mb = 0; mb < micro_batches_; ++mb) {
      const std::int64_t rows =
          static_cast<std::int64_t>(cfg_.parallel.micro_batch_size) * cfg_.model.seq_length;
      inputs_.push_back({be_.empty({rows}, core::dtype::i32), be_.empty({rows}, core::dtype::i32)});
    }
  }
  for (int mb = 0; mb < micro_batches_; ++mb) {
    batch b = train_.cut(static_cast<std::uint64_t>(step), 0, mb);
    be_.copy(b.tokens.reshape({b.tokens.numel()}), inputs_[static_cast<std::size_t>(mb)].tokens);
    be_.copy(b.targets.reshape({b.targets.numel()}),
             inputs_[static_cast<std::size_t>(mb)].targets);
  }
  step_decision d;
  d.lr = learning_rate(cfg_.optimizer, cfg_.train, step);  // 6
  d.adam_step = scaler_.adam_step(step);
  set_adamw_schedule(be_, cfg_.optimizer, d.lr, d.adam_step, clip_);

  if (graph_ready_) {
    be_.graph_replay(graph_id_);
  } else if (graph_wanted_ && steps_queued_ >= 1 && (graph_id_ = be_.graph_begin()) != 0) {
    // The second step is recorded: the first filled the allocator's cache and chose the GEMMs.
    try {
      queue_device_step();
      be_.graph_end();
      graph_ready_ = true;
    } catch (const std::exception& e) {
      be_.graph_reset();
      graph_wanted_ = false;
      for (chunk& c : chunks_)
        for (int mb = 0; mb < micro_batches_; ++mb) c.release(mb);
      graph_note_ = std::string("runtime.cuda_graph: the step could not be recorded (") +
                    e.what() + "); every kernel is launched from the host instead";
    }
    if (graph_ready_)
      be_.graph_replay(graph_id_);
    else
      queue_device_step();
  } else {
    queue_device_step();
  }
  ++steps_queued_;

  const device_clip_result c = read_device_clip(be_, clip_);  // waits for the step
  double loss_total = 0;
  for (int mb = 0; mb < micro_batches_; ++mb) {
    const double mb_loss = sum_loss_rows(be_, loss_rows_[static_cast<std::size_t>(mb)]);
    if (!std::isfinite(mb_loss))
      return core::error::make("loss is " + std::to_string(mb_loss) + " at step " +
                                   std::to_string(step) + ", micro-batch " + std::to_string(mb),
                               "lower optimizer.lr or set train.grad_clip; the parameters were "
                               "not updated by this step");
    loss_total += mb_loss;
  }
  if (!std::isfinite(c.grad_norm))
    return core::error::make("the gradient norm is " +
                                 std::string(std::isnan(c.grad_norm) ? "NaN" : "infinite") +
                                 " at step " + std::to_string(step) +
                                 "; the parameters were not updated",
                             "lower optimizer.lr or set train.grad_clip; with fp16 turn on "
                             "precision.dynamic_loss_scale");
  scaler_.record(true);

  step_result r;
  r.loss = loss_total / static_cast<double>(tokens_per_step_);  // 8
  r.grad_norm = c.grad_norm;
  r.clip = static_cast<float>(c.clip);
  r.lr = d.lr;
  r.tokens = tokens_per_step_;
  r.loss_scale = 1.0f;
  r.next_loss_scale = 1.0f;
  return r;
}

double trainer::validation_loss() {
  const int n = cfg_.train.eval_batches;
  double total = 0;
  std::int64_t tokens = 0;
  for (int i = 0; i < n; ++i) {
    batch b = val_->eval_cut(i);
    tensor x = to_device(b.tokens);
    tensor targets = to_device(b.targets);
    for (std::size_t c = 0; c + 1 < chunks_.size(); ++c) x = chunks_[c].forward(i, x);
    chunks_.back().forward(i, x, targets, 0.0f);
    total += chunks_.back().loss_sum(i);
    for (chunk& c : chunks_) c.release(i);
    tokens += static_cast<std::int64_t>(b.batch_size) * b.seq_length;
  }
  return total / static_cast<double>(tokens);
}

checkpoint::save_request trainer::snapshot(int steps_done) {
  checkpoint::save_request req;
  req.step = steps_done;
  req.seed = cfg_.train.seed;
  req.config_toml = core::to_toml(cfg_);
  checkpoint::shard_spec model{"model.safetensors", "model", {}};
  checkpoint::shard_spec opt{"optimizer.safetensors", "optimizer", {}};
  for (std::size_t i = 0; i < chunks_.size(); ++i) {
    auto m = checkpoint::model_shard(be_, chunks_[i]);
    auto o = checkpoint::optimizer_shard(be_, chunks_[i], states_[i]);
    model.tensors.insert(model.tensors.end(), m.tensors.begin(), m.tensors.end());
    opt.tensors.insert(opt.tensors.end(), o.tensors.begin(), o.tensors.end());
  }
  if (scaler_.enabled) opt.tensors.push_back(loss_scaler_tensor(scaler_));
  req.shards = {std::move(model), std::move(opt)};
  return req;
}

core::status trainer::restore(const checkpoint::reader& ck) {
  for (std::size_t i = 0; i < chunks_.size(); ++i)
    if (auto st = checkpoint::restore(ck, be_, cfg_.model, chunks_[i], &states_[i]); !st)
      return st;
  auto s = restore_loss_scaler(ck, cfg_.precision);
  if (!s) return s.err();
  scaler_ = s.value();
  return {};
}

safetensors::named_tensor loss_scaler_tensor(const loss_scaler& s) {
  const std::vector<double> v = s.to_vector();
  tensor t = tensor::zeros({static_cast<std::int64_t>(v.size())}, core::dtype::f64);
  std::copy(v.begin(), v.end(), t.data<double>());
  return {loss_scaler_tensor_name, t};
}

core::result<loss_scaler> restore_loss_scaler(const checkpoint::reader& ck,
                                              const core::precision_config& p) {
  // A checkpoint without the state (scaling was off when it was written) has applied every step.
  if (!p.dynamic_loss_scale || !ck.contains(loss_scaler_tensor_name))
    return loss_scaler::from(p, ck.info().next_step);
  auto t = ck.load(loss_scaler_tensor_name);
  if (!t) return t.err();
  if (t->type() != core::dtype::f64)
    return core::error::at_file((fs::path(ck.dir()) / "manifest.json").string(),
                                std::string("tensor ") + loss_scaler_tensor_name + " is " +
                                    core::dtype_name(t->type()) + ", expected fp64",
                                "the checkpoint is damaged or not written by troupe");
  const double* p0 = t->data<double>();
  return loss_scaler::from_vector(p, std::vector<double>(p0, p0 + t->numel()),
                                  (fs::path(ck.dir()) / "manifest.json").string());
}

namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

// The resumed run must be the same model; other differences (logging, intervals) are allowed but
// the ones that change the arithmetic are pointed out, since they break bit-identical resumption.
core::status check_resume_config(const core::config& cfg, const checkpoint::reader& ck,
                                 std::FILE* log) {
  const std::string where = (fs::path(ck.dir()) / "manifest.json").string();
  auto saved = core::parse_config(ck.info().config_toml, where);
  if (!saved) return saved.err();
  // Validation fills derived defaults (kv heads, MLP width); compare both sides after it.
  auto current = core::parse_config(core::to_toml(cfg), "the run's config");
  if (!current) return current.err();
  if (!(saved->model == current->model))
    return core::error::at_file(where, "the checkpoint holds a different model than the config",
                                "resume with the config the checkpoint was trained with (its "
                                "text is in manifest.json), or fix the [model] table");
  if (saved->train.seed != cfg.train.seed)
    note(log, "note: train.seed differs from the checkpoint's; the data order will not continue "
              "the original run");
  if (saved->train.steps != cfg.train.steps || saved->train.warmup_steps != cfg.train.warmup_steps ||
      saved->optimizer.lr != cfg.optimizer.lr || saved->optimizer.min_lr != cfg.optimizer.min_lr)
    note(log, "note: the learning-rate schedule differs from the checkpoint's run");
  return {};
}

core::status write_text(const std::string& path, const std::string& text) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (!f) return core::error::at_file(path, "cannot create");
  bool ok = std::fputs(text.c_str(), f) >= 0;
  ok = std::fclose(f) == 0 && ok;
  if (!ok) return core::error::at_file(path, "write failed", "check free disk space");
  return {};
}

}  // namespace

core::result<train_summary> train_single_rank(const core::config& cfg, const train_options& opt) {
  std::FILE* log = opt.log;
  const auto& par = cfg.parallel;
  if (par.data_parallel > 1 || par.model_parallel > 1 || par.pipeline_stage > 1 ||
      par.virtual_pipeline > 1)
    note(log, "note: single-rank loop: training data_parallel=" +
                  std::to_string(par.data_parallel) + " × pipeline_stage=" +
                  std::to_string(par.pipeline_stage) + " × model_parallel=" +
                  std::to_string(par.model_parallel) +
                  " as the same global batch on one rank (the actor runtime runs the layout)");

  kernels::set_cpu_threads(cfg.runtime.threads);
  std::unique_ptr<kernels::backend> be = kernels::make_backend(cfg.runtime.device);
  auto made = trainer::create(cfg, *be);
  if (!made) return made.err();
  trainer& tr = *made.value();

  train_summary sum;
  if (!opt.resume.empty()) {
    auto dir = checkpoint::resolve(opt.resume);
    if (!dir) return dir.err();
    auto ck = checkpoint::reader::open(dir.value());
    if (!ck) return ck.err();
    if (auto st = check_resume_config(cfg, ck.value(), log); !st) return st.err();
    if (auto st = tr.restore(ck.value()); !st) return st.err();
    sum.first_step = ck->info().next_step;
    note(log, "resumed from " + dir.value() + " at step " + std::to_string(sum.first_step));
  }
  const int total = cfg.train.steps;
  sum.end_step = total;
  if (opt.max_steps >= 0) sum.end_step = std::min(total, sum.first_step + opt.max_steps);

  std::error_code ec;
  fs::create_directories(cfg.runtime.run_dir, ec);
  if (ec)
    return core::error::at_file(cfg.runtime.run_dir, "cannot create the run directory: " + ec.message());
  if (auto st = write_text((fs::path(cfg.runtime.run_dir) / "config.toml").string(), core::to_toml(cfg));
      !st)
    return st.err();
  auto metrics = metrics_writer::open(cfg.runtime.run_dir, sum.first_step);
  if (!metrics) return metrics.err();
  const std::string ckpt_root = cfg.checkpoint.dir.empty()
                                    ? (fs::path(cfg.runtime.run_dir) / "checkpoints").string()
                                    : cfg.checkpoint.dir;

  char head[256];
  std::snprintf(head, sizeof head,
                "training %s: %d layers, hidden %d, %.2fM parameters; %d micro-batches × %d × %d "
                "= %lld tokens per step; steps %d..%d of %d",
                cfg.model.arch == core::arch_kind::gpt2 ? "gpt2" : "llama", cfg.model.num_layers,
                cfg.model.hidden_size, core::parameter_count(cfg.model) / 1e6, tr.micro_batches(),
                par.micro_batch_size, cfg.model.seq_length,
                static_cast<long long>(tr.tokens_per_step()), sum.first_step + 1, sum.end_step,
                total);
  note(log, head);

  const auto t_start = clock_type::now();
  bool graph_noted = false;
  for (int step = sum.first_step; step < sum.end_step; ++step) {
    const auto t0 = clock_type::now();
    const bool replaying = tr.replays_graph();
    auto r = tr.train_step(step);
    if (!r) return r.err();
    if (!tr.graph_note().empty() && !graph_noted) {
      note(log, "note: " + tr.graph_note());
      graph_noted = true;
    }
    if (tr.replays_graph() && !replaying)
      note(log, "note: the step is recorded as a CUDA graph and replayed from step " +
                    std::to_string(step + 1) + " on (runtime.cuda_graph)");
    const double dt = seconds_since(t0);
    sum.seconds += dt;
    sum.losses.push_back(r->loss);
    sum.grad_norms.push_back(r->grad_norm);
    const int done = step + 1;

    step_metrics m;
    m.step = step;
    m.loss = static_cast<float>(r->loss);
    m.lr = static_cast<float>(r->lr);
    m.grad_norm = static_cast<float>(r->grad_norm);
    m.tokens_per_s = static_cast<float>(static_cast<double>(r->tokens) / dt);
    if (tr.scaler().enabled) {
      m.loss_scale = r->loss_scale;
      m.skipped = r->skipped;
      m.next_loss_scale = r->next_loss_scale;
    }
    const bool eval_now = tr.has_validation() &&
                          ((cfg.train.eval_interval > 0 && done % cfg.train.eval_interval == 0) ||
                           done == sum.end_step);
    if (eval_now) {
      sum.final_val_loss = tr.validation_loss();
      m.val_loss = static_cast<float>(*sum.final_val_loss);
    }
    m.elapsed_s = static_cast<float>(seconds_since(t_start));
    if (auto st = metrics->write(m); !st) return st.err();
    const double per_step = sum.seconds / static_cast<double>(done - sum.first_step);
    if (log && (cfg.train.log_interval <= 1 || done % cfg.train.log_interval == 0 || eval_now ||
                done == sum.end_step)) {
      std::fprintf(log, "%s\n", progress_line(m, total, per_step * (sum.end_step - done)).c_str());
      std::fflush(log);
    }

    if ((cfg.checkpoint.interval > 0 && done % cfg.checkpoint.interval == 0) || done == sum.end_step) {
      auto saved = checkpoint::save(ckpt_root, tr.snapshot(done), cfg.checkpoint.keep);
      if (!saved) return saved.err();
      sum.checkpoint = saved.value();
      note(log, "checkpoint " + sum.checkpoint);
    }
  }
  if (sum.first_step >= sum.end_step) note(log, "nothing to do: the run already has all steps");
  return sum;
}

}  // namespace troupe::model
