#include "model/trainer.hpp"

#include <chrono>
#include <cmath>
#include <filesystem>
#include <limits>

#include "model/hf.hpp"
#include "model/metrics.hpp"
#include "model/lora.hpp"
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

/// What a step reports: the optimizer's decision (steps 4-7) and the mean loss (step 8).
step_result result_of(const step_decision& d, double loss, std::int64_t tokens) {
  step_result r;
  r.loss = loss;
  r.grad_norm = d.grad_norm;
  r.clip = d.clip;
  r.lr = d.lr;
  r.tokens = tokens;
  r.skipped = d.skip;
  r.loss_scale = d.loss_scale;
  r.next_loss_scale = d.next_loss_scale;
  return r;
}

}  // namespace

trainer::trainer(const core::config& cfg, kernels::backend& be, loader train)
    : cfg_(cfg), be_(be), train_(std::move(train)), graph_wanted_(cfg.runtime.cuda_graph) {
  // A recorded graph replays the loss gradient's scale it was recorded with; with masked data
  // that scale (1 / the step's trained targets) changes from step to step.
  if (graph_wanted_ && train_.masked() && !be_.dev().is_cpu()) {
    graph_wanted_ = false;
    graph_note_ = "runtime.cuda_graph: instruction data scales the loss gradient by each step's "
                  "count of trained targets, which a recorded graph cannot follow; every kernel "
                  "is launched from the host instead";
  }
  // Dropout keys its masks by the step, an argument each kernel is launched with.
  if (graph_wanted_ && (cfg.model.hidden_dropout > 0 || cfg.model.attention_dropout > 0) &&
      !be_.dev().is_cpu()) {
    graph_wanted_ = false;
    graph_note_ = "runtime.cuda_graph: dropout draws new masks every step (keyed by the step), "
                  "which a recorded graph cannot follow; every kernel is launched from the host "
                  "instead";
  }
}

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
  if (cfg.model.lora.partial()) {
    const base_identity base = identify_base(cfg);
    t->base_source_ = base.source;
    t->base_xxh64_ = base.xxh64;
  }
  t->micro_batches_ = lo.micro_batches;
  t->tokens_per_step_ = static_cast<std::int64_t>(lo.micro_batches) *
                        cfg.parallel.micro_batch_size * cfg.model.seq_length;
  for (const chunk_spec& spec : partition(cfg.model, chunks)) {
    t->chunks_.emplace_back(cfg.model, spec, be, cfg.precision.compute);
    t->chunks_.back().init(cfg.train.seed);
    t->chunks_.back().set_recompute(cfg.recompute.mode, core::recompute_layers(cfg),
                                    core::keep_gelu_layers(cfg));
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
  for (chunk& c : chunks_)
    if (c.shares_head()) {  // 3, one chunk holding both uses: the sum alone
      tensor g_wte = c.grad(embedding_name(cfg_.model)), g_head = c.grad("lm_head.weight");
      tie_gradients(be_, g_wte, g_head, false);
    }
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
  const std::int64_t trained = trained_targets(step);
  const float grad_scale = loss_grad_scale(scaler_.scale, trained);
  double loss_total = 0;
  for (int mb = 0; mb < micro_batches_; ++mb) {  // 2
    batch b = train_.cut(static_cast<std::uint64_t>(step), 0, mb);
    tensor x = to_device(b.tokens);
    tensor targets = to_device(b.targets);
    const dropout_ctx drop = dropout_of(step, mb);
    for (std::size_t i = 0; i + 1 < chunks_.size(); ++i)
      x = chunks_[i].forward(mb, x, {}, 0, drop, b.doc_starts);
    chunks_.back().forward(mb, x, targets, grad_scale, drop, b.doc_starts);
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

  return result_of(d, loss_total / static_cast<double>(trained), tokens_per_step_);
}

std::int64_t trainer::trained_targets(int step) const {
  return train_.trained_targets(static_cast<std::uint64_t>(step),
                                static_cast<std::uint64_t>(micro_batches_) *
                                    static_cast<std::uint64_t>(cfg_.parallel.micro_batch_size));
}

dropout_ctx trainer::dropout_of(int step, int mb) const {
  return training_dropout(cfg_.model, cfg_.train.seed, step,
                          static_cast<std::int64_t>(mb) * cfg_.parallel.micro_batch_size);
}

void trainer::queue_device_step(int step, std::int64_t trained) {
  const float grad_scale = loss_grad_scale(1.0f, trained);
  for (chunk& c : chunks_) c.zero_grads();  // 1
  begin_device_step(be_, clip_);
  for (int mb = 0; mb < micro_batches_; ++mb) {  // 2
    tensor x = inputs_[static_cast<std::size_t>(mb)].tokens;
    const dropout_ctx drop = dropout_of(step, mb);
    const tensor& docs = inputs_[static_cast<std::size_t>(mb)].doc_starts;
    for (std::size_t i = 0; i + 1 < chunks_.size(); ++i)
      x = chunks_[i].forward(mb, x, {}, 0, drop, docs);
    chunks_.back().forward(mb, x, inputs_[static_cast<std::size_t>(mb)].targets, grad_scale, drop,
                           docs);
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
      inputs_.push_back(
          {be_.empty({rows}, core::dtype::i32), be_.empty({rows}, core::dtype::i32), {}});
    }
  }
  for (int mb = 0; mb < micro_batches_; ++mb) {
    batch b = train_.cut(static_cast<std::uint64_t>(step), 0, mb);
    be_.copy(b.tokens.reshape({b.tokens.numel()}), inputs_[static_cast<std::size_t>(mb)].tokens);
    be_.copy(b.targets.reshape({b.targets.numel()}),
             inputs_[static_cast<std::size_t>(mb)].targets);
    inputs_[static_cast<std::size_t>(mb)].doc_starts = b.doc_starts;
  }
  const std::int64_t trained = trained_targets(step);
  step_decision d;
  d.lr = learning_rate(cfg_.optimizer, cfg_.train, step);  // 6
  d.adam_step = scaler_.adam_step(step);
  set_adamw_schedule(be_, cfg_.optimizer, d.lr, d.adam_step, clip_);

  if (graph_ready_) {
    be_.graph_replay(graph_id_);
  } else if (graph_wanted_ && steps_queued_ >= 1 && (graph_id_ = be_.graph_begin()) != 0) {
    // The second step is recorded: the first filled the allocator's cache and chose the GEMMs.
    try {
      queue_device_step(step, trained);
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
      queue_device_step(step, trained);
  } else {
    queue_device_step(step, trained);
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
  r.loss = loss_total / static_cast<double>(trained);  // 8
  r.grad_norm = c.grad_norm;
  r.clip = static_cast<float>(c.clip);
  r.lr = d.lr;
  r.tokens = tokens_per_step_;
  r.loss_scale = 1.0f;
  r.next_loss_scale = 1.0f;
  return r;
}

void trainer::inject_faults(int step, int mb) {
  // TROUPE_FAULT=poison: the loss of the fault's global sequence (global micro-batch mb holds
  // sequences mb·B … mb·B+B-1), as the actor runtime's stage writes it.
  if (!fault_ || fault_->kind != core::fault_kind::poison || step != fault_->step) return;
  const std::int64_t B = cfg_.parallel.micro_batch_size;
  if (fault_->sequence / B != mb) return;
  tensor rows = chunks_.back().loss_rows(mb);
  tensor bad = tensor::zeros({1}, core::dtype::f32);
  bad.data<float>()[0] = static_cast<float>(fault_->loss);
  tensor dst = rows.slice((fault_->sequence % B) * cfg_.model.seq_length, {1});
  be_.copy(to_device(bad), dst);
}

void trainer::inject_nan(int step) {
  // TROUPE_FAULT=nan:0:STEP: a NaN in the middle element of chunk 0's middle parameter, once.
  if (!fault_ || fault_->kind != core::fault_kind::nan || fault_->rank != 0 || nan_injected_ ||
      step != fault_->step)
    return;
  nan_injected_ = true;
  const auto& params = chunks_.front().params();
  const param_info& p = params.at(params.size() / 2);
  tensor nan = tensor::zeros({1}, core::dtype::f32);
  nan.data<float>()[0] = std::numeric_limits<float>::quiet_NaN();
  tensor dst = chunks_.front().flat_grads().slice(p.offset + p.numel / 2, {1});
  be_.copy(to_device(nan), dst);
}

trainer::execution trainer::execute(int step, bool again) {
  execution e;
  for (chunk& c : chunks_) c.zero_grads();  // 1
  const float grad_scale = loss_grad_scale(scaler_.scale, trained_targets(step));
  for (int mb = 0; mb < micro_batches_; ++mb) {  // 2, backward included whatever the loss
    batch b = train_.cut(static_cast<std::uint64_t>(step), 0, mb);
    tensor x = to_device(b.tokens);
    tensor targets = to_device(b.targets);
    const dropout_ctx drop = dropout_of(step, mb);
    for (std::size_t i = 0; i + 1 < chunks_.size(); ++i) x = chunks_[i].forward(mb, x, {}, 0, drop);
    chunks_.back().forward(mb, x, targets, grad_scale, drop);
    inject_faults(step, mb);
    e.mb_losses.push_back(chunks_.back().loss_sum(mb));
    if (again) {
      auto q = sequence_loss_sums(be_, chunks_.back().loss_rows(mb), cfg_.parallel.micro_batch_size);
      e.seq_losses.insert(e.seq_losses.end(), q.begin(), q.end());
    }
    tensor g;
    for (std::size_t i = chunks_.size(); i-- > 0;) g = chunks_[i].backward(mb, g);
  }
  inject_nan(step);
  e.slots = all_slots();
  tie(e.slots);  // 3
  e.sumsq = gradient_sumsq(be_, e.slots);
  e.print.losses = e.mb_losses;
  for (chunk& c : chunks_) e.print.grads.push_back(be_.message_hash_async(c.flat_grads())->get());
  return e;
}

core::result<step_result> trainer::examined_step(int step, loss_history& history, std::FILE* log,
                                                 std::string& field) {
  auto say = [&](const std::string& text) {
    if (!log) return;
    std::fprintf(log, "%s\n", text.c_str());
    std::fflush(log);
  };
  // Micro-batches per replica: sequences are named as the actor runtime names them.
  const int per_replica = cfg_.parallel.micro_batch_num * cfg_.train.gradient_accumulation_steps;
  const std::int64_t trained = trained_targets(step);
  auto suspect = [&](const execution& x) {
    double total = 0;
    for (double l : x.mb_losses) total += l;
    const std::string grad_note =
        scaler_.enabled || std::isfinite(x.sumsq.value()) ? "" : " (its norm is not finite)";
    return suspicion(cfg_.runtime, step, x.mb_losses, per_replica,
                     total / static_cast<double>(trained), grad_note, history);
  };
  execution e = execute(step, false);
  std::string why = suspect(e);
  const step_fingerprint first = e.print;
  step_fingerprint last = e.print;
  bool skip = false;
  int executions = 1;
  if (!why.empty())
    say("step forensics: " + why + "; executing step " + std::to_string(step) +
        " again from the state before it");
  while (!why.empty()) {
    execution again = execute(step, true);
    ++executions;
    if (again.print.same_bits(last)) {
      std::string json;
      const std::string names =
          name_sequences(&train_, step, again.seq_losses, cfg_.parallel.micro_batch_size,
                         per_replica, cfg_.runtime.forensics_loss_jump, history.reference(), json);
      skip = forensics_of(cfg_.runtime) == forensics_mode::skip;
      field = forensics_field(step, why, "deterministic", skip ? "skip" : "stop", executions, first,
                              again.print, json);
      const std::string text = deterministic_text(step, why, again.print, names);
      if (!skip)
        return core::error::make(text + "\nthe parameters were not updated",
                                 "look at the data at these positions; set runtime.forensics = "
                                 "\"skip\" to train past such a step, then resume from the last "
                                 "checkpoint with --resume");
      say(text + "\nthe step is skipped (runtime.forensics = \"skip\"): no parameter, moment or "
                 "AdamW count changes at it");
      e = std::move(again);
      break;
    }
    field = forensics_field(step, why, "transient", "retry", executions, first, again.print, "");
    const std::string still = suspect(again);
    say(transient_text(step, why, last, again.print, still));
    e = std::move(again);
    if (still.empty()) break;
    if (executions >= max_executions) return recurring_error(step, executions, still);
    why = still;
    last = e.print;
  }
  step_decision d;
  if (skip) {
    d.grad_norm = e.sumsq.value() / (scaler_.enabled ? scaler_.scale : 1.0f);
    d.lr = learning_rate(cfg_.optimizer, cfg_.train, step);
    d.skip = true;
    d.adam_step = scaler_.adam_step(step);
    d.loss_scale = d.next_loss_scale = scaler_.scale;
  } else {
    // 4-7 on the host: the bits of clip_and_update_on_device (model/optimizer.hpp)
    d = decide_step(e.sumsq, scaler_, cfg_.optimizer, cfg_.train, step);
    if (!d.skip) adamw_update_t(be_, e.slots, cfg_.optimizer, d.lr, d.grad_scale, d.adam_step);
  }
  double loss_total = 0;
  for (double l : e.mb_losses) loss_total += l;
  step_result r = result_of(d, loss_total / static_cast<double>(trained), tokens_per_step_);
  if (!d.skip) history.accept(r.loss);
  return r;
}

double trainer::validation_loss() {
  std::vector<chunk*> chunks;
  for (chunk& c : chunks_) chunks.push_back(&c);
  return model::validation_loss(*val_, cfg_.train.eval_batches, be_, std::move(chunks));
}

checkpoint::save_request trainer::snapshot(int steps_done) {
  checkpoint::save_request req;
  req.step = steps_done;
  req.seed = cfg_.train.seed;
  req.config_toml = core::to_toml(cfg_);
  req.base_source = base_source_;
  req.base_xxh64 = base_xxh64_;
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

core::status trainer::load_init() {
  auto w = hf::weights::open(cfg_.model.init, cfg_.model, cfg_.source);
  if (!w) return w.err();
  for (chunk& c : chunks_)
    if (auto st = hf::load_chunk(*w.value(), be_, cfg_.model, c); !st) return st;
  return {};
}

core::status trainer::restore(const checkpoint::reader& ck) {
  for (std::size_t i = 0; i < chunks_.size(); ++i) {
    if (auto st = hf::load_frozen_base(cfg_, be_, chunks_[i]); !st) return st;
    if (auto st = checkpoint::restore(ck, be_, cfg_.model, chunks_[i], &states_[i]); !st)
      return st;
  }
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
                  (par.sequence_parallel ? " (sequence_parallel)" : "") +
                  " as the same global batch on one rank (the actor runtime runs the layout)");

  if (cfg.optimizer.offload) {
    core::error e = core::error::make(
        "optimizer.offload = true needs the actor runtime: its optimizer shards keep the master "
        "weights and moments in host memory; the single-rank loop (--single-rank) keeps them on "
        "the device",
        "drop --single-rank (troupe train runs the actor runtime by default, with the same bits), "
        "or set optimizer.offload = false");
    e.where.file = cfg.source;
    e.where.key = "optimizer.offload";
    return e;
  }
  kernels::set_cpu_threads(cfg.runtime.threads);
  kernels::set_gemm_tune_file(cfg.runtime.gemm_tune_file);
  std::unique_ptr<kernels::backend> be = kernels::make_backend(cfg.runtime.device);
  auto made = trainer::create(cfg, *be);
  if (!made) return made.err();
  trainer& tr = *made.value();
  if (opt.fault) tr.inject(*opt.fault);
  const bool forensics = forensics_of(cfg.runtime) != forensics_mode::off;
  loss_history history;

  auto start = open_run(cfg, opt.resume, opt.max_steps, true, log);
  if (!start) return start.err();
  if (start->resume) {
    if (auto st = tr.restore(*start->resume); !st) return st.err();
  } else if (!cfg.model.init.empty()) {
    if (auto st = tr.load_init(); !st) return st.err();
  }
  auto run = run_log::open(cfg, start.value(), log);
  if (!run) return run.err();
  for (auto& h : opt.step_hooks) run->add_step_hook(h);
  const int total = cfg.train.steps;
  const int first_step = start->first_step, end_step = start->end_step;

  char head[256];
  std::snprintf(head, sizeof head,
                "training %s: %d layers, hidden %d, %.2fM parameters; %d micro-batches × %d × %d "
                "= %lld tokens per step; steps %d..%d of %d",
                cfg.model.arch == core::arch_kind::gpt2 ? "gpt2" : "llama", cfg.model.num_layers,
                cfg.model.hidden_size, core::parameter_count(cfg.model) / 1e6, tr.micro_batches(),
                par.micro_batch_size, cfg.model.seq_length,
                static_cast<long long>(tr.tokens_per_step()), first_step + 1, end_step, total);
  note(log, head);

  bool graph_noted = false;
  for (int step = first_step; step < end_step; ++step) {
    const auto t0 = clock_type::now();
    const bool replaying = tr.replays_graph();
    std::string examined;  // the metrics line's "forensics" field
    auto r = forensics ? tr.examined_step(step, history, log, examined) : tr.train_step(step);
    if (!r) {
      if (!examined.empty())
        if (auto st = run->event(step, examined); !st) return st.err();
      return r.err();
    }
    if (!tr.graph_note().empty() && !graph_noted) {
      note(log, "note: " + tr.graph_note());
      graph_noted = true;
    }
    if (tr.replays_graph() && !replaying)
      note(log, "note: the step is recorded as a CUDA graph and replayed from step " +
                    std::to_string(step + 1) + " on (runtime.cuda_graph)");
    step_outcome o;
    o.seconds = seconds_since(t0);
    o.step = step;
    o.loss = r->loss;
    o.grad_norm = r->grad_norm;
    o.lr = r->lr;
    o.tokens = r->tokens;
    o.scaled = tr.scaler().enabled;
    o.loss_scale = r->loss_scale;
    o.skipped = r->skipped;
    o.next_loss_scale = r->next_loss_scale;
    const step_cadence due = cadence(cfg, step + 1, end_step, tr.has_validation());
    if (due.evaluate) {
      try {
        o.val_loss = tr.validation_loss();
      } catch (const core::failure& e) {
        return core::error::make("the evaluation after step " + std::to_string(step) +
                                     " failed: " + e.what(),
                                 "check data.val; resume from the last checkpoint with --resume");
      }
    }
    std::string extra;  // the device's peak memory so far, for bench/train_bench.py
    if (const std::uint64_t peak = be->peak_memory_bytes(); peak > 0)
      extra = "\"peak_device_bytes\":" + std::to_string(peak);
    if (!examined.empty()) extra += (extra.empty() ? "" : ",") + examined;
    if (auto st = run->step_end(o, extra); !st) return st.err();
    if (due.checkpoint) {
      auto saved = checkpoint::save(start->ckpt_root, tr.snapshot(step + 1), cfg.checkpoint.keep);
      if (!saved) return saved.err();
      run->checkpoint_written(saved.value());
    }
  }
  return run->finish();
}

}  // namespace troupe::model
