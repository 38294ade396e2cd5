#include "model/metrics.hpp"

#include "core/files.hpp"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

namespace troupe::model {

namespace {

// %.9g gives the shortest decimal count that round-trips every fp32 value; JSON has no NaN or
// infinity, so those are written as null (a diverged step still leaves a parseable line).
void append_float(std::string& out, const char* key, float v) {
  out += ",\"";
  out += key;
  out += "\":";
  if (!std::isfinite(v)) {
    out += "null";
    return;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", static_cast<double>(v));
  out += buf;
}

float read_float(const nlohmann::json& j, const char* key) {
  const auto& v = j.at(key);
  if (v.is_null()) return std::nanf("");
  return static_cast<float>(v.get<double>());
}

}  // namespace

std::string to_json_line(const step_metrics& m) {
  std::string out = "{\"step\":" + std::to_string(m.step);
  append_float(out, "loss", m.loss);
  append_float(out, "lr", m.lr);
  append_float(out, "grad_norm", m.grad_norm);
  append_float(out, "tokens_per_s", m.tokens_per_s);
  append_float(out, "elapsed_s", m.elapsed_s);
  if (m.val_loss) append_float(out, "val_loss", *m.val_loss);
  if (m.loss_scale) {
    append_float(out, "loss_scale", *m.loss_scale);
    out += m.skipped ? ",\"skipped\":true" : ",\"skipped\":false";
  }
  return out + "}";
}

core::result<step_metrics> parse_json_line(const std::string& line) {
  try {
    auto j = nlohmann::json::parse(line);
    step_metrics m;
    m.step = j.at("step").get<int>();
    m.loss = read_float(j, "loss");
    m.lr = read_float(j, "lr");
    m.grad_norm = read_float(j, "grad_norm");
    m.tokens_per_s = read_float(j, "tokens_per_s");
    m.elapsed_s = read_float(j, "elapsed_s");
    if (j.contains("val_loss")) m.val_loss = read_float(j, "val_loss");
    if (j.contains("loss_scale")) m.loss_scale = read_float(j, "loss_scale");
    if (j.contains("skipped")) m.skipped = j.at("skipped").get<bool>();
    return m;
  } catch (const nlohmann::json::exception& e) {
    return core::error::make(std::string("not a metrics line: ") + e.what(), "line: " + line);
  }
}

std::string format_duration(double seconds) {
  long s = seconds > 0 ? std::lround(seconds) : 0;
  char buf[32];
  if (s >= 3600)
    std::snprintf(buf, sizeof buf, "%ld:%02ld:%02ld", s / 3600, s / 60 % 60, s % 60);
  else
    std::snprintf(buf, sizeof buf, "%ld:%02ld", s / 60, s % 60);
  return buf;
}

std::string progress_line(const step_metrics& m, int total_steps, double remaining_s) {
  int width = static_cast<int>(std::to_string(total_steps).size());
  char buf[256];
  std::snprintf(buf, sizeof buf, "step %*d/%d | loss %.4f | lr %.2e | norm %.3f | %.0f tok/s | %s",
                width, m.step + 1, total_steps, m.loss, m.lr, m.grad_norm, m.tokens_per_s,
                format_duration(m.elapsed_s).c_str());
  std::string out = buf;
  if (remaining_s >= 0) out += " | ETA " + format_duration(remaining_s);
  if (m.val_loss) {
    std::snprintf(buf, sizeof buf, " | val %.4f", *m.val_loss);
    out += buf;
  }
  if (m.loss_scale && (m.skipped || m.next_loss_scale != *m.loss_scale)) {
    std::snprintf(buf, sizeof buf, " | %sloss scale → %g", m.skipped ? "skipped (overflow), " : "",
                  static_cast<double>(m.next_loss_scale));
    out += buf;
  }
  return out;
}

core::result<metrics_writer> metrics_writer::open(const std::string& run_dir, int first_step) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(run_dir, ec);
  if (ec) return core::error::at_file(run_dir, "cannot create the run directory: " + ec.message());
  metrics_writer w;
  w.path_ = (fs::path(run_dir) / "metrics.jsonl").string();

  // Keep the earlier steps of a resumed run; rewrite them atomically so a crash here never loses
  // them.
  std::string keep;
  if (first_step > 0) {
    core::input_spec spec;
    spec.what = "metrics file";
    spec.hint = "metrics.jsonl of the run being resumed";
    if (auto text = core::read_input(w.path_, spec); text) {
      std::istringstream in(text.value());
      for (std::string line; std::getline(in, line);) {
        auto m = parse_json_line(line);
        if (m && m->step < first_step) keep += line + "\n";
      }
    }
  }
  // Each line goes out in one write, so a stopped run leaves whole lines only. A fresh run starts
  // an empty file; a resumed one replaces it atomically by the lines it keeps.
  if (first_step > 0)
    if (auto st = core::write_file_atomic(w.path_, keep); !st) return st.err();
  auto f = first_step > 0 ? core::sealed_file::reopen(w.path_, keep.size())
                          : core::sealed_file::create(w.path_);
  if (!f) return f.err();
  w.f_ = std::move(f.value());
  return w;
}

core::status metrics_writer::write(const step_metrics& m) { return write_line(to_json_line(m)); }

core::status metrics_writer::write_line(const std::string& json) { return f_.append(json + "\n"); }

}  // namespace troupe::model
