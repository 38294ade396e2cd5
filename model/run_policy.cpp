#include "model/run_policy.hpp"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "core/files.hpp"
#include "model/lora.hpp"

namespace troupe::model {

namespace fs = std::filesystem;

namespace {

void note(std::FILE* log, const std::string& text) {
  if (!log) return;
  std::fprintf(log, "%s\n", text.c_str());
  std::fflush(log);
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
  if (!saved->model.same_model(current->model))
    return core::error::at_file(where, "the checkpoint holds a different model than the config",
                                "resume with the config the checkpoint was trained with (its "
                                "text is in manifest.json), or fix the [model] table");
  // Adapters belong to the base they were trained on: the same frozen weights, bit for bit.
  if (current->model.lora.partial()) {
    const base_identity base = identify_base(*current);
    if (base.xxh64 != ck.info().base_xxh64)
      return core::error::at_file(
          where,
          "the checkpoint's trainable weights belong to another frozen base (" +
              (ck.info().base_xxh64.empty() ? std::string("none recorded")
                                            : ck.info().base_source + ", xxh64 " + ck.info().base_xxh64) +
              ") than this run's (" + base.source + ", xxh64 " + base.xxh64 + ")",
          "resume with the checkpoint's own config (train.seed and the base it names)");
  }
  if (saved->train.seed != cfg.train.seed)
    note(log, "note: train.seed differs from the checkpoint's; the data order will not continue "
              "the original run");
  if (saved->train.steps != cfg.train.steps || saved->train.warmup_steps != cfg.train.warmup_steps ||
      saved->optimizer.lr != cfg.optimizer.lr || saved->optimizer.min_lr != cfg.optimizer.min_lr)
    note(log, "note: the learning-rate schedule differs from the checkpoint's run");
  return {};
}

core::status write_text(const std::string& path, const std::string& text) {
  return core::write_file_atomic(path, text);
}

bool divides(int interval, int done) { return interval > 0 && done % interval == 0; }

}  // namespace

core::result<run_start> open_run(const core::config& cfg, const std::string& resume,
                                 int max_steps, bool write_config, std::FILE* log) {
  run_start r;
  if (!resume.empty()) {
    std::vector<std::string> skipped;
    auto ck = checkpoint::open_for_resume(resume, &skipped);
    for (const auto& s : skipped)
      note(log, "warning: passing over an unusable checkpoint: " + s);
    if (!ck) return ck.err();
    if (auto st = check_resume_config(cfg, ck.value(), log); !st) return st.err();
    r.first_step = ck->info().next_step;
    r.resumed_from = ck->dir();
    r.resume.emplace(std::move(ck.value()));
    note(log, "resumed from " + r.resumed_from + " at step " + std::to_string(r.first_step));
  } else if (!cfg.model.init.empty()) {
    note(log, "starting from the weights in " + cfg.model.init + " (model.init; fresh optimizer, step 0)");
  }
  r.end_step = cfg.train.steps;
  if (max_steps >= 0) r.end_step = std::min(r.end_step, r.first_step + max_steps);

  std::error_code ec;
  fs::create_directories(cfg.runtime.run_dir, ec);
  if (ec)
    return core::error::at_key(cfg.source, "runtime.run_dir", 0, 0,
                               "cannot create run directory '" + cfg.runtime.run_dir +
                                   "': " + ec.message(),
                               "choose a writable runtime.run_dir");
  if (write_config) {
    auto st = write_text((fs::path(cfg.runtime.run_dir) / "config.toml").string(),
                         core::to_toml(cfg));
    if (!st) return st.err();
  }
  r.ckpt_root = cfg.checkpoint.dir.empty()
                    ? (fs::path(cfg.runtime.run_dir) / "checkpoints").string()
                    : cfg.checkpoint.dir;
  return r;
}

step_cadence cadence(const core::config& cfg, int done, int end_step, bool has_validation) {
  const bool last = done == end_step;
  step_cadence c;
  c.evaluate = has_validation && (last || divides(cfg.train.eval_interval, done));
  c.checkpoint = last || divides(cfg.checkpoint.interval, done);
  c.log = last || c.evaluate || cfg.train.log_interval <= 1 || done % cfg.train.log_interval == 0;
  return c;
}

run_log::run_log(const core::config& cfg, const run_start& start, std::FILE* log,
                 metrics_writer w)
    : cfg_(cfg), log_(log), end_step_(start.end_step), restarts_(start.restarts),
      metrics_(std::move(w)),
      t_start_(std::chrono::steady_clock::now()) {
  summary_.first_step = start.first_step;
  summary_.end_step = start.first_step;
}

core::result<run_log> run_log::open(const core::config& cfg, const run_start& start,
                                    std::FILE* log) {
  auto w = metrics_writer::open(cfg.runtime.run_dir, start.first_step);
  if (!w) return w.err();
  return run_log(cfg, start, log, std::move(w.value()));
}

core::status run_log::event(int step, const std::string& fields) {
  return metrics_.write_line("{\"step\":" + std::to_string(step) + "," + fields + "}");
}

core::status run_log::step_end(const step_outcome& o, const std::string& extra_fields) {
  summary_.losses.push_back(o.loss);
  summary_.grad_norms.push_back(o.grad_norm);
  summary_.seconds += o.seconds;
  summary_.end_step = o.step + 1;
  if (o.val_loss) summary_.final_val_loss = o.val_loss;

  step_metrics m;
  m.step = o.step;
  m.loss = static_cast<float>(o.loss);
  m.lr = static_cast<float>(o.lr);
  m.grad_norm = static_cast<float>(o.grad_norm);
  m.tokens_per_s = static_cast<float>(static_cast<double>(o.tokens) / o.seconds);
  if (o.scaled) {
    m.loss_scale = o.loss_scale;
    m.skipped = o.skipped;
    m.next_loss_scale = o.next_loss_scale;
  }
  if (o.val_loss) m.val_loss = static_cast<float>(*o.val_loss);
  m.elapsed_s = static_cast<float>(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start_).count());

  std::string line = to_json_line(m);
  std::string extra = extra_fields;
  if (restarts_ > 0) {
    if (!extra.empty()) extra += ',';
    extra += "\"restarts\":";
    extra += std::to_string(restarts_);
  }
  if (!extra.empty()) {
    line.pop_back();  // the closing brace
    line += "," + extra + "}";
  }
  if (auto st = metrics_.write_line(line); !st)
    return core::error::make(st.err().to_string(),
                             "check free disk space and runtime.run_dir; resume from the last "
                             "checkpoint with --resume");

  const int done = o.step + 1;
  const bool due = done == end_step_ || o.val_loss.has_value() || cfg_.train.log_interval <= 1 ||
                   done % cfg_.train.log_interval == 0;
  if (log_ && due) {
    const double per_step =
        summary_.seconds / static_cast<double>(std::max(1, done - summary_.first_step));
    std::fprintf(log_, "%s\n",
                 progress_line(m, cfg_.train.steps, per_step * (end_step_ - done)).c_str());
    std::fflush(log_);
  }
  for (auto& h : hooks_)
    if (auto st = h(m); !st) return st;
  return {};
}

void run_log::checkpoint_written(const std::string& path) {
  summary_.checkpoint = path;
  note(log_, "checkpoint: " + path);
}

train_summary run_log::finish() {
  if (summary_.losses.empty() && summary_.first_step >= end_step_)
    note(log_, "nothing to do: the run already has all steps");
  return summary_;
}

double validation_loss(const loader& val, int eval_batches, kernels::backend& be,
                       std::vector<chunk*> chunks) {
  auto on_device = [&](const core::tensor& host) {
    return be.dev().is_cpu() ? host : be.from_host(host);
  };
  double total = 0;
  std::int64_t tokens = 0;
  for (int i = 0; i < eval_batches; ++i) {
    batch b = val.eval_cut(i);
    core::tensor x = on_device(b.tokens);
    core::tensor targets = on_device(b.targets);
    for (std::size_t c = 0; c + 1 < chunks.size(); ++c)
      x = chunks[c]->forward(i, x, {}, 0.0f, {}, b.doc_starts);
    chunks.back()->forward(i, x, targets, 0.0f, {}, b.doc_starts);
    total += chunks.back()->loss_sum(i);
    for (chunk* c : chunks) c->release(i);
    tokens += b.trained;
  }
  return total / static_cast<double>(std::max<std::int64_t>(tokens, 1));
}

}  // namespace troupe::model
