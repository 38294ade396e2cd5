#include "report/run.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string_view>

namespace troupe::report {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

double number_or_nan(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number()) return std::nan("");
  return it->get<double>();
}

std::optional<double> optional_number(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end()) return std::nullopt;
  return it->is_number() ? it->get<double>() : std::nan("");
}

std::uint64_t bytes_of(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<std::uint64_t>() : 0;
}

std::string shorten(const std::string& text, std::size_t n = 120) {
  return text.size() <= n ? text : text.substr(0, n) + "…";
}

// The chunks' costs from the `device_costs` objects of a run's steps (read_chunk_costs).
core::result<std::vector<schedules::chunk_cost>> chunk_costs_of(std::vector<nlohmann::json> steps) {
  if (steps.size() > 2) steps.erase(steps.begin(), steps.begin() + 2);  // warm-up steps
  std::size_t chunks = 0;
  for (const auto& s : steps)
    if (s.is_object())
      for (const auto& [k, v] : s.items())
        if (v.is_array()) chunks = std::max(chunks, v.size());
  // The median over steps of one kind on one chunk; -1 when no step measured it.
  const auto median_of = [&](const char* kind, std::size_t c) {
    std::vector<double> v;
    for (const auto& s : steps)
      if (s.is_object() && s.contains(kind) && s[kind].is_array() && c < s[kind].size() &&
          s[kind][c].is_number())
        v.push_back(s[kind][c].get<double>());
    if (v.empty()) return -1.0;
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
  };
  std::vector<schedules::chunk_cost> out(chunks);
  for (std::size_t c = 0; c < chunks; ++c) {
    schedules::chunk_cost& k = out[c];
    k.f = median_of("f", c), k.b = median_of("b", c), k.i = median_of("i", c);
    k.w = median_of("w", c);
    if (k.f < 0 || (k.b < 0 && (k.i < 0 || k.w < 0)))
      return core::error::make("chunk " + std::to_string(c) +
                               " has no measured forward or backward");
    // A schedule with a split backward measured I and W; one without, B.
    if (k.b < 0) k.b = k.i + k.w;
    if (k.i < 0 || k.w < 0) k.i = k.w = k.b / 2;
  }
  return out;
}

void read_stages(run_data& run, const nlohmann::json& stages, double device_span_s) {
  if (!stages.is_array()) return;
  for (const auto& s : stages) {
    if (!s.is_object() || !s.contains("pp") || !s.contains("dp")) continue;
    auto& acc = run.stages[{s["pp"].get<int>(), s["dp"].get<int>()}];
    acc.busy_s.push_back(number_or_nan(s, "busy_s"));
    acc.comm_s.push_back(number_or_nan(s, "comm_s"));
    acc.wait_s.push_back(number_or_nan(s, "wait_s"));
    acc.bubble.push_back(number_or_nan(s, "bubble"));
    if (s.contains("device_busy_s") && std::isfinite(device_span_s)) {
      const double busy = number_or_nan(s, "device_busy_s");
      acc.device_busy_s.push_back(busy);
      acc.device_idle_s.push_back(std::max(0.0, device_span_s - busy));
      acc.device_bubble.push_back(number_or_nan(s, "device_bubble"));
    }
    acc.peak_activation_bytes = std::max(acc.peak_activation_bytes, bytes_of(s, "peak_activation_bytes"));
    acc.peak_device_bytes = std::max(acc.peak_device_bytes, bytes_of(s, "peak_device_bytes"));
    acc.optimizer_peak_device_bytes =
        std::max(acc.optimizer_peak_device_bytes, bytes_of(s, "optimizer_peak_device_bytes"));
  }
}

// metrics.jsonl: one object per line, steps strictly increasing; see run.hpp for what is skipped.
void read_metrics(run_data& run, const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    run.notes.push_back("no metrics.jsonl in " + run.dir + ": nothing to plot over steps");
    return;
  }
  const int train_steps = run.cfg ? run.cfg->train.steps : -1;
  int lines_seen = 0;
  std::string line;
  int number = 0;
  double offset = 0;  // training time of earlier invocations
  std::vector<std::string> skipped;
  std::vector<nlohmann::json> device_costs;  // of the accepted lines, in order
  bool last_unterminated = false;
  while (std::getline(in, line)) {
    ++number;
    last_unterminated = in.eof();  // getline hit the end before a newline
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    ++lines_seen;
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object()) {
      skipped.push_back("line " + std::to_string(number) +
                        (last_unterminated ? " is incomplete (the run may still be writing it)"
                                           : " is not a JSON object") +
                        ": " + shorten(line, 60));
      continue;
    }
    if (!j.contains("step") || !j["step"].is_number_integer() || !j.contains("loss")) {
      skipped.push_back("line " + std::to_string(number) + " has no integer \"step\" or no \"loss\"");
      continue;
    }
    step_row r;
    r.line = number;
    r.step = j["step"].get<int>();
    if (train_steps > 0 && r.step >= train_steps) {
      skipped.push_back("line " + std::to_string(number) + ": step " + std::to_string(r.step + 1) +
                        " is beyond config.toml's train.steps = " + std::to_string(train_steps) +
                        " (a line of another run)");
      continue;
    }
    if (!run.rows.empty() && r.step <= run.rows.back().step) {
      skipped.push_back("line " + std::to_string(number) + ": step " + std::to_string(r.step + 1) +
                        " after step " + std::to_string(run.rows.back().step + 1) +
                        " (a line of another run writing the same file)");
      continue;
    }
    r.loss = number_or_nan(j, "loss");
    r.lr = number_or_nan(j, "lr");
    r.grad_norm = number_or_nan(j, "grad_norm");
    r.tokens_per_s = number_or_nan(j, "tokens_per_s");
    r.elapsed_s = number_or_nan(j, "elapsed_s");
    r.val_loss = optional_number(j, "val_loss");
    r.loss_scale = optional_number(j, "loss_scale");
    r.bubble = optional_number(j, "bubble");
    r.skipped = j.value("skipped", false);
    if (!run.rows.empty()) {
      const step_row& prev = run.rows.back();
      if (r.step > prev.step + 1)
        run.notes.push_back("metrics.jsonl line " + std::to_string(number) + ": steps " +
                            std::to_string(prev.step + 2) + ".." + std::to_string(r.step) +
                            " are missing");
      // A resumed invocation's clock starts again: join it to the previous one.
      if (std::isfinite(r.elapsed_s) && std::isfinite(prev.elapsed_s) && r.elapsed_s < prev.elapsed_s) {
        offset = prev.time_s;
        run.marks.push_back({"restart", r.step, "resumed after step " + std::to_string(r.step) +
                                                    " (metrics.jsonl line " +
                                                    std::to_string(number) + ")"});
      }
    }
    r.time_s = offset + (std::isfinite(r.elapsed_s) ? r.elapsed_s : 0);
    if (r.skipped)
      run.marks.push_back({"skipped", r.step + 1, "step " + std::to_string(r.step + 1) +
                                                      " skipped (non-finite gradients)"});
    r.device_bubble = optional_number(j, "device_bubble");
    read_stages(run, j.value("stages", nlohmann::json()), number_or_nan(j, "device_span_s"));
    if (j.contains("device_costs")) device_costs.push_back(j["device_costs"]);
    run.rows.push_back(std::move(r));
  }
  if (lines_seen == 0)
    run.notes.push_back("metrics.jsonl has no lines yet: the run has not finished a step");
  if (!device_costs.empty()) {
    auto costs = chunk_costs_of(std::move(device_costs));
    if (costs) run.chunk_costs = std::move(*costs);
    else run.notes.push_back("metrics.jsonl device_costs: " + costs.err().message);
  }
  // Long lists are cut: the first few say what happened.
  const std::size_t shown = 8;
  for (std::size_t i = 0; i < skipped.size() && i < shown; ++i)
    run.notes.push_back("metrics.jsonl " + skipped[i] + "; skipped");
  if (skipped.size() > shown)
    run.notes.push_back("metrics.jsonl: " + std::to_string(skipped.size() - shown) +
                        " more lines skipped for the same reasons");
}

// Checkpoints are directories step_NNNNNN holding a manifest.json (checkpoint.dir, or
// <run>/checkpoints). A relative checkpoint.dir is taken from the current directory, like
// troupe train takes it.
void read_checkpoints(run_data& run) {
  fs::path root = fs::path(run.dir) / "checkpoints";
  if (run.cfg && !run.cfg->checkpoint.dir.empty()) root = run.cfg->checkpoint.dir;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return;
  static const std::regex name("step_(\\d{6,})");
  for (const auto& e : fs::directory_iterator(root, ec)) {
    std::smatch m;
    const std::string base = e.path().filename().string();
    if (!e.is_directory() || !std::regex_match(base, m, name)) continue;
    if (!fs::exists(e.path() / "manifest.json")) continue;  // not (yet) a complete checkpoint
    run.marks.push_back({"checkpoint", std::stoi(m[1].str()), "checkpoint " + base});
  }
}

// Faults: the errors `troupe launch` workers logged (<run>/logs/worker_R.log), at the step they
// name when they name one.
void read_faults(run_data& run) {
  const fs::path logs = fs::path(run.dir) / "logs";
  std::error_code ec;
  if (!fs::is_directory(logs, ec)) return;
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(logs, ec))
    if (e.path().extension() == ".log") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  static const std::regex step_re("step (\\d+)"), rank_re("^rank \\d+: ");
  std::set<std::string> seen;
  for (const auto& f : files) {
    std::ifstream in(f);
    std::vector<std::string> lines;
    for (std::string line; std::getline(in, line);) lines.push_back(line);
    for (std::size_t i = 0; i < lines.size(); ++i) {
      const auto at = lines[i].find("error: ");
      if (at == std::string::npos) continue;
      std::string text = lines[i].substr(at + 7);
      // An error's indented continuation lines (who waits on whom, the hint) belong to it.
      while (i + 1 < lines.size() && !lines[i + 1].empty() &&
             (lines[i + 1][0] == ' ' || lines[i + 1][0] == '\t'))
      {
        ++i;
        text += " / " + lines[i].substr(lines[i].find_first_not_of(" \t"));
      }
      // Every worker reports the job's error, each as "rank R: ...": one mark for it.
      if (!seen.insert(std::regex_replace(text, rank_re, "")).second) continue;
      std::smatch m;
      int step = run.rows.empty() ? 0 : run.rows.back().step + 1;
      if (std::regex_search(text, m, step_re)) step = std::stoi(m[1].str());
      run.marks.push_back({"fault", step, f.filename().string() + ": " + shorten(text, 600)});
    }
  }
}

std::string read_all(std::ifstream& in, std::uint64_t from, std::uint64_t n) {
  std::string out(n, '\0');
  in.clear();
  in.seekg(static_cast<std::streamoff>(from));
  in.read(out.data(), static_cast<std::streamsize>(n));
  out.resize(static_cast<std::size_t>(in.gcount()));
  return out;
}

// The step of one trace line without parsing the whole line; -1 when it has none.
int step_of_line(const std::string& line) {
  const auto at = line.find("\"step\":");
  if (at == std::string::npos) return -1;
  return std::atoi(line.c_str() + at + 7);
}

}  // namespace

std::pair<int, std::vector<trace_event>> read_trace_tail(const std::string& path, int max_step,
                                                         std::vector<std::string>& notes) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return {-1, {}};
  in.seekg(0, std::ios::end);
  const std::uint64_t size = static_cast<std::uint64_t>(in.tellg());
  const std::string head = read_all(in, 0, std::min<std::uint64_t>(size, 64));
  if (head.find("\"traceEvents\"") == std::string::npos) {
    notes.push_back("trace.json does not start like a troupe trace (no \"traceEvents\"); not read");
    return {-1, {}};
  }
  // Read ever larger tails until the chosen step's first event is preceded by an older step's
  // (trace.json is written step by step), or the whole file is read. A line that does not parse
  // (cut by a run still writing, or by a crash) is skipped and counted.
  int chosen = -1, bad = 0;
  std::vector<trace_event> events;
  for (std::uint64_t chunk = 1 << 20;; chunk *= 4) {
    const std::uint64_t from = size > chunk ? size - chunk : 0;
    const std::string text = read_all(in, from, size - from);
    std::vector<std::string_view> lines;
    std::size_t p = from > 0 ? text.find('\n') + 1 : 0;  // the first line of a tail is cut
    while (p < text.size()) {
      std::size_t e = text.find('\n', p);
      if (e == std::string::npos) e = text.size();
      lines.push_back(std::string_view(text).substr(p, e - p));
      p = e + 1;
    }
    chosen = -1;
    bad = 0;
    events.clear();
    bool older_seen = false;
    for (auto it = lines.rbegin(); it != lines.rend() && !older_seen; ++it) {
      std::string l(*it);
      const int s = step_of_line(l);
      if (s < 0 || s > max_step || (chosen >= 0 && s > chosen)) continue;
      if (chosen >= 0 && s < chosen) {
        older_seen = true;
        break;
      }
      while (!l.empty() && (l.back() == ',' || l.back() == '\r' || l.back() == ' ')) l.pop_back();
      const json j = json::parse(l, nullptr, false);
      if (j.is_discarded() || !j.is_object() || !j.contains("ts") || !j.contains("dur") ||
          !j["ts"].is_number() || !j["dur"].is_number()) {
        ++bad;
        continue;
      }
      // The device's tracks (GPU time of the same instructions) are not the schedule's timeline.
      if (j.value("cat", std::string()) == "device") continue;
      chosen = s;
      events.push_back({j.value("name", std::string("?")), j.value("cat", std::string("compute")),
                        j["ts"].get<double>(), j["dur"].get<double>(), j.value("pid", 0),
                        j.value("tid", 0)});
    }
    if (older_seen || from == 0) break;
  }
  std::reverse(events.begin(), events.end());
  if (bad > 0)
    notes.push_back("trace.json: " + std::to_string(bad) +
                    " event lines cut or unreadable near its end; skipped");
  std::string tail = read_all(in, size > 16 ? size - 16 : 0, std::min<std::uint64_t>(size, 16));
  if (tail.find("]}") == std::string::npos)
    notes.push_back("trace.json is not closed: the run is still being written, or stopped "
                    "before its end (the events read are complete lines)");
  return {chosen, std::move(events)};
}

core::result<std::vector<schedules::chunk_cost>> read_chunk_costs(const std::string& path) {
  const std::string hint =
      "name the metrics.jsonl of a `troupe train` run on a GPU (runtime.device = \"cuda\", "
      "pipeline_stage > 1)";
  std::ifstream in(path);
  if (!in) return core::error::make(path + ": cannot open the file", hint);
  std::vector<nlohmann::json> steps;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (line.find("\"device_costs\"") == std::string::npos) continue;
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j["device_costs"].is_object())
      return core::error::make(
          path + ": line " + std::to_string(n) + " is not a JSON object with device_costs", hint);
    steps.push_back(std::move(j["device_costs"]));
  }
  if (steps.empty()) return core::error::make(path + ": no line has device_costs", hint);
  auto costs = chunk_costs_of(std::move(steps));
  if (!costs) return core::error::make(path + ": " + costs.err().message, hint);
  return costs;
}

core::result<run_data> read_run(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    return core::error::at_file(dir, "not a run directory",
                                "pass the runtime.run_dir of a troupe train or troupe launch run");
  run_data run;
  run.dir = dir;
  run.name = fs::path(dir).lexically_normal().filename().string();
  if (run.name.empty() || run.name == ".")
    run.name = fs::absolute(dir).lexically_normal().parent_path().filename().string();

  const fs::path config = fs::path(dir) / "config.toml";
  if (fs::exists(config)) {
    auto cfg = core::load_config(config.string());
    if (cfg)
      run.cfg = cfg.value();
    else
      run.notes.push_back("config.toml not used (" + cfg.err().to_string() +
                          "): no tokens axis, FLOP/s, simulation or config comparison");
  } else {
    run.notes.push_back("no config.toml in " + dir +
                        ": no tokens axis, FLOP/s, simulation or config comparison");
  }
  read_metrics(run, fs::path(dir) / "metrics.jsonl");
  read_checkpoints(run);
  read_faults(run);
  const fs::path trace = fs::path(dir) / "trace.json";
  if (fs::exists(trace) && !run.rows.empty()) {
    auto [step, events] = read_trace_tail(trace.string(), run.rows.back().step, run.notes);
    run.trace_step = step;
    run.trace = std::move(events);
  }
  return run;
}

}  // namespace troupe::report
