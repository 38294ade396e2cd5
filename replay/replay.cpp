#include "replay/replay.hpp"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>

#include "actors/recorder.hpp"
#include "core/files.hpp"
#include "replay/replay_parts.hpp"
#include "runtime/runtime.hpp"
#include "model/checkpoint.hpp"
#include "model/safetensors.hpp"

namespace troupe::actors {

namespace fs = std::filesystem;

namespace {

std::string hex(std::uint64_t v) { return model::safetensors::hex64(v); }

std::string where(const message_record& r) { return r.file + " line " + std::to_string(r.line); }

/// The name a dumped tensor gets: its tag, sender and receiver.
std::string dump_name(const message_record& r) {
  return kind_name(r.tag.kind) + "/chunk" + std::to_string(r.tag.chunk) + "/mb" +
         std::to_string(r.tag.mb) + "/part" + std::to_string(r.tag.part) + "/rank" +
         std::to_string(r.src) + "->rank" + std::to_string(r.dst);
}

/// A scratch directory removed on destruction, or the user's directory, kept.
struct work_area {
  fs::path path;
  bool temporary = false;
  ~work_area() {
    if (temporary) {
      std::error_code ec;
      fs::remove_all(path, ec);
    }
  }
};

/// The message sink of a whole-job replay: the checker behind a lock, throwing at the first
/// difference, which stops the actor that sent it and so the job.
class verifier final : public message_sink {
 public:
  verifier(const recorded_run& run, std::int64_t lo, std::int64_t hi, bool keep_tensors)
      : checker_(run, lo, hi, keep_tensors, [](const message_record&) { return true; }) {}

  void sent(const message_record& r, const core::tensor& bytes) override {
    std::lock_guard<std::mutex> lk(mu_);
    if (checker_.mismatch() || !checker_.check(r, bytes))
      throw core::failure("replay stopped: " + *checker_.mismatch());
  }
  /// REQUIRES: the job is over (no sender left).
  message_checker& checker() { return checker_; }

 private:
  std::mutex mu_;
  message_checker checker_;
};

/// The directory a replayed invocation resumes from: the replay's own checkpoint of that step
/// when it wrote one, else the checkpoint the recorded invocation named.
core::result<std::string> resume_point(const fs::path& ckpt_root, const segment_header& h) {
  fs::path own = ckpt_root / model::checkpoint::dir_name(h.first_step);
  if (fs::exists(own / "manifest.json")) return own.string();
  if (!h.resume.empty() && fs::exists(fs::path(h.resume) / "manifest.json")) return h.resume;
  return core::error::make(
      "the recorded run resumed at step " + std::to_string(h.first_step) + " from '" + h.resume +
          "', which no longer exists, and the replay did not write that checkpoint itself",
      "restore that checkpoint, or replay with --until-step " + std::to_string(h.first_step - 1));
}

core::result<replay_report> replay_whole(const recorded_run& run, const replay_options& opt,
                                         int last_step) {
  work_area area;
  if (opt.work_dir.empty()) {
    static int counter = 0;
    area.path = fs::temp_directory_path() /
                ("troupe_replay_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    area.temporary = true;
    fs::remove_all(area.path);
  } else {
    area.path = opt.work_dir;
  }
  core::config cfg = run.cfg;
  cfg.runtime.run_dir = (area.path / "run").string();
  cfg.checkpoint.dir = (area.path / "run" / "checkpoints").string();
  cfg.runtime.record = false;
  cfg.runtime.record_tensors = false;

  replay_report rep;
  rep.first_step = run.segments.front().first_step;
  rep.last_step = last_step;
  for (std::size_t i = 0; i < run.segments.size(); ++i) {
    const segment_header& h = run.segments[i];
    if (h.first_step > last_step) break;
    int hi = i + 1 < run.segments.size() ? run.segments[i + 1].first_step : h.end_step;
    hi = std::min(hi, last_step + 1);
    if (opt.log)
      std::fprintf(opt.log, "replay: invocation %zu of %zu: steps %d..%d%s\n", i + 1,
                   run.segments.size(), h.first_step, hi - 1,
                   h.first_step > 0 ? " (resumed from a checkpoint)" : "");
    auto v = std::make_shared<verifier>(run, h.first_step, hi, !opt.dump_dir.empty());
    run_options ro;
    ro.log = opt.log;
    ro.sink = v;
    ro.max_steps = h.end_step - h.first_step;
    if (hi < h.end_step) ro.halt_after_step = hi - 1;
    if (h.first_step > 0) {
      auto from = resume_point(cfg.checkpoint.dir, h);
      if (!from) return from.err();
      ro.resume = from.value();
    }
    auto r = run_actor_job(cfg, ro);
    message_checker& c = v->checker();
    if (!c.mismatch()) {
      if (!r.ok()) {
        core::error e = r.err();
        e.message = "the replayed job failed before any difference from the recording: " + e.message;
        return e;
      }
      c.finish();
    }
    rep.messages += c.matched();
    if (c.mismatch()) {
      rep.mismatch = *c.mismatch();
      if (!opt.dump_dir.empty())
        if (auto st = write_dump(opt.dump_dir, c.mismatch_step(), c.tensors_of(c.mismatch_step()),
                                 rep.dump_file);
            !st)
          return st.err();
      return rep;
    }
    if (hi - 1 == last_step && !opt.dump_dir.empty())
      if (auto st = write_dump(opt.dump_dir, last_step, c.tensors_of(last_step), rep.dump_file); !st)
        return st.err();
  }
  rep.matched = true;
  return rep;
}

}  // namespace

message_checker::message_checker(const recorded_run& run, std::int64_t lo, std::int64_t hi,
                                 bool keep_tensors,
                                 std::function<bool(const message_record&)> in_scope)
    : run_(run), lo_(lo), hi_(hi), keep_(keep_tensors), in_scope_(std::move(in_scope)) {}

bool message_checker::check(const message_record& sent, const core::tensor& bytes) {
  if (sent.tag.step < lo_ || sent.tag.step >= hi_) return true;  // outside the steps compared
  keep(sent, bytes);
  auto it = run_.records.find(key_of(sent));
  // A record of an older log format holds the hash under that format's definition: the replayed
  // bytes are hashed the same way.
  message_record r = sent;
  if (it != run_.records.end() && it->second.hash_def != r.hash_def) {
    r.hash_def = it->second.hash_def;
    r.hash = tensor_hash(bytes, r.hash_def);
  }
  if (it == run_.records.end()) {
    fail(r.tag.step, "the replay sent a tensor the recorded run did not: " + describe(r) +
                         ", hash " + hex(r.hash) + "; no such line in " +
                         messages_dir(run_.dir) + "/rank_" + std::to_string(r.src) + ".log");
    return false;
  }
  const message_record& want = it->second;
  if (want.hash != r.hash || want.dtype != r.dtype || want.shape != r.shape) {
    std::string what = "the replay differs from the recorded run at " + describe(r) + ": ";
    if (want.dtype != r.dtype || want.shape != r.shape)
      what += "recorded " + std::string(core::dtype_name(want.dtype)) + " " +
              core::shape_string(want.shape) + ", replayed " + core::dtype_name(r.dtype) + " " +
              core::shape_string(r.shape) + "; ";
    what += "recorded hash " + hex(want.hash) + " (" + where(want) + "), replayed hash " +
            hex(r.hash);
    fail(r.tag.step, what);
    return false;
  }
  seen_.insert(key_of(r));
  return true;
}

void message_checker::finish() {
  if (mismatch_) return;
  const message_record* first = nullptr;
  for (const auto& [k, r] : run_.records)
    if (r.tag.step >= lo_ && r.tag.step < hi_ && !seen_.count(k) && in_scope_(r) &&
        (!first || r.tag.step < first->tag.step))
      first = &r;
  if (!first) return;
  fail(first->tag.step, "the recorded run sent a tensor the replay did not: " + describe(*first) +
                            ", hash " + hex(first->hash) + " (" + where(*first) + ")");
}

std::vector<model::safetensors::named_tensor> message_checker::tensors_of(std::int64_t step) const {
  std::vector<model::safetensors::named_tensor> out;
  auto it = kept_.find(step);
  if (it != kept_.end())
    for (const auto& [name, t] : it->second) out.push_back({name, t});
  return out;
}

void message_checker::fail(std::int64_t step, std::string what) {
  mismatch_ = std::move(what);
  mismatch_step_ = step;
}

// Keeps copies of the two newest steps' tensors (the loader cuts one step ahead) for dumps.
void message_checker::keep(const message_record& r, const core::tensor& bytes) {
  if (!keep_) return;
  kept_[r.tag.step][dump_name(r)] = bytes.clone();
  while (kept_.size() > 2) kept_.erase(kept_.begin());
}

core::status write_dump(const std::string& dir, std::int64_t step,
                        std::vector<model::safetensors::named_tensor> tensors, std::string& path) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    return core::error::at_file(dir, "cannot create the dump directory: " + ec.message(),
                                "choose a writable --dump-tensors DIR");
  path = (fs::path(dir) / ("step_" + std::to_string(step) + ".safetensors")).string();
  auto w = model::safetensors::write(path, tensors,
                                     {{"troupe", "replay dump"}, {"step", std::to_string(step)}});
  if (!w) return w.err();
  return core::status::success();
}

core::result<recorded_run> load_recorded_run(const std::string& run_dir) {
  const fs::path dir(run_dir);
  if (!fs::is_directory(dir))
    return core::error::at_file(run_dir, "no such run directory",
                                "pass the runtime.run_dir of a recorded `troupe train`");
  const fs::path cfg_path = dir / "config.toml";
  if (!fs::exists(cfg_path))
    return core::error::at_file(run_dir, "not a troupe run directory: it has no config.toml",
                                "pass the runtime.run_dir of a recorded `troupe train`");
  recorded_run run;
  run.dir = run_dir;
  {
    core::input_spec spec;
    spec.what = "run configuration";
    spec.hint = "pass the runtime.run_dir of a recorded `troupe train`";
    auto text = core::read_input(cfg_path.string(), spec);
    if (!text) return text.err();
    run.config_text = std::move(text.value());
  }
  auto cfg = core::parse_config(run.config_text, cfg_path.string());
  if (!cfg) return cfg.err();
  run.cfg = cfg.value();
  if (!run.cfg.runtime.record)
    return core::error::at_key(cfg_path.string(), "runtime.record", 0, 0,
                               "the run was not recorded (runtime.record = false), so there is "
                               "nothing to replay against",
                               "train again with runtime.record = true (the default)");
  run.workers = run.cfg.parallel.data_parallel * run.cfg.parallel.pipeline_stage *
                run.cfg.parallel.model_parallel;
  const std::string mdir = messages_dir(run_dir);
  if (!fs::is_directory(mdir))
    return core::error::at_file(mdir, "the run has no message logs",
                                "train again with runtime.record = true (the default)");
  const std::uint64_t config_hash =
      model::safetensors::xxh64(run.config_text.data(), run.config_text.size());
  for (int w = 0; w < run.workers; ++w) {
    auto log = read_log(mdir, w);
    if (!log) return log.err();
    auto& l = log.value();
    const std::string file = mdir + "/rank_" + std::to_string(w) + ".log";
    if (w == 0) run.segments = l.segments;
    bool same = l.segments.size() == run.segments.size();
    for (std::size_t i = 0; same && i < l.segments.size(); ++i)
      same = l.segments[i].first_step == run.segments[i].first_step &&
             l.segments[i].end_step == run.segments[i].end_step &&
             l.segments[i].workers == run.workers;
    if (!same)
      return core::error::at_file(file, "its invocations (header lines) do not match rank 0's or "
                                        "the " + std::to_string(run.workers) + " workers of config.toml",
                                  "the logs are from different runs; record the run again");
    for (std::size_t i = 0; i < l.segments.size(); ++i)
      if (l.segments[i].config_xxh64 != config_hash)
        return core::error::at_file(
            file, "invocation " + std::to_string(i + 1) + " (steps from " +
                      std::to_string(l.segments[i].first_step) +
                      ") ran with another config than config.toml",
            "replay needs every invocation of the run to use the same config; record the run again");
    for (auto& r : l.records) {
      auto [it, fresh] = run.records.emplace(key_of(r), r);
      if (!fresh)
        return core::error::at_file(file, "line " + std::to_string(r.line) + " records the same "
                                    "tensor as " + where(it->second),
                                    "the log is damaged; record the run again");
    }
    for (auto& c : l.clips) run.clips[{c.src, c.step}] = c;
  }
  return run;
}

core::result<replay_report> replay_run(const replay_options& opt) {
  auto run = load_recorded_run(opt.run_dir);
  if (!run) return run.err();
  const auto& segs = run->segments;
  const int first = segs.front().first_step;
  const int recorded_last = segs.back().end_step - 1;
  if (recorded_last < first)
    return core::error::at_file(opt.run_dir, "the recorded run ran no steps", "");
  int last = recorded_last;
  if (opt.until_step >= 0) {
    if (opt.until_step < first || opt.until_step > recorded_last)
      return core::error::make("--until-step " + std::to_string(opt.until_step) +
                                   " is outside the recorded steps " + std::to_string(first) +
                                   ".." + std::to_string(recorded_last),
                               "choose a step in that range");
    last = opt.until_step;
  }
  if (opt.rank >= 0) {
    if (opt.rank >= run->workers)
      return core::error::make("--rank " + std::to_string(opt.rank) + " is not a worker: the run has " +
                                   std::to_string(run->workers) + " (ranks 0.." +
                                   std::to_string(run->workers - 1) + ")",
                               "choose a rank in that range");
    return replay_one_rank(run.value(), opt, last);
  }
  if (auto st = core::check_files(run->cfg); !st) return st.err();
  return replay_whole(run.value(), opt, last);
}

core::result<run_comparison> compare_runs(const std::string& run_a, const std::string& run_b) {
  auto a = load_recorded_run(run_a);
  if (!a) return a.err();
  auto b = load_recorded_run(run_b);
  if (!b) return b.err();
  run_comparison out;
  // The run directory is the one key two runs of one config must differ in.
  auto without_run_dir = [](const std::string& text) {
    std::istringstream in(text);
    std::string line, kept;
    while (std::getline(in, line))
      if (line.find_first_not_of(" \t") == std::string::npos ||
          line.compare(line.find_first_not_of(" \t"), 7, "run_dir") != 0)
        kept += line + "\n";
    return kept;
  };
  out.configs_differ = without_run_dir(a->config_text) != without_run_dir(b->config_text);
  // Every key of either run, with its record in each (null where that run has none).
  std::map<message_key, std::pair<const message_record*, const message_record*>> both;
  for (const auto& [k, r] : a->records) both[k].first = &r;
  for (const auto& [k, r] : b->records) both[k].second = &r;
  std::set<std::int64_t> steps;
  std::vector<std::pair<const message_record*, const message_record*>> diff;
  for (const auto& [k, p] : both) {
    steps.insert(k.tag.step);
    const auto [x, y] = p;
    if (x && y && x->hash_def != y->hash_def)
      return core::error::make("the logs of " + run_a + " and " + run_b +
                         " use different message hash definitions (" + x->file + " line " +
                         std::to_string(x->line) + ", " + y->file + " line " +
                         std::to_string(y->line) + ")",
                         "record both runs with the same troupe to compare them");
    if (x && y && x->hash == y->hash && x->dtype == y->dtype && x->shape == y->shape) continue;
    diff.push_back(p);
  }
  out.messages = static_cast<std::int64_t>(both.size());
  out.differing = static_cast<std::int64_t>(diff.size());
  out.steps = static_cast<int>(steps.size());
  auto step_of = [](const auto& p) { return (p.first ? p.first : p.second)->tag.step; };
  for (const auto& p : diff)
    if (out.first_step < 0 || step_of(p) < out.first_step) out.first_step = step_of(p);
  // Clip records: the shards' scale and learning rate follow from every gradient, so a difference
  // there dates the parting to the step even when no tensor of it was logged differently yet.
  std::vector<std::string> clips;
  std::int64_t clip_step = -1;
  for (const auto& [k, x] : a->clips) {
    auto it = b->clips.find(k);
    if (it == b->clips.end()) continue;
    const clip_record& y = it->second;
    if (x.scale == y.scale && x.lr == y.lr && x.loss_scale == y.loss_scale && x.skip == y.skip)
      continue;
    if (clip_step < 0 || x.step < clip_step) {
      clip_step = x.step;
      clips.clear();
    }
    if (x.step == clip_step) {
      char text[160];
      std::snprintf(text, sizeof text,
                    "optimizer_shard(pp=%d, part=%d) on rank %d: clip scale %a vs %a", x.pp, x.part,
                    x.src, static_cast<double>(x.scale), static_cast<double>(y.scale));
      clips.emplace_back(text);
    }
  }
  if (out.first_step < 0 && clip_step >= 0) out.first_step = clip_step;
  if (clip_step == out.first_step) out.clip_differences = clips;
  out.same = out.first_step < 0;
  if (out.same) return out;
  // Each worker's first differing message of that step, in the order its log has them.
  std::map<int, std::pair<const message_record*, const message_record*>> first_of;
  for (const auto& p : diff) {
    if (step_of(p) != out.first_step) continue;
    ++out.differing_in_first_step;
    const message_record* r = p.first ? p.first : p.second;
    auto [it, fresh] = first_of.emplace(r->src, p);
    const message_record* held = it->second.first ? it->second.first : it->second.second;
    // Lines of one run's log are comparable; a message in B only sorts after A's.
    const bool earlier = p.first && (!it->second.first || p.first->line < held->line);
    if (!fresh && earlier) it->second = p;
  }
  for (const auto& [src, p] : first_of) {
    const auto [x, y] = p;
    const message_record& r = x ? *x : *y;
    std::string line = describe(r) + ": ";
    if (!x) {
      line += "only in " + run_b + " (" + where(*y) + "), hash " + hex(y->hash);
    } else if (!y) {
      line += "only in " + run_a + " (" + where(*x) + "), hash " + hex(x->hash);
    } else {
      if (x->dtype != y->dtype || x->shape != y->shape)
        line += std::string(core::dtype_name(x->dtype)) + " " + core::shape_string(x->shape) +
                " vs " + core::dtype_name(y->dtype) + " " + core::shape_string(y->shape) + "; ";
      line += "hash " + hex(x->hash) + " (" + where(*x) + ") vs " + hex(y->hash) + " (" +
              where(*y) + ")";
    }
    out.first_differences.push_back(line);
  }
  return out;
}

}  // namespace troupe::actors
