#include "report/page.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <variant>

#include "report/assets.hpp"
#include "schedules/lower.hpp"
#include "schedules/render.hpp"
#include "schedules/registry.hpp"
#include "schedules/simulate.hpp"

namespace troupe::report {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// ---- series ----------------------------------------------------------------------------------

struct series {
  std::vector<int> rows;
  std::vector<double> values;
};

// Keeps every point when there are at most `max_points`; otherwise the rows are cut into
// max_points / 2 buckets and each keeps its minimum and its maximum, in row order.
series downsample(const series& s, int max_points) {
  const std::size_t n = s.rows.size();
  if (n <= static_cast<std::size_t>(std::max(2, max_points))) return s;
  const std::size_t buckets = static_cast<std::size_t>(std::max(1, max_points / 2));
  series out;
  for (std::size_t b = 0; b < buckets; ++b) {
    const std::size_t lo = b * n / buckets, hi = (b + 1) * n / buckets;
    if (lo >= hi) continue;
    std::size_t mn = lo, mx = lo;
    for (std::size_t i = lo; i < hi; ++i) {
      if (s.values[i] < s.values[mn]) mn = i;
      if (s.values[i] > s.values[mx]) mx = i;
    }
    for (std::size_t i : {std::min(mn, mx), std::max(mn, mx)}) {
      if (!out.rows.empty() && out.rows.back() == s.rows[i]) continue;
      out.rows.push_back(s.rows[i]);
      out.values.push_back(s.values[i]);
    }
  }
  return out;
}

template <class F>
series collect(const std::vector<step_row>& rows, F value) {
  series s;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const std::optional<double> v = value(rows[i]);
    if (v && std::isfinite(*v)) {
      s.rows.push_back(static_cast<int>(i));
      s.values.push_back(*v);
    }
  }
  return s;
}

json to_json(const series& s) { return {{"i", s.rows}, {"v", s.values}}; }

double median(std::vector<double> v) {
  v.erase(std::remove_if(v.begin(), v.end(), [](double x) { return !std::isfinite(x); }), v.end());
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double round_to(double x, double unit) { return std::round(x / unit) * unit; }

// ---- the simulator's prediction --------------------------------------------------------------

// "1F3" -> 'F'; "2RECV_F3<-1" -> 'S' (a transfer); "0REDUCE_GRAD" -> 'R'; others 0.
char kind_of(const trace_event& e) {
  if (e.cat == "wait") return 0;
  if (e.name.find("REDUCE") != std::string::npos) return 'R';
  if (e.name.find("SEND") != std::string::npos || e.name.find("RECV") != std::string::npos)
    return 'S';
  static const std::regex compute("\\d+([FBIW])\\d+");
  std::smatch m;
  if (std::regex_match(e.name, m, compute)) return m[1].str()[0];
  return 0;
}

std::string op_name(schedules::op_kind k) {
  using schedules::op_kind;
  switch (k) {
    case op_kind::F: return "F";
    case op_kind::B: return "B";
    case op_kind::I: return "I";
    case op_kind::W: return "W";
    case op_kind::REDUCE_GRAD: return "REDUCE_GRAD";
    case op_kind::STEP: return "STEP";
    default: return "comm";
  }
}

json simulated(const run_data& run, const schedules::cost_model& c, json costs, std::string& note);

// The schedule of `cfg` simulated with the costs the run measured (seconds): on a GPU each chunk's
// device time per instruction kind (metrics.jsonl's device_costs), else the mean duration of each
// instruction kind in the traced step. The STEP costs nothing: the measured bubble's span leaves
// it out too.
json prediction(const run_data& run, std::string& note) {
  if (!run.cfg) {
    note = "no simulation: config.toml is missing";
    return nullptr;
  }
  schedules::cost_model c;
  json costs = json::object();
  if (!run.chunk_costs.empty()) {
    // ms in metrics.jsonl, seconds on the page; the stages' hand-overs on one GPU are events.
    json per_chunk = json::array();
    for (schedules::chunk_cost k : run.chunk_costs) {
      k.f *= 1e-3, k.b *= 1e-3, k.i *= 1e-3, k.w *= 1e-3;
      c.chunks.push_back(k);
      per_chunk.push_back({{"F", k.f}, {"B", k.b}, {"I", k.i}, {"W", k.w}});
    }
    c.comm = c.reduce = c.step = 0;
    costs["chunks"] = std::move(per_chunk);
    return simulated(run, c, std::move(costs), note);
  }
  if (run.trace.empty()) {
    note = "no simulation: no trace.json step to take durations from";
    return nullptr;
  }
  std::map<char, std::pair<double, int>> acc;
  for (const auto& e : run.trace)
    if (char k = kind_of(e)) {
      acc[k].first += e.dur_us * 1e-6;
      acc[k].second += 1;
    }
  auto mean = [&](char k) { return acc.count(k) ? acc[k].first / acc[k].second : 0.0; };
  if (!acc.count('F')) {
    note = "no simulation: the traced step has no forward instructions";
    return nullptr;
  }
  c.f = mean('F');
  c.i = mean('I');
  c.w = mean('W');
  c.b = acc.count('B') ? mean('B') : c.i + c.w;
  if (!acc.count('I') && !acc.count('W')) c.i = c.w = c.b / 2;
  c.comm = mean('S');
  c.reduce = mean('R');
  c.step = 0;
  for (auto [k, name] : {std::pair{'F', "F"}, {'B', "B"}, {'I', "I"}, {'W', "W"}, {'S', "comm"},
                         {'R', "reduce"}})
    if (acc.count(k)) costs[name] = mean(k);
  return simulated(run, c, std::move(costs), note);
}

// The schedule of run.cfg simulated with `c`; `costs` is what the page says they were.
json simulated(const run_data& run, const schedules::cost_model& c, json costs, std::string& note) {
  const core::config& cfg = *run.cfg;
  schedules::schedule_options o;
  o.virtual_stages = cfg.parallel.virtual_pipeline;
  o.costs = c;
  const std::string which = cfg.schedule.file.empty() ? cfg.schedule.name : cfg.schedule.file;
  auto s = schedules::make_schedule(which, cfg.parallel.pipeline_stage,
                                    cfg.parallel.micro_batch_num * cfg.train.gradient_accumulation_steps, o);
  if (!s) {
    note = "no simulation: schedule " + which + ": " + s.err().to_string();
    return nullptr;
  }
  auto sim = schedules::simulate(schedules::lower(s.value(), c), c);
  if (!sim) {
    note = "no simulation: " + sim.err().to_string();
    return nullptr;
  }
  json ranks = json::array(), timeline = json::array();
  for (const auto& r : sim->ranks)
    ranks.push_back({{"compute_s", r.compute}, {"transfer_s", r.transfer}, {"other_s", r.other},
                     {"idle_s", r.idle}, {"bubble", r.bubble}});
  for (const auto& rank : sim->timeline) {
    json events = json::array();
    for (const auto& t : rank)
      if (t.end > t.start)
        events.push_back({schedules::to_string(t.op), op_name(t.op.kind), t.start, t.end});
    timeline.push_back(std::move(events));
  }
  return {{"schedule", which}, {"bubble", sim->bubble}, {"makespan_s", sim->makespan},
          {"costs", costs}, {"ranks", ranks}, {"timeline", timeline}};
}

// ---- one run ---------------------------------------------------------------------------------

std::string value_text(const core::config_value& v) {
  return std::visit(
      [](const auto& x) -> std::string {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, std::string>) return x;
        else if constexpr (std::is_same_v<T, bool>) return x ? "true" : "false";
        else if constexpr (std::is_same_v<T, double>) {
          char buf[32];
          std::snprintf(buf, sizeof buf, "%.9g", x);
          return buf;
        } else return std::to_string(x);
      },
      v);
}

json run_json(const run_data& run, const page_options& o) {
  const auto& rows = run.rows;
  double tokens_per_step = 0, flops_per_token = 0;
  json config = json::object(), summary = json::object();
  if (run.cfg) {
    const core::config& c = *run.cfg;
    tokens_per_step = static_cast<double>(core::derive(c).tokens_per_step);
    // PaLM's model FLOPs (appendix B): 6 per parameter and token, plus attention's 12·L·d·T.
    flops_per_token = 6.0 * static_cast<double>(core::parameter_count(c.model)) +
                      12.0 * c.model.num_layers * c.model.hidden_size * c.model.seq_length;
    for (const auto& e : core::config_entries(c)) config[e.key] = value_text(e.value);
    summary["train_steps"] = c.train.steps;
    summary["schedule"] = c.schedule.file.empty() ? c.schedule.name : c.schedule.file;
    std::string layout = "pp " + std::to_string(c.parallel.pipeline_stage) + " × dp " +
                         std::to_string(c.parallel.data_parallel);
    if (c.parallel.virtual_pipeline > 1) layout += " × v " + std::to_string(c.parallel.virtual_pipeline);
    const std::vector<int> split = core::chunk_layers(c);
    if (std::any_of(split.begin(), split.end(), [&](int n) { return n != split.front(); })) {
      layout += ", layers [";  // an uneven split: each chunk's layers
      for (std::size_t i = 0; i < split.size(); ++i) layout += (i ? ", " : "") + std::to_string(split[i]);
      layout += "]";
    }
    summary["layout"] = layout;
  }

  json x_step = json::array(), x_time = json::array();
  for (const auto& r : rows) {
    x_step.push_back(r.step + 1);
    x_time.push_back(round_to(r.time_s, 1e-3));
  }
  using opt = std::optional<double>;
  // A GPU run's bubble in GPU time (its host's says how far ahead the host queued).
  const bool device_bubbles =
      std::any_of(rows.begin(), rows.end(), [](const step_row& r) { return r.device_bubble; });
  std::map<std::string, series> all = {
      {"loss", collect(rows, [](const step_row& r) -> opt { return r.loss; })},
      {"lr", collect(rows, [](const step_row& r) -> opt { return r.lr; })},
      {"grad_norm", collect(rows, [](const step_row& r) -> opt { return r.grad_norm; })},
      {"tokens_per_s", collect(rows, [](const step_row& r) -> opt { return r.tokens_per_s; })},
      {"loss_scale", collect(rows, [](const step_row& r) -> opt { return r.loss_scale; })},
      {"bubble", collect(rows, [&](const step_row& r) -> opt {
         return device_bubbles ? r.device_bubble : r.bubble;
       })},
  };
  if (flops_per_token > 0)
    all["tflops"] = collect(rows, [&](const step_row& r) -> opt {
      return r.tokens_per_s * flops_per_token / 1e12;
    });
  else
    all["tflops"] = {};
  series val = collect(rows, [](const step_row& r) { return r.val_loss; });

  int buckets = 0;
  json series_json = json::object();
  for (auto& [name, s] : all) {
    if (static_cast<int>(s.rows.size()) > o.max_points) buckets = std::max(1, o.max_points / 2);
    series_json[name] = to_json(downsample(s, o.max_points));
  }

  json stages = json::array();
  for (const auto& [key, s] : run.stages)
    stages.push_back({{"pp", key.first}, {"dp", key.second}, {"steps", s.busy_s.size()},
                      {"busy_s", median(s.busy_s)}, {"comm_s", median(s.comm_s)},
                      {"wait_s", median(s.wait_s)}, {"bubble", median(s.bubble)},
                      {"peak_activation_bytes", s.peak_activation_bytes},
                      {"peak_device_bytes", s.peak_device_bytes},
                      {"optimizer_peak_device_bytes", s.optimizer_peak_device_bytes}});
  for (std::size_t i = 0; const auto& [key, s] : run.stages) {
    if (!s.device_busy_s.empty()) {
      stages[i]["device_busy_s"] = median(s.device_busy_s);
      stages[i]["device_idle_s"] = median(s.device_idle_s);
      stages[i]["device_bubble"] = median(s.device_bubble);
    }
    ++i;
  }

  json timeline = nullptr;
  std::string timeline_note;
  if (!run.trace.empty()) {
    double t0 = 1e300;
    for (const auto& e : run.trace) t0 = std::min(t0, e.ts_us);
    std::map<std::pair<int, int>, json> by_rank;  // (dp, pp)
    for (const auto& e : run.trace)
      by_rank[{e.dp, e.pp}].push_back({e.name, e.cat, (e.ts_us - t0) * 1e-6, e.dur_us * 1e-6});
    json trows = json::array();
    for (auto& [k, ev] : by_rank) trows.push_back({{"dp", k.first}, {"pp", k.second}, {"events", ev}});
    timeline = {{"step", run.trace_step}, {"events", run.trace.size()}, {"rows", trows}};
  } else {
    timeline_note = std::filesystem::exists(fs::path(run.dir) / "trace.json")
                        ? "trace.json holds no step of metrics.jsonl"
                        : "no trace.json (single-rank runs, --single-rank, write none)";
  }
  std::string prediction_note;
  json predicted = prediction(run, prediction_note);

  json marks = json::array();
  for (const auto& m : run.marks) marks.push_back({{"kind", m.kind}, {"step", m.step}, {"label", m.label}});

  if (!rows.empty()) {
    const step_row& last = rows.back();
    summary["steps_done"] = last.step + 1;
    summary["tokens"] = tokens_per_step * (last.step + 1);
    summary["time_s"] = last.time_s;
    summary["last_loss"] = last.loss;
    if (!val.values.empty()) summary["last_val_loss"] = val.values.back();
    summary["median_tokens_per_s"] = median(all["tokens_per_s"].values);
    summary["median_tflops"] = median(all["tflops"].values);
    summary["median_bubble"] = median(all["bubble"].values);
    summary["bubble_source"] = device_bubbles ? "device" : "host";
  } else {
    summary["steps_done"] = 0;
  }

  return {{"name", run.name},
          {"dir", run.dir},
          {"rows", rows.size()},
          {"tokens_per_step", tokens_per_step},
          {"flops_per_token", flops_per_token},
          {"downsampled", buckets},
          {"x", {{"step", x_step}, {"time", x_time}}},
          {"series", series_json},
          {"val", to_json(downsample(val, o.max_points))},
          {"stages", stages},
          {"prediction", predicted},
          {"prediction_note", prediction_note},
          {"timeline", timeline},
          {"timeline_note", timeline_note},
          {"marks", marks},
          {"notes", run.notes},
          {"config", config},
          {"summary", summary}};
}

// Keys whose values differ between the runs (a run without config.toml differs everywhere).
json config_diff(const std::vector<run_data>& runs, const json& run_jsons) {
  json diff = json::array();
  if (runs.size() < 2) return diff;
  std::vector<std::string> keys;
  std::set<std::string> seen;
  for (const auto& r : run_jsons)
    for (const auto& [k, v] : r["config"].items())
      if (seen.insert(k).second) keys.push_back(k);
  for (const auto& k : keys) {
    json values = json::array();
    std::set<std::string> distinct;
    for (const auto& r : run_jsons) {
      const json& c = r["config"];
      if (c.contains(k)) {
        values.push_back(c[k]);
        distinct.insert(c[k].get<std::string>());
      } else {
        values.push_back(nullptr);
        distinct.insert("\x01(none)");
      }
    }
    if (distinct.size() > 1) diff.push_back({{"key", k}, {"values", values}});
  }
  return diff;
}

std::string utc_now() {
  const std::time_t t = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S UTC", &tm);
  return buf;
}


}  // namespace

std::string page_json(const std::vector<run_data>& runs, const page_options& options) {
  json run_jsons = json::array();
  for (const auto& r : runs) run_jsons.push_back(run_json(r, options));
  json page = {{"generated", options.generated.empty() ? utc_now() : options.generated},
               {"config_diff", config_diff(runs, run_jsons)},
               {"runs", run_jsons}};
  // Invalid UTF-8 (a log line cut mid-character) is replaced rather than refused.
  return page.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string render_page(const std::vector<run_data>& runs, const page_options& options) {
  // '<' only occurs inside JSON strings, where \u003c means the same: no "</script>" can end the
  // data block early.
  std::string data;
  for (char ch : page_json(runs, options)) {
    if (ch == '<') data += "\\u003c";
    else data += ch;
  }
  std::string names;
  for (const auto& r : runs) names += (names.empty() ? "" : ", ") + r.name;
  const std::map<std::string_view, std::string> fill = {
      {"{{TITLE}}", schedules::xml_escape("troupe report: " + names)},
      {"{{CSS}}", std::string(assets::css)},
      {"{{DATA}}", data},
      {"{{JS}}", std::string(assets::js)}};
  // One pass over the template, so text filled in is never searched for placeholders.
  std::string out;
  std::string_view t = assets::html;
  while (!t.empty()) {
    const std::size_t at = t.find("{{");
    if (at == std::string_view::npos) {
      out += t;
      break;
    }
    out += t.substr(0, at);
    t.remove_prefix(at);
    bool filled = false;
    for (const auto& [key, value] : fill)
      if (t.substr(0, key.size()) == key) {
        out += value;
        t.remove_prefix(key.size());
        filled = true;
        break;
      }
    if (!filled) {
      out += "{{";
      t.remove_prefix(2);
    }
  }
  return out;
}

core::status write_atomically(const std::string& path, const std::string& text) {
  const fs::path target(path);
  const std::string tmp =
      (target.parent_path() / ("." + target.filename().string() + ".tmp" + std::to_string(::getpid())))
          .string();
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f)
    return core::error::at_file(path, std::string("cannot write the report: ") + std::strerror(errno),
                                "check that the directory exists and is writable, or pass --out");
  const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  if (std::fclose(f) != 0 || !ok) {
    std::remove(tmp.c_str());
    return core::error::at_file(path, "cannot write the report (disk full?)");
  }
  std::error_code ec;
  fs::rename(tmp, target, ec);
  if (ec) {
    std::remove(tmp.c_str());
    return core::error::at_file(path, "cannot replace the report: " + ec.message());
  }
  return {};
}

core::status write_report(const std::vector<std::string>& dirs, const std::string& out,
                          const page_options& options) {
  std::vector<run_data> runs;
  for (const auto& d : dirs) {
    auto r = read_run(d);
    if (!r) return r.err();
    runs.push_back(std::move(r.value()));
  }
  return write_atomically(out, render_page(runs, options));
}

}  // namespace troupe::report
