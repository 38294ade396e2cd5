#include "actors/coordinator_engine.hpp"

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>

#include "kernels/select.hpp"
#include "schedules/schedule.hpp"
#include "model/hf.hpp"
#include "model/params.hpp"
#include "model/tensor_parallel.hpp"

namespace troupe::actors {

const char* phase_name(coordinator_phase p) {
  switch (p) {
    case coordinator_phase::idle: return "idle";
    case coordinator_phase::gathering: return "gathering";
    case coordinator_phase::reexecuting: return "re-executing";
    case coordinator_phase::updating: return "updating";
    case coordinator_phase::evaluating: return "evaluating";
    case coordinator_phase::finishing: return "finishing";
    case coordinator_phase::stopped: return "stopped";
  }
  return "?";
}

core::error failure_error(const actor_failure& f) {
  std::string where = f.actor + " (rank " + std::to_string(f.rank) + ")";
  if (f.step >= 0) where += " at step " + std::to_string(f.step);
  if (!f.instruction.empty()) where += ", instruction " + f.instruction;
  core::error e = core::error::make(where + " failed: " + f.what,
                                    "the job was stopped; fix the cause and resume from the "
                                    "last checkpoint with --resume");
  e.where.rank = f.rank;
  return e;
}

coordinator_engine::coordinator_engine(const core::config& cfg, job_layout layout,
                                       coordinator_plan plan, std::FILE* log,
                                       std::chrono::milliseconds watchdog)
    : cfg_(cfg), layout_(layout), plan_(std::move(plan)), log_(log), watchdog_(watchdog) {
  step_ = plan_.first_step;
  scaler_ = plan_.scaler ? *plan_.scaler : model::loss_scaler::from(cfg_.precision, plan_.first_step);
  if (plan_.val) {
    be_ = kernels::make_backend(cfg_.runtime.device);
    eval_model_ = std::make_unique<model::chunk>(cfg_.model, model::partition(cfg_.model, 1)[0],
                                                 *be_, cfg_.precision.compute);
    // Evaluation forwards keep nothing for a backward: the copy holds its weights (no gradients:
    // model::chunk makes them on first use) and one layer's work at a time, not a training
    // micro-batch's saved activations (plan::dry_run counts the same).
    eval_model_->set_recompute(core::recompute_mode::full);
    // Snapshots carry the trainable parameters only; frozen base weights ([lora]) are the
    // stages' own start, made the same way: the seeded initialisation, or model.init's weights.
    if (!eval_model_->frozen_params().empty()) {
      eval_model_->init(cfg_.train.seed);
      if (auto st = model::hf::load_frozen_base(cfg_, *be_, *eval_model_); !st)
        setup_error_ = st.err();
    }
  }
}

std::vector<coordinator_command> coordinator_engine::take_commands() {
  std::vector<coordinator_command> out;
  out.swap(out_);
  return out;
}

void coordinator_engine::fail(core::error e) {
  if (phase_ == coordinator_phase::stopped) return;
  phase_ = coordinator_phase::stopped;
  close_trace();
  out_.clear();
  outcome_ = core::result<model::train_summary>(std::move(e));
}

void coordinator_engine::start(std::map<int, std::string> hosts) {
  if (phase_ != coordinator_phase::idle) return;
  hosts_ = std::move(hosts);
  if (setup_error_) return fail(*setup_error_);
  model::run_start rs;
  rs.first_step = plan_.first_step;
  rs.end_step = plan_.end_step;
  rs.restarts = plan_.restarts;
  auto run = model::run_log::open(cfg_, rs, log_);
  if (!run) return fail(run.err());
  run_.emplace(std::move(run.value()));
  for (auto& h : plan_.step_hooks) run_->add_step_hook(h);
  const std::string trace_path = cfg_.runtime.run_dir + "/trace.json";
  // Sealed: valid JSON after every step's write, however the run stops (docs/input.md).
  auto trace = core::sealed_file::create(trace_path, "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[",
                                         "\n]}\n");
  if (!trace) return fail(trace.err());
  trace_ = std::move(trace.value());
  if (plan_.first_step >= plan_.end_step) return complete();
  begin_step(plan_.first_step);
}

void coordinator_engine::begin_step(std::int64_t step) {
  phase_ = coordinator_phase::gathering;
  step_ = step;
  losses_.clear();
  norms_.clear();
  nonfinite_.clear();
  seq_losses_.clear();
  grad_hashes_.clear();
  executions_ = 1;
  forensics_fields_.clear();
  reports_.clear();
  shard_reports_ = 0;
  t_step_ = clock::now();
  last_progress_ = t_step_;
  out_.push_back(begin_step_cmd{step, scaler_.scale});
}

int coordinator_engine::expected_norm_parts() const {
  return layout_.chunks() * (layout_.zero_stage == 0 ? 1 : layout_.dp) * layout_.tp;
}

void coordinator_engine::on_loss(loss_report r) {
  if (phase_ == coordinator_phase::stopped) return;
  progressed();
  losses_[r.dp] = std::move(r.mb_loss_sums);
  seq_losses_[r.dp] = std::move(r.seq_loss_sums);
  maybe_decide();
}

void coordinator_engine::on_norm(norm_part n) {
  if (phase_ == coordinator_phase::stopped) return;
  progressed();
  if (n.sumsq.size() != static_cast<std::size_t>(core::exact_sum_words))
    return fail(core::error::make(
        "the gradient-norm sum of chunk " + std::to_string(n.chunk) + ", shard " +
            std::to_string(n.part) + " at step " + std::to_string(n.step) + " has " +
            std::to_string(n.sumsq.size()) + " words, expected " +
            std::to_string(core::exact_sum_words),
        "every worker must run the same troupe build; rebuild and relaunch"));
  norms_[{n.chunk, n.part}] = std::move(n.sumsq);
  grad_hashes_[{n.chunk, n.part}] = n.grad_hash;
  if (!n.nonfinite.empty() && nonfinite_.empty()) nonfinite_ = std::move(n.nonfinite);
  maybe_decide();
}

void coordinator_engine::maybe_decide() {
  if (phase_ != coordinator_phase::gathering || static_cast<int>(losses_.size()) < layout_.dp ||
      static_cast<int>(norms_.size()) < expected_norm_parts())
    return;
  const bool forensics = model::forensics_of(cfg_.runtime) != model::forensics_mode::off;
  if (!forensics)
    for (auto& [d, l] : losses_)
      for (std::size_t mb = 0; mb < l.size(); ++mb)
        if (!std::isfinite(l[mb]))
          return fail(core::error::make(
              "the loss is " + std::string(std::isnan(l[mb]) ? "NaN" : "infinite") + " at step " +
                  std::to_string(step_) + ", micro-batch " + std::to_string(mb) + " (replica " +
                  std::to_string(d) + "); the parameters were not updated",
              "lower optimizer.lr, raise train.warmup_steps or set train.grad_clip; resume from "
              "the last checkpoint with --resume"));
  core::exact_sum sumsq;
  for (auto& [key, w] : norms_) sumsq.merge(w.data());
  model::step_decision d;
  if (forensics) {
    if (!investigate(d, sumsq)) return;
  } else {
    // The single-rank trainer decides with the same function (or, without loss scaling, the
    // same arithmetic on the device): same norm, clip, lr, skip, scale.
    d = model::decide_step(sumsq, scaler_, cfg_.optimizer, cfg_.train, static_cast<int>(step_));
  }
  // Whose gradient it was, as the optimizer shards found it.
  const std::string culprit = nonfinite_.empty() ? std::string() : ": " + nonfinite_;
  if (!d.skip && !std::isfinite(d.grad_norm) && !forensics)
    // Without dynamic loss scaling a non-finite gradient would poison every parameter.
    return fail(core::error::make(
        "the gradient norm is " + std::string(std::isnan(d.grad_norm) ? "NaN" : "infinite") +
            " at step " + std::to_string(step_) + culprit + "; the parameters were not updated",
        "lower optimizer.lr or set train.grad_clip; with fp16 turn on "
        "precision.dynamic_loss_scale; resume from the last checkpoint with --resume"));
  if (d.skip && scaler_.enabled && forensics_fields_.find("\"skip\"") == std::string::npos &&
      log_) {
    std::fprintf(log_,
                 "the gradient is not finite at step %lld%s; the step is skipped (dynamic loss "
                 "scaling), loss scale %g -> %g\n",
                 static_cast<long long>(step_), culprit.c_str(), static_cast<double>(d.loss_scale),
                 static_cast<double>(d.next_loss_scale));
    std::fflush(log_);
  }
  decision_ = d;
  phase_ = coordinator_phase::updating;
  out_.push_back(clip_decision{step_, d.grad_scale, d.lr, d.adam_step, d.skip, d.loss_scale});
  maybe_finish_step();  // reports cannot come before the decision, but keep the check in one place
}

bool coordinator_engine::investigate(model::step_decision& d, const core::exact_sum& sumsq) {
  model::step_fingerprint print;
  double total = 0;
  for (auto& [dp, l] : losses_) {
    print.losses.insert(print.losses.end(), l.begin(), l.end());
    for (double x : l) total += x;
  }
  for (auto& [key, h] : grad_hashes_) print.grads.push_back(h);
  const std::int64_t sequences = static_cast<std::int64_t>(layout_.dp) * layout_.microbatches *
                                 cfg_.parallel.micro_batch_size;
  const std::int64_t trained =
      plan_.train ? plan_.train->trained_targets(static_cast<std::uint64_t>(step_),
                                                 static_cast<std::uint64_t>(sequences))
                  : sequences * cfg_.model.seq_length;
  // Under dynamic loss scaling a non-finite gradient is the scaler's to handle (a skipped step).
  const std::string grad_note =
      scaler_.enabled || std::isfinite(sumsq.value()) ? ""
      : nonfinite_.empty()                              ? std::string(" (its norm is not finite)")
                                                        : ": " + nonfinite_;
  const std::string why =
      model::suspicion(cfg_.runtime, step_, print.losses, layout_.microbatches,
                       total / static_cast<double>(trained), grad_note, history_);
  auto decide = [&] {
    d = model::decide_step(sumsq, scaler_, cfg_.optimizer, cfg_.train, static_cast<int>(step_));
    return true;
  };
  auto say = [&](const std::string& text) {
    if (!log_) return;
    std::fprintf(log_, "%s\n", text.c_str());
    std::fflush(log_);
  };
  if (executions_ == 1) {
    if (why.empty()) return decide();
    why_ = why;
    first_print_ = last_print_ = print;
    say("step forensics: " + why + "; executing step " + std::to_string(step_) +
        " again from the state before it");
    reexecute();
    return false;
  }
  if (print.same_bits(last_print_)) {
    // Deterministic: the step's own data produced it.
    std::vector<double> seqs;
    for (auto& [dp, q] : seq_losses_) seqs.insert(seqs.end(), q.begin(), q.end());
    std::string json;
    const std::string names = model::name_sequences(
        plan_.train.get(), step_, seqs, cfg_.parallel.micro_batch_size, layout_.microbatches,
        cfg_.runtime.forensics_loss_jump, history_.reference(), json);
    const bool skip = model::forensics_of(cfg_.runtime) == model::forensics_mode::skip;
    const std::string field = model::forensics_field(step_, why_, "deterministic",
                                                     skip ? "skip" : "stop", executions_,
                                                     first_print_, print, json);
    const std::string text = model::deterministic_text(step_, why_, print, names);
    if (!skip) {
      if (auto st = run_->event(static_cast<int>(step_), field); !st) return fail(st.err()), false;
      fail(core::error::make(text + "\nthe parameters were not updated",
                             "look at the data at these positions; set runtime.forensics = "
                             "\"skip\" to train past such a step, then resume from the last "
                             "checkpoint with --resume"));
      return false;
    }
    say(text + "\nthe step is skipped (runtime.forensics = \"skip\"): no parameter, moment or "
               "AdamW count changes at it");
    forensics_fields_ = field;
    d = model::step_decision{};
    d.grad_norm = sumsq.value() / (scaler_.enabled ? scaler_.scale : 1.0f);
    d.lr = model::learning_rate(cfg_.optimizer, cfg_.train, static_cast<int>(step_));
    d.skip = true;
    d.adam_step = scaler_.adam_step(static_cast<int>(step_));
    d.loss_scale = d.next_loss_scale = scaler_.scale;
    return true;
  }
  // Transient: the same inputs and state gave other bits.
  forensics_fields_ = model::forensics_field(step_, why_, "transient", "retry", executions_,
                                             first_print_, print, "");
  say(model::transient_text(step_, why_, last_print_, print, why));
  if (why.empty()) return decide();
  if (executions_ >= model::max_executions)
    return fail(model::recurring_error(step_, executions_, why)), false;
  why_ = why;
  last_print_ = print;
  reexecute();
  return false;
}

void coordinator_engine::reexecute() {
  ++executions_;
  forgotten_ = 0;
  losses_.clear();
  norms_.clear();
  nonfinite_.clear();
  seq_losses_.clear();
  grad_hashes_.clear();
  phase_ = coordinator_phase::reexecuting;
  out_.push_back(forget_cmd{step_});
}

void coordinator_engine::on_forgotten(std::int64_t step, int pp, int part) {
  (void)pp;
  (void)part;
  if (phase_ != coordinator_phase::reexecuting || step != step_) return;
  progressed();
  if (++forgotten_ < layout_.pp * layout_.dp * layout_.tp) return;
  phase_ = coordinator_phase::gathering;
  out_.push_back(reexecute_cmd{step_, scaler_.scale});
}

void coordinator_engine::on_shard_report(const shard_report& r) {
  if (phase_ == coordinator_phase::stopped) return;
  progressed();
  ++shard_reports_;
  shard_bytes_[{r.pp, r.part}] = r.state_bytes;
  shard_peak_[{r.pp, r.part}] = r.peak_device_bytes;
  maybe_finish_step();
}

void coordinator_engine::on_stage_report(stage_report r) {
  if (phase_ == coordinator_phase::stopped) return;
  progressed();
  reports_.push_back(std::move(r));
  maybe_finish_step();
}

void coordinator_engine::maybe_finish_step() {
  if (phase_ != coordinator_phase::updating ||
      static_cast<int>(reports_.size()) < layout_.workers() ||
      shard_reports_ < layout_.pp * layout_.dp * layout_.tp)
    return;
  model::step_outcome o;
  o.seconds = std::chrono::duration<double>(clock::now() - t_step_).count();
  double loss_total = 0;
  for (auto& [d, l] : losses_)
    for (double x : l) loss_total += x;
  o.tokens = static_cast<std::int64_t>(layout_.dp) * layout_.microbatches *
             cfg_.parallel.micro_batch_size * cfg_.model.seq_length;
  o.step = static_cast<int>(step_);
  // The mean over the step's trained targets, counted as the last stages counted them.
  const std::int64_t trained =
      plan_.train ? plan_.train->trained_targets(
                        static_cast<std::uint64_t>(step_),
                        static_cast<std::uint64_t>(layout_.dp) *
                            static_cast<std::uint64_t>(layout_.microbatches) *
                            static_cast<std::uint64_t>(cfg_.parallel.micro_batch_size))
                  : o.tokens;
  o.loss = loss_total / static_cast<double>(trained);
  o.grad_norm = decision_.grad_norm;
  o.lr = decision_.lr;
  if (scaler_.enabled) {
    o.scaled = true;
    o.loss_scale = decision_.loss_scale;
    o.skipped = decision_.skip;
    o.next_loss_scale = decision_.next_loss_scale;
  }
  pending_fields_ = stage_fields() + skew_fields();
  if (!forensics_fields_.empty()) pending_fields_ += "," + forensics_fields_;
  if (!decision_.skip) history_.accept(o.loss);
  if (decision_.skip && !nonfinite_.empty())
    pending_fields_ += ",\"nonfinite\":" + nlohmann::json(nonfinite_).dump();
  write_trace();

  const int done = static_cast<int>(step_) + 1;
  const model::step_cadence due = model::cadence(cfg_, done, plan_.end_step, plan_.val != nullptr);
  const std::int32_t dests = (due.checkpoint ? to_writer : 0) | (due.evaluate ? to_coordinator : 0);
  if (dests) out_.push_back(snapshot_cmd{step_, dests});
  if (due.checkpoint) {
    ++pending_checkpoints_;
    // The loss scaler's state after this step travels with the checkpoint (empty when off).
    out_.push_back(checkpoint_cmd{step_, scaler_.enabled ? scaler_.to_vector() : std::vector<double>{}});
  }
  if (due.evaluate) {
    phase_ = coordinator_phase::evaluating;
    pending_ = o;
    return;
  }
  record_step(o);
}

void coordinator_engine::on_snapshot(int chunk, int tp, core::tensor params) {
  if (phase_ == coordinator_phase::stopped) return;
  progressed();
  snapshot_[{chunk, tp}] = std::move(params);
  if (phase_ != coordinator_phase::evaluating ||
      static_cast<int>(snapshot_.size()) < layout_.chunks() * layout_.tp)
    return;
  evaluate();
}

void coordinator_engine::evaluate() {
  model::step_outcome o = *pending_;
  pending_.reset();
  try {
    auto specs = model::partition(cfg_);
    for (int c = 0; c < layout_.chunks(); ++c) {
      const auto defs = model::define_params(cfg_.model, specs[c], layout_.tp);
      for (std::size_t i = 0; i < defs.size(); ++i) {
        core::tensor dst = eval_model_->param(defs[i].info.name);
        be_->copy(model::unshard_param(cfg_.model, defs, i, layout_.tp,
                                       [&](int t) -> const core::tensor& { return snapshot_.at({c, t}); }),
                  dst);
      }
    }
    snapshot_.clear();
    eval_model_->params_updated();
    o.val_loss = model::validation_loss(*plan_.val, cfg_.train.eval_batches, *be_, {eval_model_.get()});
    if (const std::uint64_t peak = be_->peak_memory_bytes(); peak > 0)
      pending_fields_ += std::string(pending_fields_.empty() ? "" : ",") +
                         "\"evaluation_peak_device_bytes\":" + std::to_string(peak);
  } catch (const std::exception& e) {
    return fail(failure_error(
        actor_failure{actor_name(address{role::coordinator, 0, 0}), 0, step_, "evaluation", e.what()}));
  }
  record_step(o);
}

void coordinator_engine::record_step(const model::step_outcome& o) {
  if (auto st = run_->step_end(o, pending_fields_); !st) return fail(st.err());
  next_or_finish();
}

void coordinator_engine::next_or_finish() {
  if (step_ + 1 < plan_.end_step && step_ != plan_.halt_after) return begin_step(step_ + 1);
  phase_ = coordinator_phase::finishing;
  if (pending_checkpoints_ == 0) complete();
}

void coordinator_engine::on_checkpoint(const checkpoint_written& w) {
  if (phase_ == coordinator_phase::stopped) return;
  --pending_checkpoints_;
  if (!w.error.empty())
    return fail(core::error::make("the checkpoint of step " + std::to_string(w.step + 1) +
                                      " could not be written: " + w.error,
                                  "check checkpoint.dir: free space and permissions"));
  run_->checkpoint_written(w.path);
  if (phase_ == coordinator_phase::finishing && pending_checkpoints_ == 0) complete();
}

void coordinator_engine::complete() {
  print_memory();
  close_trace();
  phase_ = coordinator_phase::stopped;
  outcome_ = core::result<model::train_summary>(run_->finish());
}

void coordinator_engine::close_trace() { trace_.close(); }

namespace {

/// Bytes of the fp32 parameter buffer of pipeline rank p's chunks on tensor-parallel rank t: the
/// flat buffers model::chunk allocates (its slices under tensor parallel, model::shard_defs).
/// The gradient buffer is as large; AdamW's two moments are twice it, split over the ZeRO shards.
std::uint64_t stage_param_bytes(const core::config& cfg, const job_layout& l, int p, int t) {
  const auto specs = model::partition(cfg);
  std::uint64_t n = 0;
  for (int i = 0; i < l.v; ++i) {
    auto defs = model::define_params(cfg.model, specs[l.chunk_of(p, i)], l.tp);
    if (l.tp > 1) defs = model::shard_defs(cfg.model, std::move(defs), l.tp, t);
    n += static_cast<std::uint64_t>(model::flat_numel(defs));
  }
  return n * sizeof(float);
}

}  // namespace

/// The metrics line's `"device_costs"`: each chunk's mean F, B, I and W on the device this step,
/// in ms (over its micro-batches and replicas), as arrays indexed by chunk id with null where the
/// chunk ran none; only the kinds the schedule has. `troupe schedule simulate --costs-from` reads
/// them back, so the simulator predicts this run's bubble from its own costs.
std::string coordinator_engine::device_costs() const {
  const int chunks = layout_.pp * layout_.v;
  constexpr schedules::op_kind kinds[] = {schedules::op_kind::F, schedules::op_kind::B,
                                          schedules::op_kind::I, schedules::op_kind::W};
  std::vector<std::array<double, 4>> sum(chunks, {0, 0, 0, 0});
  std::vector<std::array<int, 4>> count(chunks, {0, 0, 0, 0});
  for (const auto& r : reports_)
    for (const auto& e : r.device_events) {
      auto op = schedules::parse_instruction(e.name);
      if (!op || op->chunk < 0 || op->chunk >= chunks) continue;
      for (int k = 0; k < 4; ++k)
        if (op->kind == kinds[k]) {
          sum[op->chunk][k] += e.dur_us * 1e-3;
          ++count[op->chunk][k];
        }
    }
  nlohmann::json out = nlohmann::json::object();
  constexpr const char* names[] = {"f", "b", "i", "w"};
  for (int k = 0; k < 4; ++k) {
    nlohmann::json a = nlohmann::json::array();
    bool any = false;
    for (int c = 0; c < chunks; ++c) {
      if (count[c][k] == 0) {
        a.push_back(nullptr);
        continue;
      }
      a.push_back(sum[c][k] / count[c][k]);
      any = true;
    }
    if (any) out[names[k]] = std::move(a);
  }
  return out.empty() ? "" : ",\"device_costs\":" + out.dump();
}

/// Per-stage busy / communicating / waiting and the bubble fraction of this step, measured like
/// the simulator: idle time of each stage within the span of the step's instructions. The
/// metrics line's fields `"bubble":..,"stages":[..]`.
std::string coordinator_engine::stage_fields() {
  double t0 = 1e300, t1 = 0;
  for (auto& r : reports_)
    for (auto& e : r.events) {
      if (e.name.rfind("wait optimizer", 0) == 0 || e.name == "STEP") continue;
      t0 = std::min(t0, e.start_us);
      t1 = std::max(t1, e.start_us + e.dur_us);
    }
  double span = std::max(t1 - t0, 1.0);
  nlohmann::json out = nlohmann::json::array();
  double idle = 0;
  for (auto& r : reports_) {
    double busy_us = 0;
    for (auto& e : r.events)
      if (e.cat == event_cat::compute) busy_us += e.dur_us;
    double b = 1.0 - busy_us / span;
    idle += b;
    out.push_back({{"dp", r.dp}, {"pp", r.pp}, {"busy_s", r.busy_s}, {"comm_s", r.comm_s},
                   {"wait_s", r.wait_s}, {"bubble", b}, {"peak_activation_bytes", r.peak_activation_bytes},
                   {"param_bytes", stage_param_bytes(cfg_, layout_, r.pp, r.tp)}});
    if (layout_.tp > 1) out.back()["tp"] = r.tp;
    if (r.peak_device_bytes > 0) {
      out.back()["peak_device_bytes"] = r.peak_device_bytes;
      // Under every ZeRO stage shard (pp, dp) of the stage's tensor-parallel rank lives on this
      // stage's worker.
      auto sh = shard_peak_.find({r.pp, layout_.part_id(r.dp, r.tp)});
      if (sh != shard_peak_.end()) out.back()["optimizer_peak_device_bytes"] = sh->second;
    }
  }
  const double bubble = reports_.empty() ? 0 : idle / static_cast<double>(reports_.size());
  // The same from the device: each stage's compute instructions as its stream ran them, within the
  // span of all stages' (GPU time; a stage waiting on its inputs on the device is idle here, where
  // the host's view counts the time it took to queue the work).
  double d0 = 1e300, d1 = 0;
  for (auto& r : reports_)
    for (auto& e : r.device_events) {
      d0 = std::min(d0, e.start_us);
      d1 = std::max(d1, e.start_us + e.dur_us);
    }
  std::string device;
  if (d1 > d0) {
    const double dspan_s = (d1 - d0) * 1e-6;
    double didle = 0;
    for (std::size_t i = 0; i < reports_.size(); ++i) {
      const double b = std::clamp(1.0 - reports_[i].device_busy_s / dspan_s, 0.0, 1.0);
      didle += b;
      out[i]["device_busy_s"] = reports_[i].device_busy_s;
      out[i]["device_bubble"] = b;
    }
    // Full precision (JSON's own number form): the span is milliseconds, and each stage's
    // device_bubble must follow from device_busy_s and it.
    device = ",\"device_bubble\":" +
             nlohmann::json(didle / static_cast<double>(reports_.size())).dump() +
             ",\"device_span_s\":" + nlohmann::json(dspan_s).dump() + device_costs();
  }
  return "\"bubble\":" + std::to_string(bubble) + device + ",\"stages\":" + out.dump();
}

/// The stage whose compute time this step is furthest above the median of the other replicas of
/// its pipeline stage (they run the same instructions on as much data, so a healthy job keeps them
/// close): the metrics line's field "skew", and a log line when it is a straggler (straggler_ratio,
/// straggler_excess_s) — once per straggler, again only after another rank was the worst or none
/// was. Empty without data parallelism (no replica to compare with). Under tensor parallel the
/// replicas compared are those of the same pipeline stage and tensor-parallel rank.
std::string coordinator_engine::skew_fields() {
  std::map<int, std::vector<const stage_report*>> by_pp;
  for (auto& r : reports_) by_pp[r.pp * layout_.tp + r.tp].push_back(&r);
  const stage_report* worst = nullptr;
  double ratio = 0, median = 0;
  for (auto& [p, rs] : by_pp)
    for (const stage_report* r : rs) {
      std::vector<double> others;
      for (const stage_report* o : rs)
        if (o != r) others.push_back(o->busy_s);
      if (others.empty()) continue;
      std::sort(others.begin(), others.end());
      const std::size_t n = others.size();
      const double m = n % 2 ? others[n / 2] : (others[n / 2 - 1] + others[n / 2]) / 2;
      if (m <= 0 || r->busy_s / m <= ratio) continue;
      worst = r;
      ratio = r->busy_s / m;
      median = m;
    }
  if (!worst) return "";
  const int rank = layout_.worker(worst->dp, worst->pp, worst->tp);
  const bool straggling = ratio >= straggler_ratio && worst->busy_s - median >= straggler_excess_s;
  if (straggling && rank != straggler_ && log_) {
    std::fprintf(log_,
                 "straggler at step %lld: %s (rank %d) computed for %.3f s, %.1fx the median "
                 "%.3f s of the other replicas of pipeline stage %d (metrics.jsonl: \"skew\")\n",
                 static_cast<long long>(step_),
                 actor_name(address{role::stage, worst->dp, worst->pp, worst->tp}).c_str(), rank,
                 worst->busy_s, ratio, median, worst->pp);
    std::fflush(log_);
  }
  straggler_ = straggling ? rank : -1;
  char buf[160];
  std::snprintf(buf, sizeof buf,
                ",\"skew\":{\"rank\":%d,\"ratio\":%.3f,\"busy_s\":%.6f,\"median_busy_s\":%.6f}",
                rank, ratio, worst->busy_s, median);
  return buf;
}

void coordinator_engine::write_trace() {
  if (!trace_.is_open()) return;
  std::string chunk;
  for (auto& r : reports_)
    for (auto& e : r.events) {
      nlohmann::json ev = {{"name", e.name}, {"cat", event_cat_name(e.cat)}, {"ph", "X"},
                           {"ts", e.start_us}, {"dur", e.dur_us}, {"pid", r.dp},
                           {"tid", r.pp * layout_.tp + r.tp}, {"args", {{"step", r.step}}}};
      chunk += trace_first_ ? "\n" : ",\n";
      trace_first_ = false;
      chunk += ev.dump();
    }
  // The device's view of the same instructions, one track per stage beside its host track.
  for (auto& r : reports_) {
    if (r.device_events.empty()) continue;
    const int tid = device_track + r.pp * layout_.tp + r.tp;
    if (device_tracks_.insert({r.dp, tid}).second) {
      std::string label = "pp" + std::to_string(r.pp);
      if (layout_.tp > 1) label += " tp" + std::to_string(r.tp);
      nlohmann::json meta = {{"name", "thread_name"}, {"ph", "M"}, {"pid", r.dp}, {"tid", tid},
                             {"args", {{"name", label + " (device)"}}}};
      chunk += trace_first_ ? "\n" : ",\n";
      trace_first_ = false;
      chunk += meta.dump();
    }
    for (auto& e : r.device_events) {
      nlohmann::json ev = {{"name", e.name}, {"cat", "device"}, {"ph", "X"}, {"ts", e.start_us},
                           {"dur", e.dur_us}, {"pid", r.dp}, {"tid", tid},
                           {"args", {{"step", r.step}}}};
      chunk += trace_first_ ? "\n" : ",\n";
      trace_first_ = false;
      chunk += ev.dump();
    }
  }
  // A failed write leaves the file whole as it was; the run goes on without the trace.
  if (!trace_.append(chunk)) trace_.close();
}

/// The memory each stage and shard held: what recompute and ZeRO are for.
void coordinator_engine::print_memory() {
  if (!log_ || reports_.empty()) return;
  auto mib = [](std::uint64_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); };
  std::fprintf(log_, "memory: peak saved activations per stage (recompute %s):",
               cfg_.recompute.mode == core::recompute_mode::none   ? "none"
               : cfg_.recompute.mode == core::recompute_mode::full ? "full"
                                                                    : "selective");
  for (const auto& r : reports_)
    if (r.dp == 0 && r.tp == 0) std::fprintf(log_, " pp%d %.2f MiB", r.pp, mib(r.peak_activation_bytes));
  std::fprintf(log_, "\nmemory: optimizer state (fp32 master + AdamW moments) per shard (ZeRO-%d):",
               layout_.zero_stage);
  for (const auto& [k, b] : shard_bytes_)
    std::fprintf(log_, " pp%d/part%d %.2f MiB", k.first, k.second, mib(b));
  std::fprintf(log_, "\n");
  if (reports_.front().peak_device_bytes == 0) return;
  std::fprintf(log_, "memory: peak device memory per stage (stage + its optimizer shard):");
  for (const auto& r : reports_)
    if (r.dp == 0) {
      auto sh = shard_peak_.find({r.pp, 0});
      std::uint64_t shard = sh == shard_peak_.end() ? 0 : sh->second;
      std::fprintf(log_, " pp%d %.2f GiB (%.2f + %.2f)", r.pp,
                   mib(r.peak_device_bytes + shard) / 1024.0, mib(r.peak_device_bytes) / 1024.0,
                   mib(shard) / 1024.0);
    }
  std::fprintf(log_, "\n");
  if (be_ && be_->peak_memory_bytes() > 0)
    std::fprintf(log_, "memory: the coordinator's evaluation copy of the model: %.2f GiB at its "
                 "peak\n", mib(be_->peak_memory_bytes()) / 1024.0);
}

void coordinator_engine::on_heartbeat(worker_heartbeat h, clock::time_point now) {
  const int rank = h.rank;
  // A stage that moved on since its last heartbeat is progress, though no step ended: a slow
  // worker (a straggler) is not a hung one.
  const auto before = beats_.find(rank);
  if (before != beats_.end() && before->second.first.status != h.status) progressed(now);
  beats_[rank] = {std::move(h), now};
}

std::string coordinator_engine::blocked_line(int rank, clock::time_point now) const {
  const auto beat = beats_.find(rank);
  if (beat == beats_.end() || beat->second.first.blocked_ms < 0) return "";
  const auto age = now - beat->second.second;
  if (age > std::chrono::seconds(3)) return "";
  const double waited =
      beat->second.first.blocked_ms / 1000.0 + std::chrono::duration<double>(age).count();
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", waited);
  return beat->second.first.status + " for " + buf + " s";
}

bool coordinator_engine::on_failure(const actor_failure& f, bool defer) {
  if (phase_ == coordinator_phase::stopped) return false;
  if (!defer) {
    fail(failure_error(f));
    return false;
  }
  if (deferred_) return false;
  deferred_ = failure_error(f);
  return true;
}

void coordinator_engine::on_deferred_timeout() {
  if (deferred_) fail(*deferred_);
}

/// The error for a worker process that is gone: its rank and host, the step, and what its stage
/// was doing at its last heartbeat.
core::error coordinator_engine::process_lost(int rank, const std::string& why) const {
  const auto host = hosts_.find(rank);
  std::string text = "worker rank " + std::to_string(rank) + " (host " +
                     (host == hosts_.end() ? std::string("?") : host->second);
  const auto beat = beats_.find(rank);
  if (beat != beats_.end()) text += ", pid " + std::to_string(beat->second.first.pid);
  text += ") died or became unreachable during step " + std::to_string(step_) + " (" + why + ")";
  if (beat != beats_.end()) {
    const double ago = std::chrono::duration<double>(clock::now() - beat->second.second).count();
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f", ago);
    text += "; its last report, " + std::string(buf) + " s before: " + beat->second.first.status;
  }
  // The text names the dead rank; the error's own rank is the one reporting it.
  return core::error::make(text, "see that worker's log for how it ended (killed, out of memory, "
                                 "crashed); resume from the last checkpoint with --resume");
}

void coordinator_engine::on_down(const address& who, bool unreachable, const std::string& reason) {
  if (phase_ == coordinator_phase::stopped) return;
  if (unreachable) return fail(process_lost(worker_of(layout_, who), reason));
  // An actor that failed ends after its report: the held report says more than its end.
  if (deferred_) return;
  fail(core::error::make(actor_name(who) + " stopped unexpectedly during step " +
                             std::to_string(step_) + " (" + reason + ")",
                         "see the messages above; rerun with the same config to reproduce it "
                         "deterministically"));
}

watchdog_action coordinator_engine::on_tick(clock::time_point now) {
  if (phase_ == coordinator_phase::stopped) return watchdog_action::wait;
  const double idle = std::chrono::duration<double>(now - last_progress_).count();
  if (asking_ && last_progress_ > asked_at_) {
    // Something moved while the stages were being asked: slow, not hung.
    asking_ = false;
    return watchdog_action::wait;
  }
  if (asking_) {
    std::string text = "no progress for " + std::to_string(static_cast<int>(idle)) +
                       " s at step " + std::to_string(step_) + "; who waits on whom:";
    std::sort(hang_lines_.begin(), hang_lines_.end());
    bool collective = false;
    for (auto& l : hang_lines_) {
      text += "\n    " + l;
      collective = collective || l.find(": blocked in the tensor-parallel ") != std::string::npos;
    }
    fail(core::error::make(
        text, collective ? "a tensor-parallel stage waits in a collective for a peer that has not "
                           "reached it: that peer's line says what it does (no answer: stopped, "
                           "hung, or inside one long instruction), its worker's log may say why"
                         : "a peer never sent what the schedule expects; check a custom "
                           "schedule with `troupe schedule check`"));
    return watchdog_action::wait;
  }
  // Waiting for an evaluation's snapshot is not a hang of the pipeline.
  if (idle > watchdog_.count() / 1000.0 && phase_ != coordinator_phase::evaluating) {
    asking_ = true;
    asked_at_ = now;
    hang_lines_.clear();
    return watchdog_action::ask;
  }
  return watchdog_action::wait;
}

}  // namespace troupe::actors
