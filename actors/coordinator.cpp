// The coordinator actor, one per job: starts each step, gathers the last stages' losses and the
// shards' gradient-norm blocks, decides the clip scale and learning rate, waits for every stage and
// shard to finish, logs (progress line, metrics.jsonl, trace.json), evaluates, asks the writer
// for checkpoints, and stops the job — with a message naming the actor, rank, step and
// instruction — when an actor fails, a loss is not finite, or the job stops making progress.
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>

#include "actors/actors.hpp"
#include "model/metrics.hpp"
#include "model/optimizer.hpp"
#include "model/params.hpp"
#include "kernels/select.hpp"

namespace troupe::actors {
namespace {

using clock_t_ = std::chrono::steady_clock;

struct coord_state {
  coordinator_setup s;
  std::int64_t step = 0;
  // this step
  std::map<int, std::vector<double>> losses;                  // dp -> per-mb loss sums
  std::map<std::pair<int, int>, std::vector<std::int64_t>> norms;  // (chunk, part) -> exact sum
  bool decided = false;
  double grad_norm = 0;
  double lr = 0;
  model::loss_scaler scaler;        // dynamic loss scaling (inert when off)
  model::step_decision decision;    // this step's
  std::vector<stage_report> reports;
  int shard_reports = 0;
  std::map<std::pair<int, int>, std::uint64_t> shard_bytes;  // (pp, part) -> optimizer state
  std::map<std::pair<int, int>, std::uint64_t> shard_peak;   // (pp, part) -> device peak bytes
  clock_t_::time_point t_step;
  // run
  clock_t_::time_point t_start;
  double train_seconds = 0;
  model::train_summary summary;
  std::optional<model::metrics_writer> metrics;
  std::FILE* trace = nullptr;
  bool trace_first = true;
  // evaluation and checkpoints
  std::unique_ptr<kernels::backend> be;
  std::unique_ptr<model::chunk> eval_model;
  std::map<int, core::tensor> snapshot;
  bool awaiting_eval = false;
  std::optional<model::step_metrics> pending_line;
  std::string pending_stage_json;
  int pending_checkpoints = 0;
  bool finishing = false;
  bool done = false;
  // supervision
  std::map<caf::actor_addr, std::string> names;
  std::map<caf::actor_addr, int> ranks;                        // worker rank of each actor
  std::map<int, std::pair<worker_heartbeat, clock_t_::time_point>> beats;  // launched jobs
  std::optional<core::error> deferred;                         // an actor's failure, held briefly
  clock_t_::time_point last_progress;
  std::vector<std::string> hang_lines;
  bool hang_reporting = false;
};

using self_t = caf::stateful_actor<coord_state>;

std::vector<caf::actor> everyone(const job& j) {
  std::vector<caf::actor> all;
  for (auto& [k, a] : j.stages) all.push_back(a);
  for (auto& [k, a] : j.shards) all.push_back(a);
  for (auto& [k, a] : j.loaders) all.push_back(a);
  all.push_back(j.writer);
  return all;
}

void close_trace(coord_state& st) {
  if (!st.trace) return;
  std::fputs("\n]}\n", st.trace);
  std::fclose(st.trace);
  st.trace = nullptr;
}

void shutdown(self_t* self, const job& j) {
  for (auto& a : everyone(j)) self->send_exit(a, caf::exit_reason::user_shutdown);
  self->quit();
}

void fail(self_t* self, const job& j, core::error e) {
  auto& st = self->state;
  if (st.done) return;
  st.done = true;
  close_trace(st);
  st.s.done->set_value(std::move(e));
  shutdown(self, j);
}

/// The memory each stage and shard held: what recompute and ZeRO are for.
void print_memory(const coord_state& st, const job& j) {
  if (!j.log || st.reports.empty()) return;
  auto mib = [](std::uint64_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); };
  std::fprintf(j.log, "memory: peak saved activations per stage (recompute %s):",
               j.cfg.recompute.mode == core::recompute_mode::none   ? "none"
               : j.cfg.recompute.mode == core::recompute_mode::full ? "full"
                                                                     : "selective");
  for (const auto& r : st.reports)
    if (r.dp == 0) std::fprintf(j.log, " pp%d %.2f MiB", r.pp, mib(r.peak_activation_bytes));
  std::fprintf(j.log, "\nmemory: optimizer state (fp32 master + AdamW moments) per shard (ZeRO-%d):",
               j.layout.zero_stage);
  for (const auto& [k, b] : st.shard_bytes)
    std::fprintf(j.log, " pp%d/part%d %.2f MiB", k.first, k.second, mib(b));
  std::fprintf(j.log, "\n");
  if (st.reports.front().peak_device_bytes == 0) return;
  std::fprintf(j.log, "memory: peak device memory per stage (stage + its optimizer shard):");
  for (const auto& r : st.reports)
    if (r.dp == 0) {
      auto sh = st.shard_peak.find({r.pp, 0});
      std::uint64_t shard = sh == st.shard_peak.end() ? 0 : sh->second;
      std::fprintf(j.log, " pp%d %.2f GiB (%.2f + %.2f)", r.pp,
                   mib(r.peak_device_bytes + shard) / 1024.0, mib(r.peak_device_bytes) / 1024.0,
                   mib(shard) / 1024.0);
    }
  std::fprintf(j.log, "\n");
}

void complete(self_t* self, const job& j) {
  auto& st = self->state;
  if (st.done) return;
  st.done = true;
  print_memory(st, j);
  close_trace(st);
  st.summary.seconds = st.train_seconds;
  st.s.done->set_value(st.summary);
  shutdown(self, j);
}

void begin_step(self_t* self, const job& j, std::int64_t step) {
  auto& st = self->state;
  st.step = step;
  st.losses.clear();
  st.norms.clear();
  st.decided = false;
  st.reports.clear();
  st.shard_reports = 0;
  st.t_step = clock_t_::now();
  st.last_progress = st.t_step;
  for (auto& [d, a] : j.loaders) self->send(a, step_atom::value, step);
  for (auto& [k, a] : j.stages) self->send(a, step_atom::value, step, st.scaler.scale);
}

int expected_norm_parts(const job& j) {
  return j.layout.chunks() * (j.layout.zero_stage == 0 ? 1 : j.layout.dp);
}

void maybe_decide(self_t* self, const job& j) {
  auto& st = self->state;
  if (st.decided || static_cast<int>(st.losses.size()) < j.layout.dp ||
      static_cast<int>(st.norms.size()) < expected_norm_parts(j))
    return;
  for (auto& [d, l] : st.losses)
    for (std::size_t mb = 0; mb < l.size(); ++mb)
      if (!std::isfinite(l[mb])) {
        fail(self, j, core::error::make(
                          "the loss is " + std::string(std::isnan(l[mb]) ? "NaN" : "infinite") +
                              " at step " + std::to_string(st.step) + ", micro-batch " +
                              std::to_string(mb) + " (replica " + std::to_string(d) +
                              "); the parameters were not updated",
                          "lower optimizer.lr, raise train.warmup_steps or set train.grad_clip; "
                          "resume from the last checkpoint with --resume"));
        return;
      }
  core::exact_sum sumsq;
  for (auto& [key, w] : st.norms) sumsq.merge(w.data());
  // The single-rank trainer decides with the same function (or, without loss scaling, the same
  // arithmetic on the device): same norm, clip, lr, skip, scale.
  const model::step_decision d = model::decide_step(sumsq, st.scaler, j.cfg.optimizer, j.cfg.train,
                                                    static_cast<int>(st.step));
  if (!d.skip && !std::isfinite(d.grad_norm)) {
    // Without dynamic loss scaling a non-finite gradient would poison every parameter.
    fail(self, j, core::error::make("the gradient norm is " +
                                        std::string(std::isnan(d.grad_norm) ? "NaN" : "infinite") +
                                        " at step " + std::to_string(st.step) +
                                        "; the parameters were not updated",
                                    "lower optimizer.lr or set train.grad_clip; with fp16 turn on "
                                    "precision.dynamic_loss_scale; resume from the last checkpoint "
                                    "with --resume"));
    return;
  }
  st.decision = d;
  st.grad_norm = d.grad_norm;
  st.lr = d.lr;
  st.decided = true;
  for (auto& [k, a] : j.shards)
    self->send(a, clip_decision{st.step, d.grad_scale, d.lr, d.adam_step, d.skip, d.loss_scale});
}

double validation_loss(coord_state& st, const job& j) {
  auto specs = model::partition(j.cfg.model, j.layout.chunks());
  for (int c = 0; c < j.layout.chunks(); ++c) {
    const core::tensor& flat = st.snapshot.at(c);
    for (const auto& d : model::define_params(j.cfg.model, specs[c])) {
      core::tensor dst = st.eval_model->param(d.info.name);
      st.be->copy(flat.slice(d.info.offset, d.info.shape), dst);
    }
  }
  st.snapshot.clear();
  st.eval_model->params_updated();
  const auto& val = *st.s.val;
  double total = 0;
  int n = j.cfg.train.eval_batches;
  for (int i = 0; i < n; ++i) {
    model::batch b = val.eval_cut(i);
    st.eval_model->forward(i, st.be->from_host(b.tokens), st.be->from_host(b.targets), 0.0f);
    total += st.eval_model->loss_sum(i);
    st.eval_model->release(i);
  }
  return total / (static_cast<double>(n) * val.options().micro_batch_size * val.options().seq_length);
}

/// Per-stage busy / communicating / waiting and the bubble fraction of this step, measured like
/// the simulator: idle time of each stage within the span of the step's instructions.
nlohmann::json stage_stats(coord_state& st, double& bubble) {
  double t0 = 1e300, t1 = 0;
  for (auto& r : st.reports)
    for (auto& e : r.events) {
      if (e.name.rfind("wait optimizer", 0) == 0 || e.name == "STEP") continue;
      t0 = std::min(t0, e.start_us);
      t1 = std::max(t1, e.start_us + e.dur_us);
    }
  double span = std::max(t1 - t0, 1.0);
  nlohmann::json out = nlohmann::json::array();
  double idle = 0;
  for (auto& r : st.reports) {
    double busy_us = 0;
    for (auto& e : r.events)
      if (e.cat == 0) busy_us += e.dur_us;
    double b = 1.0 - busy_us / span;
    idle += b;
    out.push_back({{"dp", r.dp}, {"pp", r.pp}, {"busy_s", r.busy_s}, {"comm_s", r.comm_s},
                   {"wait_s", r.wait_s}, {"bubble", b}, {"peak_activation_bytes", r.peak_activation_bytes}});
    if (r.peak_device_bytes > 0) {
      out.back()["peak_device_bytes"] = r.peak_device_bytes;
      // Under every ZeRO stage shard (pp, dp) lives on this stage's worker.
      auto sh = st.shard_peak.find({r.pp, r.dp});
      if (sh != st.shard_peak.end()) out.back()["optimizer_peak_device_bytes"] = sh->second;
    }
  }
  bubble = st.reports.empty() ? 0 : idle / static_cast<double>(st.reports.size());
  return out;
}

void write_trace(coord_state& st) {
  if (!st.trace) return;
  for (auto& r : st.reports)
    for (auto& e : r.events) {
      nlohmann::json ev = {{"name", e.name},
                           {"cat", e.cat == 0 ? "compute" : e.cat == 1 ? "comm" : "wait"},
                           {"ph", "X"}, {"ts", e.start_us}, {"dur", e.dur_us},
                           {"pid", r.dp}, {"tid", r.pp}, {"args", {{"step", r.step}}}};
      std::fputs(st.trace_first ? "\n" : ",\n", st.trace);
      st.trace_first = false;
      std::fputs(ev.dump().c_str(), st.trace);
    }
  std::fflush(st.trace);
}

void log_line(self_t* self, const job& j, model::step_metrics m) {
  auto& st = self->state;
  std::string line = model::to_json_line(m);
  line.pop_back();  // the closing brace: the runtime adds its per-stage fields
  line += ",\"bubble\":" + st.pending_stage_json + "}";
  if (st.metrics) {
    auto status = st.metrics->write_line(line);
    if (!status.ok() && j.log) std::fprintf(j.log, "warning: %s\n", status.err().to_string().c_str());
  }
  if (j.log) {
    double remaining = st.train_seconds / std::max<double>(1, m.step + 1 - st.s.first_step) *
                       (st.s.end_step - m.step - 1);
    std::fprintf(j.log, "%s\n", model::progress_line(m, j.cfg.train.steps, remaining).c_str());
    std::fflush(j.log);
  }
}

void next_or_finish(self_t* self, const job& j) {
  auto& st = self->state;
  if (st.step + 1 < st.s.end_step && st.step != st.s.halt_after) {
    begin_step(self, j, st.step + 1);
    return;
  }
  st.finishing = true;
  if (st.pending_checkpoints == 0) complete(self, j);
}

void maybe_finish_step(self_t* self, const job& j) {
  auto& st = self->state;
  if (static_cast<int>(st.reports.size()) < j.layout.workers() ||
      st.shard_reports < j.layout.pp * j.layout.dp)
    return;
  double step_s = std::chrono::duration<double>(clock_t_::now() - st.t_step).count();
  st.train_seconds += step_s;
  double loss_total = 0;
  for (auto& [d, l] : st.losses)
    for (double x : l) loss_total += x;
  std::int64_t tokens = static_cast<std::int64_t>(j.layout.dp) * j.layout.microbatches *
                        j.cfg.parallel.micro_batch_size * j.cfg.model.seq_length;
  double loss = loss_total / static_cast<double>(tokens);
  st.summary.losses.push_back(loss);
  st.summary.grad_norms.push_back(st.grad_norm);
  st.summary.end_step = static_cast<int>(st.step) + 1;
  model::step_metrics m;
  m.step = static_cast<int>(st.step);
  m.loss = static_cast<float>(loss);
  m.lr = static_cast<float>(st.lr);
  m.grad_norm = static_cast<float>(st.grad_norm);
  m.tokens_per_s = static_cast<float>(tokens / step_s);
  if (st.scaler.enabled) {
    m.loss_scale = st.decision.loss_scale;
    m.skipped = st.decision.skip;
    m.next_loss_scale = st.decision.next_loss_scale;
  }
  m.elapsed_s = static_cast<float>(std::chrono::duration<double>(clock_t_::now() - st.t_start).count());
  double bubble = 0;
  nlohmann::json stages = stage_stats(st, bubble);
  st.pending_stage_json = std::to_string(bubble) + ",\"stages\":" + stages.dump();
  write_trace(st);

  const int done_steps = static_cast<int>(st.step) + 1;
  const bool last = done_steps == st.s.end_step;
  const bool ckpt = last || (j.cfg.checkpoint.interval > 0 && done_steps % j.cfg.checkpoint.interval == 0);
  const bool eval = st.s.val && (last || (j.cfg.train.eval_interval > 0 &&
                                          done_steps % j.cfg.train.eval_interval == 0));
  std::int32_t dests = (ckpt ? to_writer : 0) | (eval ? to_coordinator : 0);
  if (dests) {
    for (int p = 0; p < j.layout.pp; ++p)
      self->send(j.stages.at({0, p}), snap_atom::value, st.step, dests);
  }
  if (ckpt) {
    ++st.pending_checkpoints;
    // The loss scaler's state after this step travels with the checkpoint (empty when off).
    self->send(j.writer, ckpt_atom::value, st.step,
               st.scaler.enabled ? st.scaler.to_vector() : std::vector<double>{});
    int parts = j.layout.zero_stage == 0 ? 1 : j.layout.dp;
    for (int p = 0; p < j.layout.pp; ++p)
      for (int k = 0; k < parts; ++k) self->send(j.shards.at({p, k}), snap_atom::value, st.step, to_writer);
  }
  if (eval) {
    st.awaiting_eval = true;
    st.pending_line = m;
    return;
  }
  log_line(self, j, m);
  next_or_finish(self, j);
}

/// The error for a worker process that is gone: its rank and host, the step, and what its stage
/// was doing at its last heartbeat.
core::error process_lost(const coord_state& st, const job& j, int rank, const std::string& why) {
  const auto host = j.hosts.find(rank);
  std::string text = "worker rank " + std::to_string(rank) + " (host " +
                     (host == j.hosts.end() ? std::string("?") : host->second);
  const auto beat = st.beats.find(rank);
  if (beat != st.beats.end()) text += ", pid " + std::to_string(beat->second.first.pid);
  text += ") died or became unreachable during step " + std::to_string(st.step) + " (" + why + ")";
  if (beat != st.beats.end()) {
    const double ago = std::chrono::duration<double>(clock_t_::now() - beat->second.second).count();
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f", ago);
    text += "; its last report, " + std::string(buf) + " s before: " + beat->second.first.status;
  }
  // The text names the dead rank; the error's own rank is the one reporting it.
  return core::error::make(text, "see that worker's log for how it ended (killed, out of memory, "
                                 "crashed); resume from the last checkpoint with --resume");
}

caf::behavior coordinator_actor(self_t* self, std::shared_ptr<job> j, coordinator_setup s) {
  auto& st = self->state;
  st.s = std::move(s);
  st.summary.first_step = st.s.first_step;
  st.summary.end_step = st.s.first_step;
  st.scaler = st.s.scaler ? *st.s.scaler : model::loss_scaler::from(j->cfg.precision, st.s.first_step);
  if (st.s.val) {
    st.be = kernels::make_backend(j->cfg.runtime.device);
    st.eval_model = std::make_unique<model::chunk>(j->cfg.model, model::partition(j->cfg.model, 1)[0],
                                                   *st.be, j->cfg.precision.compute);
  }
  self->set_down_handler([self, j](caf::down_msg& m) {
    auto& st = self->state;
    if (st.done) return;
    auto it = st.names.find(m.source);
    std::string who = it == st.names.end() ? "an actor" : it->second;
    auto r = st.ranks.find(m.source);
    if (m.reason == caf::exit_reason::remote_link_unreachable && r != st.ranks.end()) {
      fail(self, *j, process_lost(st, *j, r->second, self->system().render(m.reason)));
      return;
    }
    fail(self, *j, core::error::make(who + " stopped unexpectedly during step " +
                                         std::to_string(st.step) + " (" +
                                         self->system().render(m.reason) + ")",
                                     "see the messages above; rerun with the same config to "
                                     "reproduce it deterministically"));
  });
  return {
      [=](start_atom) {
        auto& st = self->state;
        const auto& l = j->layout;
        for (auto& [k, a] : j->stages) {
          st.names[a.address()] = stage_name(k.first, k.second);
          st.ranks[a.address()] = l.worker(k.first, k.second);
        }
        for (auto& [k, a] : j->shards) {
          st.names[a.address()] = "optimizer_shard(pp=" + std::to_string(k.first) + ", part=" +
                                  std::to_string(k.second) + ")";
          st.ranks[a.address()] = l.worker(k.second, k.first);
        }
        for (auto& [k, a] : j->loaders) {
          st.names[a.address()] = "data_loader(dp=" + std::to_string(k) + ")";
          st.ranks[a.address()] = l.worker(k, 0);
        }
        st.names[j->writer.address()] = "checkpoint_writer";
        for (auto& a : everyone(*j)) self->monitor(a);
        auto mw = model::metrics_writer::open(j->cfg.runtime.run_dir, st.s.first_step);
        if (!mw.ok()) {
          fail(self, *j, mw.err());
          return;
        }
        st.metrics.emplace(std::move(mw.value()));
        st.trace = std::fopen((j->cfg.runtime.run_dir + "/trace.json").c_str(), "w");
        if (st.trace) std::fputs("{\"displayTimeUnit\":\"ms\",\"traceEvents\":[", st.trace);
        st.t_start = clock_t_::now();
        if (st.s.first_step >= st.s.end_step) {
          complete(self, *j);
          return;
        }
        begin_step(self, *j, st.s.first_step);
        self->delayed_send(self, std::chrono::seconds(1), tick_atom::value);
      },
      [=](loss_report& r) {
        self->state.last_progress = clock_t_::now();
        self->state.losses[r.dp] = std::move(r.mb_loss_sums);
        maybe_decide(self, *j);
      },
      [=](norm_part& n) {
        self->state.last_progress = clock_t_::now();
        if (n.sumsq.size() != static_cast<std::size_t>(core::exact_sum_words)) {
          fail(self, *j,
               core::error::make("the gradient-norm sum of chunk " + std::to_string(n.chunk) +
                                     ", shard " + std::to_string(n.part) + " at step " +
                                     std::to_string(n.step) + " has " +
                                     std::to_string(n.sumsq.size()) + " words, expected " +
                                     std::to_string(core::exact_sum_words),
                                 "every worker must run the same troupe build; rebuild and "
                                 "relaunch"));
          return;
        }
        self->state.norms[{n.chunk, n.part}] = std::move(n.sumsq);
        maybe_decide(self, *j);
      },
      [=](shard_report& r) {
        auto& st = self->state;
        st.last_progress = clock_t_::now();
        ++st.shard_reports;
        st.shard_bytes[{r.pp, r.part}] = r.state_bytes;
        st.shard_peak[{r.pp, r.part}] = r.peak_device_bytes;
        maybe_finish_step(self, *j);
      },
      [=](stage_report& r) {
        self->state.last_progress = clock_t_::now();
        self->state.reports.push_back(std::move(r));
        maybe_finish_step(self, *j);
      },
      [=](tensor_ready& m) {
        auto& st = self->state;
        st.snapshot[m.chunk] = receive(*j, 0, m);
        if (!st.awaiting_eval || static_cast<int>(st.snapshot.size()) < j->layout.chunks()) return;
        double v = validation_loss(st, *j);
        st.awaiting_eval = false;
        st.summary.final_val_loss = v;
        auto m2 = *st.pending_line;
        m2.val_loss = static_cast<float>(v);
        log_line(self, *j, m2);
        next_or_finish(self, *j);
      },
      [=](checkpoint_written& w) {
        auto& st = self->state;
        --st.pending_checkpoints;
        if (!w.error.empty()) {
          fail(self, *j, core::error::make("the checkpoint of step " + std::to_string(w.step + 1) +
                                               " could not be written: " + w.error,
                                           "check checkpoint.dir: free space and permissions"));
          return;
        }
        st.summary.checkpoint = w.path;
        if (j->log) std::fprintf(j->log, "checkpoint: %s\n", w.path.c_str());
        if (st.finishing && st.pending_checkpoints == 0 && !st.awaiting_eval) complete(self, *j);
      },
      [=](actor_failure& f) {
        std::string where = f.actor + " (rank " + std::to_string(f.rank) + ")";
        if (f.step >= 0) where += " at step " + std::to_string(f.step);
        if (!f.instruction.empty()) where += ", instruction " + f.instruction;
        core::error e = core::error::make(where + " failed: " + f.what,
                                          "the job was stopped; fix the cause and resume from the "
                                          "last checkpoint with --resume");
        e.where.rank = f.rank;
        if (j->nodes.empty()) {
          fail(self, *j, std::move(e));
          return;
        }
        // Across processes a survivor often fails first, on the lost connection to a dead worker:
        // wait a moment for the dead process's down message, which names the real culprit.
        auto& st = self->state;
        if (!st.deferred) {
          st.deferred = std::move(e);
          self->delayed_send(self, std::chrono::seconds(2), stop_atom::value);
        }
      },
      [=](stop_atom) {
        auto& st = self->state;
        if (st.deferred) fail(self, *j, *st.deferred);
      },
      [=](worker_heartbeat& h) {
        self->state.beats[h.rank] = {std::move(h), clock_t_::now()};
      },
      [=](tick_atom) {
        auto& st = self->state;
        if (st.done) return;
        double idle = std::chrono::duration<double>(clock_t_::now() - st.last_progress).count();
        double limit = j->recv_timeout.count() / 1000.0;
        if (st.hang_reporting) {
          std::string text = "no progress for " + std::to_string(static_cast<int>(idle)) +
                             " s at step " + std::to_string(st.step) + "; who waits on whom:";
          std::sort(st.hang_lines.begin(), st.hang_lines.end());
          for (auto& l : st.hang_lines) text += "\n    " + l;
          fail(self, *j, core::error::make(text, "a peer never sent what the schedule expects; "
                                                 "check a custom schedule with `troupe schedule check`"));
          return;
        }
        if (idle > limit && !st.awaiting_eval) {
          st.hang_reporting = true;
          for (auto& [k, a] : j->stages) {
            const int dp = k.first, pp = k.second;
            self->request(a, std::chrono::seconds(2), status_atom::value)
                .then([self](std::string& line) { self->state.hang_lines.push_back(line); },
                      [self, dp, pp, rank = j->layout.worker(dp, pp)](caf::error&) {
                        // A stage busy in one long kernel, or a worker process that is stopped.
                        self->state.hang_lines.push_back(
                            stage_name(dp, pp) + " (rank " + std::to_string(rank) +
                            "): no answer within 2 s — stuck inside an instruction, or its process is stopped");
                      });
          }
          self->delayed_send(self, std::chrono::seconds(3), tick_atom::value);
          return;
        }
        self->delayed_send(self, std::chrono::seconds(1), tick_atom::value);
      },
  };
}

}  // namespace

caf::actor spawn_coordinator(caf::actor_system& sys, std::shared_ptr<job> j, coordinator_setup s) {
  return sys.spawn(coordinator_actor, std::move(j), std::move(s));
}

}  // namespace troupe::actors
